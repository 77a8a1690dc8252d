#!/usr/bin/env bash
# The GPU points of the exact-solver and study issues as one prepared command for a lent device
# machine (docs/results.md, "On a GPU"). In the repository root there:
#
#   scripts/gpu_checks.sh [MINUTES]      # default 5; everything lands in $OUT (else runs/gpu-checks)
#
# 1. `optimizer`: `geomtrain bench optimizer --quick` at 12 GPT-2-small layers: per-matrix and
#    per-layer solver cost against plain Muon (bench_optimizer.json);
# 2. `recipe`: scripts/recipe_steps.py, the paper's setting (`gpt2`: 64 x 1024 tokens a step, bf16
#    autocast, TF32) for STEPS (default 50) steps of every preset, as many as its share of the budget
#    allows: tokens/s, MFU, the optimizer's share of a step, polar evaluations and peak memory
#    (recipe.json and a table in gpu_checks.log; RECIPE_SETS="--set batch_size=32 --set grad_accum=2"
#    halves the activations at the same tokens per step). 50 steps of all six presets take ~13 min
#    at the H200 step times of docs/training.md: `PARTS=recipe scripts/gpu_checks.sh 13`;
# 3. `kernels` (on CUDA): lab/2026-12-04-gpu-profile/gpu_profile.py: the solver's kernels timed,
#    and a profile of warm solves (kernels.json);
# 4. `study`: a study of the `gpt2` config, one seed, every preset, for as many steps as the rest of
#    the budget allows at the step times just measured (short runs, to be reported as such), packed
#    with its report as gpt2_short.tar.gz (the device returns at most 8 files).
# Each part runs under its share of MINUTES (15%, 40%, 90 s, 35%) and is stopped (SIGINT: runs
# checkpoint) at its end, so the whole fits in a 15-minute device lease with time to rerun it once.
# Needs python3 with torch (the device image has it), geoopt (carry its wheel in .whl/, see
# docs/results.md) and data/classics (carry it: prepared here with the GPT-2 tokenizer).
# MODEL, DEVICE, DATA, STEPS, PARTS (which parts, default all four), LAYERS and BENCH_ARGS override
# the defaults. CPU smoke test (tests/docs/test_gpu_checks.py): MODEL=tiny DEVICE=cpu LAYERS=1
# BENCH_ARGS="--shapes 96x32 32x96" STEPS=1; BENCH_ARGS="--points init" benchmarks the weights
# training starts from instead of the manifolds' random points.
set -uo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-5}
out=${OUT:-runs/gpu-checks}
model=${MODEL:-gpt2}
device=${DEVICE:-cuda}
data=${DATA:-data/classics}
parts=" ${PARTS:-optimizer recipe kernels study} "
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
log=$out/gpu_checks.log
seconds() { python3 -c "print(max(30, int($minutes * 60 * $1)))"; }   # a share of the budget
gt() { timeout -s INT -k 30 "$1" python3 -m geomtrain "${@:2}" 2>&1 | tee -a "$log"; }
{
    date -u
    nvidia-smi 2>/dev/null || echo "no nvidia-smi"
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
} >"$out/machine.txt" 2>&1

# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
# --repeats 2: the first CUDA solve also pays cuSOLVER's start-up (1.6 s against 0.04 s, measured on an H200)
[[ $parts == *" optimizer "* ]] && gt "$(seconds 0.15)" bench optimizer --device "$device" --layers "${LAYERS:-12}" \
    --quick --repeats 2 --out "$out/bench_optimizer.json" ${BENCH_ARGS:-}

# The paper's setting, every preset: tokens/s, MFU, optimizer share, peak memory (the preset's share of
# the part's time each; it stops itself, the timeout is a backstop)
if [[ $parts == *" recipe "* ]]; then
    # shellcheck disable=SC2086  # RECIPE_SETS is a list of flags
    timeout -s INT -k 30 "$(( $(seconds 0.4) + 60 ))" python3 scripts/recipe_steps.py --model "$model" --device "$device" \
        --data-dir "$data" --steps "${STEPS:-50}" --seconds "$(seconds 0.4)" --out "$out/recipe.json" ${RECIPE_SETS:-} \
        2>&1 | tee -a "$log"
fi

# The solver's kernels (eigh with cuSOLVER and MAGMA, msign, products) and a profile of warm solves: about 30 s
[[ $parts == *" kernels "* && $device == cuda ]] && timeout -k 10 90 python3 lab/2026-12-04-gpu-profile/gpu_profile.py "$out/kernels.json" >>"$log" 2>&1

[[ $parts == *" study "* ]] || { echo "gpu_checks: done; files in $out" | tee -a "$log"; exit 0; }
# Steps per run: what 35% of the budget buys at the measured step times (an eval every 10%), at least 20.
iters=$(python3 - "$out/recipe.json" "$(seconds 0.35)" <<'EOF'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
    per_step = sum(r["ms_per_step"] for r in rows if r["preset"] != "adamw") / 1000 * 6 / 5
except (OSError, KeyError, ValueError, ZeroDivisionError):
    per_step = 6.0
print(max(20, int(0.7 * float(sys.argv[2]) / per_step)))
EOF
)
echo "gpu_checks: gpt2 study, $iters steps per preset" | tee -a "$log"
gt "$(seconds 0.35)" study --model "$model" --device "$device" --seeds 1 --iters "$iters" \
    --data-dir "$data" --set eval_iters=5 --out "$out/gpt2_short" --drop-checkpoints --quiet
python3 -m geomtrain report "$out/gpt2_short" >>"$log" 2>&1
tar -czf "$out/gpt2_short.tar.gz" --exclude=runs -C "$out" gpt2_short && rm -rf "$out/gpt2_short"
echo "gpu_checks: done; files in $out" | tee -a "$log"
