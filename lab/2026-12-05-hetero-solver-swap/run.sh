#!/usr/bin/env bash
# Which part of `hetero` needs the exact direction? One seed (0), 500 steps, at the settings of the
# committed exact study docs/results/main-exact (mini, context 64, data/classics-bpe4k): the exact
# solver rerun (does it reproduce main-exact?), the products-only `projected_tangent` everywhere, and the
# two per-module swaps (`--solver-rule`). Two studies at a time, one torch thread each; resumable (rerun).
#
#   lab/2026-12-05-hetero-solver-swap/run.sh          # from the repository root
set -euo pipefail
case "${1:-}" in  # --help: the header above, and nothing run
    -h | --help) echo "usage: lab/2026-12-05-hetero-solver-swap/run.sh"; sed -n '2,/^set /s/^#\( \|$\)//p' "$0"; exit 0 ;;
esac
[ $# -eq 0 ] || { echo "usage: lab/2026-12-05-hetero-solver-swap/run.sh (no arguments; --help)" >&2; exit 2; }
cd "$(dirname "$0")/../.."
GEOMTRAIN=${GEOMTRAIN:-.venv/bin/geomtrain}
common="--model mini --seeds 1 --iters 500 --set block_size=64 --threads 1 --quiet"
out=runs/lab-hetero-solver-swap
cat <<LIST | xargs -P 2 -I{} bash -c "set -f; OMP_NUM_THREADS=1 $GEOMTRAIN study $common {}"
--presets hetero --out $out/exact
--presets hetero,all-dgram --set muon_solver=projected_tangent --out $out/pt
--presets hetero --set muon_solver_rules=*.mlp.*=projected_tangent --out $out/exact-attn-pt-mlp
--presets hetero --set muon_solver_rules=*.attn.*=projected_tangent --out $out/pt-attn-exact-mlp
LIST
