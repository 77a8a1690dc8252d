#!/usr/bin/env bash
# Issue 42, point 4, the long runs: the two best products-only directions of the 500-step selection
# (lab/2026-12-05-solver-selection: `projected_tangent` with 8 Polar Express steps, and `tangent`) at 2,000
# steps, seeds 0 and 1, beside the committed exact study docs/results/length-2000 (mini, context 64,
# data/classics+austen-bpe4k, 2,000 steps, seed 0), and the exact solver's seed 1 to pair with.
# One study per solver and preset, one run at a time, one torch thread; each step is resumable (rerun it).
# Run the two chains side by side, one per core:
#
#   lab/2026-12-06-selection-2000/run.sh "pt8 tangent" &   # from the repository root
#   lab/2026-12-06-selection-2000/run.sh exact &
#   lab/2026-12-06-selection-2000/run.sh compare           # when both are done (or to see what is)
#
# Preset order: where the 500-step selection lost first (hetero, all-stiefel), then all-dgram, hetero-inv.
set -euo pipefail
case "${1:-}" in  # --help: the header above, and nothing run
    -h | --help) echo "usage: lab/2026-12-06-selection-2000/run.sh [STEP ...]"; sed -n '2,/^set /s/^#\( \|$\)//p' "$0"; exit 0 ;;
esac
cd "$(dirname "$0")/../.."
GEOMTRAIN=${GEOMTRAIN:-.venv/bin/geomtrain}
here=lab/2026-12-06-selection-2000
out=runs/lab-selection-2000
presets=(hetero all-stiefel all-dgram hetero-inv)
common=(--model mini --iters 2000 --data-dir data/classics+austen-bpe4k --set block_size=64
    --set checkpoint_interval=50 --jobs 1 --threads 1 --quiet)
study() { local name=$1; shift; "$GEOMTRAIN" study "${common[@]}" --out "$out/$name" --runs-dir "$out/$name/runs" "$@"; }
for step in "${@:-pt8 tangent exact compare}"; do for s in $step; do case "$s" in
    pt8) for p in "${presets[@]}"; do
            study "pt8-$p" --presets "$p" --seeds 2 --set muon_solver=projected_tangent \
                --set muon_solver_options=msign_steps=8
        done ;;
    tangent) for p in "${presets[@]}"; do study "tangent-$p" --presets "$p" --seeds 2 --set muon_solver=tangent; done ;;
    exact) for p in "${presets[@]}"; do study "exact-$p" --presets "$p" --seeds 1, ; done ;;
    compare) mkdir -p "$here/results"
        for d in "$out"/*/; do n=$(basename "$d"); [ -f "$d/summary.json" ] || continue
            mkdir -p "$here/results/$n"; cp "$d"/{results.md,summary.json,study.json} "$here/results/$n/"; done
        .venv/bin/python "$here/table.py" --out "$here/results/table.md" ;;
    *) echo "unknown step $s; valid: pt8 tangent exact compare" >&2; exit 2 ;;
esac; done; done
