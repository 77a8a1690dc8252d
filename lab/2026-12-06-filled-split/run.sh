#!/usr/bin/env bash
# Issue 42, point 4, a DGram candidate: `filled_split` (split_tangent's square part at its best share, the complement
# filling the rest of the spectral budget) on the DGram matrices, training's default (split_tangent) on the Stiefel
# ones, against exact, at the settings of the committed exact study docs/results/main-exact (mini, context 64,
# data/classics-bpe4k, 500 steps), 3 seeds paired with its runs. Two runs at a time, one torch thread each; every
# step is resumable (rerun it).
#
#   lab/2026-12-06-filled-split/run.sh [STEP ...]      # from the repository root; default: every step
#
# Steps: hetero all-dgram hetero-inv hetero-joint hetero-steps6 hetero-joint6 hetero-refine1 joint6-rest directions compare
set -euo pipefail
case "${1:-}" in  # --help: the header above, and nothing run
    -h | --help) echo "usage: lab/2026-12-06-filled-split/run.sh [STEP ...]"; sed -n '2,/^set /s/^#\( \|$\)//p' "$0"; exit 0 ;;
esac
cd "$(dirname "$0")/../.."
GEOMTRAIN=${GEOMTRAIN:-.venv/bin/geomtrain}
here=lab/2026-12-06-filled-split
out=runs/lab-filled-split
common=(--model mini --iters 500 --set block_size=64 --jobs 2 --quiet --seeds 3)
study() { local name=$1; shift; "$GEOMTRAIN" study "${common[@]}" --out "$out/$name" --runs-dir "$out/$name/runs" "$@"; }
for step in "${@:-hetero all-dgram hetero-inv directions compare}"; do for s in $step; do case "$s" in
    hetero) study hetero --presets hetero --set 'muon_solver_rules=*.mlp.*=filled_split' ;;  # DGram MLP
    all-dgram) study all-dgram --presets all-dgram --set muon_solver=filled_split ;;
    hetero-inv) study hetero-inv --presets hetero-inv --set 'muon_solver_rules=*.attn.*=filled_split' ;;  # DGram attention
    hetero-joint)  # the square part from the joint msign (square=joint), on every matrix (a solver's options are
        # the group's, so per-module rules cannot give it to the DGram MLP alone)
        study hetero-joint --presets hetero --set muon_solver=filled_split --set muon_solver_options=square=joint ;;
    hetero-steps6)  # filled_split on every matrix at its own 6 Polar Express steps, named: ManifoldMuon's msign_steps
        # (5) replaced the solver's default in every run above
        study hetero-steps6 --presets hetero --set muon_solver=filled_split --set muon_solver_options=msign_steps=6 ;;
    hetero-joint6)  # square=joint at 6 Polar Express steps, on every matrix
        study hetero-joint6 --presets hetero --set muon_solver=filled_split \
            --set 'muon_solver_options=square=joint;msign_steps=6' ;;
    hetero-refine1)  # one damped fixed-point step on the multiplier after the fill (refine=1), on every matrix; from
        # here on the library leaves the solver its own 6 Polar Express steps
        study hetero-refine1 --presets hetero --set muon_solver=filled_split --set muon_solver_options=refine=1 ;;
    joint6-rest)  # square=joint without refinement (hetero-joint6's solver) on the two DGram-attention presets
        study all-dgram-joint6 --presets all-dgram --set muon_solver=filled_split \
            --set 'muon_solver_options=square=joint;refine=0'
        study hetero-inv-joint6 --presets hetero-inv --set muon_solver=filled_split \
            --set 'muon_solver_options=square=joint;refine=0' ;;
    directions) mkdir -p "$here/results"
        .venv/bin/python "$here/directions.py" "$out/hetero-refine1/runs/hetero/s0/ckpt.pt" \
            --out "$here/results/directions-hetero-refine1-s0.md"
        .venv/bin/python "$here/directions.py" "$out/all-dgram/runs/all-dgram/s0/ckpt.pt" \
            --out "$here/results/directions-all-dgram-s0.md" ;;
    compare) mkdir -p "$here/results"
        for d in "$out"/*/; do n=$(basename "$d"); [ -f "$d/summary.json" ] || continue
            mkdir -p "$here/results/$n"; cp "$d"/{results.md,summary.json,study.json} "$here/results/$n/"; done
        .venv/bin/python "$here/table.py" --out "$here/results/table.md" ;;
    *) echo "unknown step $s; valid: hetero all-dgram hetero-inv hetero-joint hetero-steps6 hetero-joint6 hetero-refine1 joint6-rest directions compare" >&2
        exit 2 ;;
esac; done; done
