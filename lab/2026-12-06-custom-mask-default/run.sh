#!/usr/bin/env bash
# Issue 55: the products-only default direction for a custom mask. filled_split runs on any mask through the split
# W = U H0 (geomtrain/optim/column_split.py); this study pairs it with exact, training's default for custom masks
# until now, on a custom-mask preset: hetero with its c_attn and MLP matrices on `blockmask@16` (columns orthogonal
# across blocks of 16, written with project_gram only: blockmask.py), at the settings of the selection studies
# (mini, context 64, data/classics-bpe4k, 500 steps, 3 seeds paired; the study's verdict rule, --delta 0.005).
# The attention c_proj stays Stiefel (square: filled_split's direction there is exact's optimum). Run from a
# snapshot of the commit (LIB, default the repository) so that edits to the working tree do not reach the runs.
#
#   lab/2026-12-06-custom-mask-default/run.sh [STEP ...]      # from the repository root
#
# Steps: study compare
set -euo pipefail
case "${1:-}" in  # --help: the header above, and nothing run
    -h | --help) echo "usage: lab/2026-12-06-custom-mask-default/run.sh [STEP ...]"; sed -n '2,/^set /s/^#\( \|$\)//p' "$0"; exit 0 ;;
esac
cd "$(dirname "$0")/../.."
here=lab/2026-12-06-custom-mask-default
LIB=${LIB:-$PWD}
PYTHON=${PYTHON:-.venv/bin/python}
out=runs/lab-custom-mask
for s in "${@:-study compare}"; do for step in $s; do case "$step" in
    study) PYTHONPATH="$LIB:$LIB/$here" nice -n 10 "$PYTHON" -m geomtrain study --model mini --presets hetero \
            --solvers filled_split,exact --reference hetero+exact --seeds 3 --iters 500 --set block_size=64 \
            --data-dir data/classics-bpe4k --set manifold_modules=blockmask \
            --set 'rules=*.attn.c_attn.weight=blockmask@16;*.mlp.*=blockmask@16' \
            --jobs 2 --threads 1 --quiet --out "$out/hetero-blockmask" ;;
    compare) mkdir -p "$here/results"
        cp "$out/hetero-blockmask"/{results.md,summary.json,study.json} "$here/results/" ;;
    *) echo "unknown step $step; valid: study compare" >&2; exit 2 ;;
esac; done; done
