#!/usr/bin/env bash
# Issue 42, point 4, a new candidate: the `split_tangent` direction (its default, 6 Polar Express steps) against exact,
# trained at the settings of the committed exact study docs/results/main-exact (mini, context 64,
# data/classics-bpe4k, 500 steps), 3 seeds paired with its runs; then the direction statistics on a checkpoint.
# Two runs at a time, one torch thread each; every step is resumable (rerun it).
#
#   lab/2026-12-06-split-tangent/run.sh [STEP ...]      # from the repository root; default: every step
#
# Steps: split per-kind sub-probe directions compare
set -euo pipefail
case "${1:-}" in  # --help: the header above, and nothing run
    -h | --help) echo "usage: lab/2026-12-06-split-tangent/run.sh [STEP ...]"; sed -n '2,/^set /s/^#\( \|$\)//p' "$0"; exit 0 ;;
esac
cd "$(dirname "$0")/../.."
GEOMTRAIN=${GEOMTRAIN:-.venv/bin/geomtrain}
here=lab/2026-12-06-split-tangent
out=runs/lab-split-tangent
common=(--model mini --iters 500 --set block_size=64 --jobs 2 --quiet)
split=(--set muon_solver=split_tangent)
study() { local name=$1; shift; "$GEOMTRAIN" study "${common[@]}" --out "$out/$name" --runs-dir "$out/$name/runs" "$@"; }
for step in "${@:-split per-kind sub-probe directions compare}"; do for s in $step; do case "$s" in
    split) study split --presets hetero,all-stiefel,all-dgram,hetero-inv --seeds 3 "${split[@]}" ;;
    per-kind)  # split_tangent on the Stiefel matrices only, exact on the DGram ones: the presets that mix them
        study stiefel-split --presets hetero --seeds 3 --set 'muon_solver_rules=*.attn.*=split_tangent'
        study stiefel-split-inv --presets hetero-inv --seeds 3 --set 'muon_solver_rules=*.mlp.*=split_tangent' ;;
    sub-probe)  # ADMM on the square DGram part, where the split loses most (hetero's DGram MLP), seed 0
        study split-sub2 --presets hetero --seeds 1 "${split[@]}" --set muon_solver_options=sub_steps=2 ;;
    directions) mkdir -p "$here/results"
        .venv/bin/python "$here/directions.py" "$out/split/runs/hetero/s0/ckpt.pt" --out "$here/results/directions-hetero-s0.md"
        .venv/bin/python "$here/directions.py" "$out/split/runs/all-stiefel/s0/ckpt.pt" \
            --out "$here/results/directions-all-stiefel-s0.md" ;;
    compare) mkdir -p "$here/results"
        for d in "$out"/*/; do n=$(basename "$d"); [ -f "$d/summary.json" ] || continue
            mkdir -p "$here/results/$n"; cp "$d"/{results.md,summary.json,study.json} "$here/results/$n/"; done
        .venv/bin/python "$here/table.py" --out "$here/results/table.md" ;;
    *) echo "unknown step $s; valid: split per-kind sub-probe directions compare" >&2; exit 2 ;;
esac; done; done
