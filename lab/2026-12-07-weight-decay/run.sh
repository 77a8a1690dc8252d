#!/usr/bin/env bash
# Does weight decay belong in the tuning protocol? The tuned studies tune each arm's learning rates and keep the
# published weight decay: AdamW's 0.1 on 2-D weights (the embeddings and tied head of every arm; every matrix of
# `adamw`), and none on Muon's Euclidean matrices (`muon_weight_decay` 0, used by `unconstrained` only: a manifold
# has no decay). Each arm here trains at its chosen rates of docs/results/tuned-lr-w128 (`min_lr` = lr / 10, as
# there), on the selection seed 1000 at the selection horizon (250 steps, warmup 25, evaluation every 12), with
# the decay swept around the default; the default's run repeats the study's selection run, whose score it must
# reproduce. Width 128 (`mini`, context 64, data/classics-bpe4k), one run at a time, one torch thread.
#
#   lab/2026-12-07-weight-decay/run.sh [STEP ...]     # from the repository root
#
# Steps (in the order they run by default):
#   adamw          `weight_decay` 0, 0.1, 0.3, 1 at lr 2.4e-3
#   unconstrained  `weight_decay` 0, 0.1, 0.3 at muon_lr 0.01, lr 1.92e-2; then `muon_weight_decay` 0.1, 0.3, 1, 3
#   all-stiefel    `weight_decay` 0, 0.1, 0.3 at muon_lr 0.04, lr 3.84e-2
#   hetero         `weight_decay` 0, 0.1, 0.3 at muon_lr 0.04, lr 3.84e-2
# Each writes lab/2026-12-07-weight-decay/results/<step>[-muon]/ (results.md: the table, one row per value).
set -euo pipefail
case "${1:-}" in  # --help: the header above, and nothing run
    -h | --help) echo "usage: lab/2026-12-07-weight-decay/run.sh [STEP ...]"; sed -n '2,/^set /s/^#\( \|$\)//p' "$0"; exit 0 ;;
esac
cd "$(dirname "$0")/../.."
G=${GEOMTRAIN:-.venv/bin/geomtrain}
here=lab/2026-12-07-weight-decay
select=(--model mini --set block_size=64 --jobs 1 --threads 1 --data-dir data/classics-bpe4k --iters 250 --seeds 1000,
    --set warmup_iters=25 --set eval_interval=12)
sweep() {  # NAME PRESET MUON_LR LR KEY=VALUES: one preset at its chosen rates, one key swept
    local name=$1 preset=$2 muon_lr=$3 lr=$4 grid=$5 min_lr
    min_lr=$(python3 -c "print('%g' % ($lr / 10))")
    "$G" study "${select[@]}" --presets "$preset" --set muon_lr="$muon_lr" --set lr="$lr" --set min_lr="$min_lr" \
        --sweep "$grid" --out "$here/results/$name" --runs-dir "runs/wd-$name"
}
for s in ${@:-adamw unconstrained all-stiefel hetero}; do case "$s" in
    adamw) sweep adamw adamw 0.02 0.0024 weight_decay=0,0.1,0.3,1 ;;
    unconstrained) sweep unconstrained unconstrained 0.01 0.0192 weight_decay=0,0.1,0.3
        sweep unconstrained-muon unconstrained 0.01 0.0192 muon_weight_decay=0.1,0.3,1,3 ;;
    all-stiefel) sweep all-stiefel all-stiefel 0.04 0.0384 weight_decay=0,0.1,0.3 ;;
    hetero) sweep hetero hetero 0.04 0.0384 weight_decay=0,0.1,0.3 ;;
    *) echo "unknown step $s; valid: adamw unconstrained all-stiefel hetero" >&2; exit 2 ;;
esac; done
