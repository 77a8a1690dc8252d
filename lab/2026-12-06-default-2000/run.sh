#!/usr/bin/env bash
# Issue 42, point 4, the long runs of the chosen default: training's default (filled_split, its joint square part,
# no refinement, in Gram space, on every Stiefel and DGram matrix) on `hetero`, the preset where it is closest to
# the +0.005 rule at 500 steps, at 2,000 steps, seeds 0 and 1, beside the committed exact study
# docs/results/length-2000 (mini, context 64, data/classics+austen-bpe4k, 2,000 steps, seed 0) and the exact
# solver's seed 1 of lab/2026-12-06-selection-2000 (results/exact-hetero). Resumable: rerun a step.
#
#   lab/2026-12-06-default-2000/run.sh default    # from the repository root: both seeds, two runs at a time
#   lab/2026-12-06-default-2000/run.sh refine1    # the runner-up: filled_split with one refinement step
#   lab/2026-12-06-default-2000/run.sh compare    # the paired table
set -euo pipefail
case "${1:-}" in  # --help: the header above, and nothing run
    -h | --help) echo "usage: lab/2026-12-06-default-2000/run.sh [STEP ...]"; sed -n '2,/^set /s/^#\( \|$\)//p' "$0"; exit 0 ;;
esac
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
here=lab/2026-12-06-default-2000
out=runs/lab-default-2000
for step in "${@:-default compare}"; do for s in $step; do case "$s" in
    default) "$PYTHON" -m geomtrain study --model mini --iters 2000 --data-dir data/classics+austen-bpe4k \
            --set block_size=64 --set checkpoint_interval=50 --presets hetero --seeds 2 --jobs 2 --threads 1 \
            --quiet --out "$out/default-hetero" --runs-dir "$out/default-hetero/runs" ;;
    refine1) "$PYTHON" -m geomtrain study --model mini --iters 2000 --data-dir data/classics+austen-bpe4k \
            --set block_size=64 --set checkpoint_interval=50 --presets hetero --seeds 2 --jobs 2 --threads 1 \
            --set muon_solver=filled_split --set 'muon_solver_options=refine=1' \
            --quiet --out "$out/refine1-hetero" --runs-dir "$out/refine1-hetero/runs" ;;
    compare) for name in default-hetero refine1-hetero; do [ -f "$out/$name/summary.json" ] || continue
            mkdir -p "$here/results/$name"; cp "$out/$name"/{results.md,summary.json,study.json} "$here/results/$name/"
        done
        "$PYTHON" "$here/table.py" --out "$here/results/table.md" ;;
    *) echo "unknown step $s; valid: default refine1 compare" >&2; exit 2 ;;
esac; done; done
