#!/usr/bin/env bash
# Issue 42, point 4: filled_split (joint square part, no refinement, Gram space) with its multiplier carried from
# step to step (carry=True: each solve starts its joint msign from N(G) plus the correction the previous step left,
# and ends with one dual step toward that msign's tangency, no product more), against exact at the settings of the
# committed exact study docs/results/main-exact (mini, context 64, data/classics-bpe4k, 500 steps), 3 seeds paired
# with its runs; then at 2,000 steps on hetero beside lab/2026-12-06-default-2000, and the main study with carry=True
# the default. Two runs at a time, one torch thread each; every step is resumable (rerun it).
#
#   lab/2026-12-06-carried-multiplier/run.sh [STEP ...]      # from the repository root
#
# Steps: absolute absolute-step025 hetero long main directions compare
# (absolute and absolute-step025 carried the multiplier itself, not its correction to N(G): they ran at 612600b;
# hetero at 884932a, where carry was not yet the default; long and main at 515c93a, where it is)
set -euo pipefail
case "${1:-}" in  # --help: the header above, and nothing run
    -h | --help) echo "usage: lab/2026-12-06-carried-multiplier/run.sh [STEP ...]"; sed -n '2,/^set /s/^#\( \|$\)//p' "$0"; exit 0 ;;
esac
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
here=lab/2026-12-06-carried-multiplier
out=runs/lab-carried
carry=(--set muon_solver=filled_split --set 'muon_solver_options=carry=True')
common=(--model mini --set block_size=64 --jobs 2 --threads 1 --quiet)
study() { local name=$1; shift; "$PYTHON" -m geomtrain study "${common[@]}" --out "$out/$name" --runs-dir "$out/$name/runs" "$@"; }
for step in "${@:-hetero long main directions compare}"; do for s in $step; do case "$s" in
    absolute) study hetero-absolute --iters 500 --seeds 3 --presets hetero "${carry[@]}" ;;
    absolute-step025)  # a smaller dual step (carry_step=0.25; the default 0.5)
        study hetero-absolute-step025 --iters 500 --seeds 3 --presets hetero --set muon_solver=filled_split \
            --set 'muon_solver_options=carry=True;carry_step=0.25' ;;
    hetero) study hetero --iters 500 --seeds 3 --presets hetero "${carry[@]}" ;;
    long)  # at the settings of docs/results/length-2000 (its exact run is seed 0; seed 1: lab/2026-12-06-selection-2000)
        study long-hetero --iters 2000 --seeds 2 --presets hetero --data-dir data/classics+austen-bpe4k \
            --set checkpoint_interval=50 "${carry[@]}" ;;
    main)  # the main study (six presets) with the new default, as docs/results/main-products
        "$PYTHON" -m geomtrain study --seeds 3 --iters 500 --set block_size=64 --jobs 2 --quiet --out runs/main-carry \
            --runs-dir runs/study-main-carry ;;
    directions) mkdir -p "$here/results"
        "$PYTHON" "$here/directions.py" runs/lab-filled-split/hetero-refine1/runs/hetero/s0/ckpt.pt --solves 40 \
            --out "$here/results/directions-hetero-s0.md"
        "$PYTHON" "$here/directions.py" runs/lab-filled-split/all-dgram-joint6/runs/all-dgram/s0/ckpt.pt --solves 40 \
            --out "$here/results/directions-all-dgram-s0.md"
        "$PYTHON" "$here/directions.py" "$out/hetero/runs/hetero/s0/ckpt.pt" --solves 1 \
            --out "$here/results/directions-carried-hetero-s0.md"
        for name in hetero-absolute hetero-absolute-step025; do
            "$PYTHON" "$here/directions.py" "$out/$name/runs/hetero/s0/ckpt.pt" --solves 1 \
                --out "$here/results/directions-carried-$name-s0.md"; done ;;
    compare) for d in "$out"/*/; do n=$(basename "$d"); [ -f "$d/summary.json" ] || continue
            mkdir -p "$here/results/$n"; cp "$d"/{results.md,summary.json,study.json} "$here/results/$n/"; done
        if [ -f runs/main-carry/summary.json ]; then mkdir -p "$here/results/main-carry"
            cp runs/main-carry/{results.md,summary.json,study.json} "$here/results/main-carry/"; fi
        "$PYTHON" "$here/table.py" --out "$here/results/table.md" ;;
    *) echo "unknown step $s; valid: absolute absolute-step025 hetero long main directions compare" >&2; exit 2 ;;
esac; done; done
