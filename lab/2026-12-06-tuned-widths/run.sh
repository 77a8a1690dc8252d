#!/usr/bin/env bash
# Issue 52: every arm at its own tuned rate, confirmed on seeds that did not select it, at three widths of the
# `mini` model (n_embd 64, 128, 256; 4 layers, 4 heads, context 64, data/classics-bpe4k), and the default solver
# against `exact` at the main settings and at context 128. Each suite is one `geomtrain study --tune` (selection on
# seed 1000 at a fraction of the horizon, the grid grown at an edge until the best value is interior, then 3
# confirmation seeds 0, 1, 2 at each arm's own value); the paired statistics are in each study's results.md.
# Two runs at a time, one torch thread each. Every suite is resumable: rerun the same step to continue;
# `pack SUITE` writes its unfinished state into this folder (state/SUITE.tar.xz) for another machine.
#
#   lab/2026-12-06-tuned-widths/run.sh [STEP ...]      # from the repository root
#
# Steps (in the order they run by default): w64 w128 exact128 w256 ctx128; pack SUITE; unpack SUITE
set -euo pipefail
case "${1:-}" in  # --help: the header above, and nothing run
    -h | --help) echo "usage: lab/2026-12-06-tuned-widths/run.sh [STEP ...]"; sed -n '2,/^set /s/^#\( \|$\)//p' "$0"; exit 0 ;;
esac
cd "$(dirname "$0")/../.."
G=${GEOMTRAIN:-.venv/bin/geomtrain}
here=lab/2026-12-06-tuned-widths
tune=(--tune muon_lr=0.005,0.01,0.02,0.04,0.08 --tune adamw:lr=3e-4,6e-4,1.2e-3,2.4e-3,4.8e-3 --select-seeds 1
    --tune-fraction 0.5)  # half the horizon: the tuner's default when these suites ran (ctx128: the whole horizon)
common=(--model mini --set block_size=64 --seeds 3 --jobs "${JOBS:-2}" --threads 1 --data-dir data/classics-bpe4k)
constrained=all-stiefel,all-dgram,hetero,hetero-inv
study() { local name=$1; shift; "$G" study "${common[@]}" "${tune[@]}" --out "docs/results/$name" "$@"; }
case "${1:-}" in
    pack) "$G" study pack "docs/results/$2" "$here/state/$2.tar.xz"; exit 0 ;;
    unpack) "$G" study unpack "$here/state/$2.tar.xz" "docs/results/$2"; exit 0 ;;
esac
for s in ${@:-w64 w128 exact128 w256 ctx128}; do case "$s" in
    w64) study tuned-w64 --iters 500 --set n_embd=64 --runs-dir runs/tuned-w64 ;;
    w128) study tuned-w128 --iters 500 --runs-dir runs/tuned-w128 ;;
    # the default arms' runs are w128's own (same run folders, same configs): only the exact arms train
    exact128) study tuned-exact-w128 --iters 500 --presets "$constrained" --solvers default,exact --reference +exact \
        --runs-dir runs/tuned-w128 ;;
    # both rates (muon_lr, then the AdamW part's lr on a 3-point grid centred on width 128's optima); see README
    w256) study tuned-w256 --iters 2000 --tune-fraction 0.25 --set n_embd=256 --runs-dir runs/tuned-w256 \
        --tune lr=4.8e-3,9.6e-3,1.92e-2 --tune-max-extend 4 ;;
    ctx128) study tuned-exact-ctx128 --iters 500 --presets "$constrained" --solvers default,exact --reference +exact \
        --set block_size=128 --runs-dir runs/tuned-ctx128 --tune-fraction 1 ;;
    *) echo "unknown step $s; valid: w64 w128 exact128 w256 ctx128, pack SUITE, unpack SUITE" >&2; exit 2 ;;
esac; done
