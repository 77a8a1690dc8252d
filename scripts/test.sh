#!/usr/bin/env bash
# The project's whole check, from nothing: environment, unit + property tests, notebooks, docs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# two workers, as `make check` (pytest-xdist, in the [test] extra that setup installs): each test and notebook
# uses its own temporary folders, and the distributed tests' torchrun --standalone picks a free port itself
.venv/bin/python -m pytest tests --nbmake --nbmake-kernel=python3 --nbmake-timeout=600 notebooks \
    -n "${TEST_WORKERS:-2}" "$@"
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
echo "docs: mkdocs build --strict passed"
