#!/usr/bin/env bash
# The GPU figures of the docs (Manifold Muon "On a GPU", Training "Speed (measured)"), as one
# prepared script for a lent GPU machine that has torch but no package index:
#
#   bash scripts/gpu_figures.sh OUT_DIR [OPT_SECONDS] [TRAIN_SECONDS]
#
# Needs data/classics (`geomtrain prepare`) and geoopt importable (on a machine without an index:
# a geoopt wheel in .whl/, installed here into a temporary site folder). Each part runs under its
# own time limit and writes its log and JSON into OUT_DIR as it goes, so a part cut short still
# leaves its per-matrix / per-step lines.
set -u
OUT_DIR=${1:?usage: gpu_figures.sh OUT_DIR [OPT_SECONDS] [TRAIN_SECONDS]}
OPT_SECONDS=${2:-240}
TRAIN_SECONDS=${3:-240}
mkdir -p "$OUT_DIR"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if ! "$PY" -c "import geoopt" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-site .whl/geoopt-*.whl || exit 1
    export PYTHONPATH=/tmp/gpu-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT_DIR/gpu.txt" 2>&1
git rev-parse HEAD >>"$OUT_DIR/gpu.txt" 2>/dev/null

# 1. Smoke test: one solve per manifold and one optimizer step on CUDA (fails fast on a device bug).
timeout 120 "$PY" - <<'EOF' 2>&1 | tee "$OUT_DIR/smoke.log"
import torch, time
from manifolds import DGram, Stiefel
from geomtrain.optim import spectral_direction, ManifoldMuon
print("torch", torch.__version__, torch.cuda.get_device_name())
for man in (Stiefel(), DGram()):
    for shape in ((384, 128), (128, 128), (128, 512)):
        W = man.random(*shape).cuda()
        G = torch.randn(*shape, device="cuda")
        t = time.perf_counter()
        A, st = spectral_direction(man, W, G)
        torch.cuda.synchronize()
        print(type(man).__name__, shape, "evaluations", int(st.evaluations), "residual", f"{float(st.residual):.1e}",
              "opnorm", f"{float(torch.linalg.matrix_norm(A.double(), 2)):.6f}", f"{time.perf_counter() - t:.3f}s")
p = torch.nn.Parameter(DGram().random(256, 64).cuda())
opt = ManifoldMuon([{"params": [p], "manifold": DGram()}], lr=0.02)
p.grad = torch.randn_like(p)
opt.step()
print("optimizer step ok:", opt.last_stats["msign_calls"], "evaluations")
EOF
[ "${PIPESTATUS[0]}" = 0 ] || { echo "smoke test failed"; exit 1; }

# 2. The optimizer benchmark at 12 layers (all four GPT-2-small matrices, both manifolds).
timeout "$OPT_SECONDS" "$PY" -m geomtrain bench optimizer --device cuda --layers 12 --quick --repeats 2 \
    --out "$OUT_DIR/optimizer-gpu.json" 2>&1 | tee "$OUT_DIR/optimizer.log"

# 3. Training step time of gpt2 (124M, context 1024) for every preset, side by side.
timeout "$TRAIN_SECONDS" "$PY" -m geomtrain bench train --model gpt2 --device cuda --steps 3 --warmup 1 \
    --data-dir data/classics --out "$OUT_DIR/train-gpt2.json" 2>&1 | tee "$OUT_DIR/train.log"
exit 0
