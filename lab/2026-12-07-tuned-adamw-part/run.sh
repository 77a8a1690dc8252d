#!/usr/bin/env bash
# Muon's AdamW part tuned too: every preset with both of its rates tuned, one after the other (`muon_lr` for the
# hidden matrices, then `lr` for the AdamW part: embeddings, head, norms, biases, at the chosen `muon_lr`), and
# `adamw` with its `lr` tuned on the same grid. Width 128 (`mini`, the main settings: 4 layers, 4 heads, context 64,
# data/classics-bpe4k), 500 steps; selection on seed 1000 at 250 steps, each grid grown at an edge until its best
# value is interior (by at most 4 points); then 3 confirmation seeds 0, 1, 2. One run at a time (JOBS=2 for two),
# one torch thread.
# Resumable: rerun a step to continue; `pack`/`unpack` move an unfinished study to another machine.
#
#   lab/2026-12-07-tuned-adamw-part/run.sh [STEP ...]     # from the repository root
#
# Steps (in the order they run by default):
#   presets   the tuned study: docs/results/tuned-lr-w128
#   check     a second pass on `unconstrained`: `muon_lr` 0.005 and 0.02 at its chosen `lr` 0.0096, selection seed
#             and horizon (is `muon_lr` 0.01 still the best after `lr` moved?): lab/.../results/second-pass
#   floor     the schedule's floor: `min_lr` stays 6e-5 while `lr` is tuned (the default's floor is lr/10); selection
#             seed and horizon, `unconstrained` and `all-stiefel` at their chosen rates, the floor at 6e-5 and at
#             lr/10 (Muon's rate follows lr_t/lr, so its floor moves too): lab/.../results/floor-<preset>
#   second-pass  the `check` step for the four constrained presets of docs/results/tuned-lr-w128 with the scaled
#             floor: each at half and twice its chosen `muon_lr`, at its chosen `lr` (`min_lr` = lr / 10), selection
#             seed and horizon: lab/.../results/second-pass-<preset>
#   horizon   the selection seed at the full horizon: each preset whose choice the later passes of `presets` moved,
#             at its one-pass and its later-pass rates (`muon_lr`, `lr`; `min_lr` = lr / 10), seed 1000, 500 steps:
#             lab/.../results/horizon-<preset>-<muon_lr>-<lr> (does the half-horizon selection prefer higher rates?)
#   w64       the `presets` study at n_embd 64 (the width plot's narrowest point with both rates tuned):
#             docs/results/tuned-lr-w64
#   pack | unpack [STUDY]   a study (default tuned-lr-w128; tuned-lr-w64 for `w64`) to or from state/STUDY.tar.xz
set -euo pipefail
case "${1:-}" in  # --help: the header above, and nothing run
    -h | --help) echo "usage: lab/2026-12-07-tuned-adamw-part/run.sh [STEP ...]"; sed -n '2,/^set /s/^#\( \|$\)//p' "$0"; exit 0 ;;
esac
cd "$(dirname "$0")/../.."
G=${GEOMTRAIN:-.venv/bin/geomtrain}
here=lab/2026-12-07-tuned-adamw-part
both=(--tune muon_lr=0.005,0.01,0.02,0.04,0.08 --tune lr=2.4e-3,4.8e-3,9.6e-3,1.92e-2,3.84e-2 --select-seeds 1
    --tune-max-extend 4 --tune-fraction 0.5)  # half the horizon: the tuner's default when these studies ran
common=(--model mini --set block_size=64 --jobs "${JOBS:-1}" --threads 1 --data-dir data/classics-bpe4k)
case "${1:-}" in
    pack) "$G" study pack "docs/results/${2:-tuned-lr-w128}" "$here/state/${2:-tuned-lr-w128}.tar.xz"; exit 0 ;;
    unpack) "$G" study unpack "$here/state/${2:-tuned-lr-w128}.tar.xz" "docs/results/${2:-tuned-lr-w128}"; exit 0 ;;
esac
for s in ${@:-presets check floor second-pass horizon w64}; do case "$s" in
    presets) "$G" study "${common[@]}" --iters 500 --seeds 3 "${both[@]}" \
        --out docs/results/tuned-lr-w128 --runs-dir runs/tuned-lr-w128 ;;
    w64) "$G" study "${common[@]}" --iters 500 --seeds 3 "${both[@]}" --set n_embd=64 \
        --out docs/results/tuned-lr-w64 --runs-dir runs/tuned-lr-w64 ;;
    floor) for arm in unconstrained:0.01:0.0096 all-stiefel:0.04:0.0384; do IFS=: read -r p m l <<< "$arm"
        "$G" study "${common[@]}" --iters 250 --seeds 1000, --presets "$p" --set muon_lr="$m" --set lr="$l" \
            --sweep min_lr="$(python3 -c "print('%g' % ($l / 10))")" --set warmup_iters=25 --set eval_interval=12 \
            --out "$here/results/floor-$p" --runs-dir "runs/tuned-lr-floor-$p"; done ;;
    second-pass) for arm in all-stiefel:0.02,0.08:0.0384 all-dgram:0.005,0.02:0.0096 hetero:0.02,0.08:0.0384 \
            hetero-inv:0.005,0.02:0.0192; do IFS=: read -r p m l <<< "$arm"
        "$G" study "${common[@]}" --iters 250 --seeds 1000, --presets "$p" --sweep muon_lr="$m" --set lr="$l" \
            --set min_lr="$(python3 -c "print('%g' % ($l / 10))")" --set warmup_iters=25 --set eval_interval=12 \
            --out "$here/results/second-pass-$p" --runs-dir "runs/tuned-lr-second-pass-$p"; done ;;
    check) "$G" study "${common[@]}" --iters 250 --seeds 1000, --presets unconstrained \
        --sweep muon_lr=0.005,0.02 --set lr=0.0096 --set warmup_iters=25 --set eval_interval=12 \
        --out "$here/results/second-pass" --runs-dir runs/tuned-lr-second-pass ;;
    horizon) for arm in hetero:0.04:0.0384 hetero:0.08:0.0768 unconstrained:0.01:0.0192 unconstrained:0.02:0.0192 \
            all-dgram:0.01:0.0096 all-dgram:0.02:0.0192 hetero-inv:0.01:0.0192 hetero-inv:0.02:0.0384; do
        IFS=: read -r p m l <<< "$arm"
        "$G" study "${common[@]}" --iters 500 --seeds 1000, --presets "$p" --set muon_lr="$m" --set lr="$l" \
            --set min_lr="$(python3 -c "print('%g' % ($l / 10))")" --out "$here/results/horizon-$p-$m-$l" \
            --runs-dir "runs/tuned-lr-horizon-$p-$m-$l"; done ;;
    *) echo "unknown step $s; valid: presets check floor second-pass horizon w64, pack, unpack" >&2; exit 2 ;;
esac; done
