#!/usr/bin/env bash
# Issue 42, point 4: products-only candidates against the exact solver and `tangent`, trained, at the settings of
# the committed exact study docs/results/main-exact (mini, context 64, data/classics-bpe4k, 500 steps), 3 seeds
# paired with its runs. One study per candidate, two runs at a time (one torch thread each); each line is
# resumable (rerun it), and a later line with more seeds reuses the earlier seeds' runs.
#
#   lab/2026-12-05-solver-selection/run.sh [STEP ...]      # from the repository root; default: every step
#
# Steps: pt8-probe pt8 lr-check pt8r3-probe tangent-hetero-inv dual-probe compare
set -euo pipefail
case "${1:-}" in  # --help: the header above, and nothing run
    -h | --help) echo "usage: lab/2026-12-05-solver-selection/run.sh [STEP ...]"; sed -n '2,/^set /s/^#\( \|$\)//p' "$0"; exit 0 ;;
esac
cd "$(dirname "$0")/../.."
GEOMTRAIN=${GEOMTRAIN:-.venv/bin/geomtrain}
here=lab/2026-12-05-solver-selection
out=runs/lab-solver-selection
presets=hetero,all-dgram,all-stiefel,hetero-inv
common=(--model mini --iters 500 --set block_size=64 --jobs 2 --quiet)
pt=(--set muon_solver=projected_tangent)
study() { local name=$1; shift; "$GEOMTRAIN" study "${common[@]}" --out "$out/$name" --runs-dir "$out/$name/runs" "$@"; }
for step in "${@:-pt8-probe pt8 lr-check pt8r3-probe tangent-hetero-inv dual-probe compare}"; do for s in $step; do case "$s" in
    pt8-probe) study pt8 --presets "$presets" --seeds 1 "${pt[@]}" --set muon_solver_options=msign_steps=8 ;;
    pt8) study pt8 --presets "$presets" --seeds 3 "${pt[@]}" --set muon_solver_options=msign_steps=8 ;;
    lr-check)  # is projected_tangent the exact direction at a smaller step? muon_lr 0.02 / 0.77 where it lost
        study pt8-lr0.026 --presets hetero,all-stiefel --seeds 1 "${pt[@]}" --set muon_solver_options=msign_steps=8 --set muon_lr=0.026
        study pt8-lr0.033 --presets hetero,all-stiefel --seeds 1 "${pt[@]}" --set muon_solver_options=msign_steps=8 --set muon_lr=0.033 ;;
    pt8r3-probe)  # three alternating projections (a fuller spectrum) where one round lost: hetero, all-stiefel
        study pt8r3 --presets hetero,all-stiefel --seeds 1 "${pt[@]}" --set "muon_solver_options=msign_steps=8;rounds=3" ;;
    tangent-hetero-inv) study tangent-hetero-inv --presets hetero-inv --seeds 3 --set muon_solver=tangent ;;
    dual-probe)  # the streaming dual (multiplier carried from step to step) where one projection lost: hetero
        study dual --presets hetero --seeds 1 --set muon_solver=dual_ascent --set muon_certify_every=50
        study dual-eta0.5 --presets hetero --seeds 1 --set muon_solver=dual_ascent --set muon_solver_options=eta=0.5 \
            --set muon_certify_every=50 ;;
    compare) mkdir -p "$here/results"
        for d in "$out"/*/; do n=$(basename "$d"); [ -f "$d/summary.json" ] || continue
            mkdir -p "$here/results/$n"; cp "$d"/{results.md,summary.json,study.json} "$here/results/$n/"; done ;;
    *) echo "unknown step $s; valid: pt8-probe pt8 lr-check pt8r3-probe tangent-hetero-inv dual-probe compare" >&2; exit 2 ;;
esac; done; done
