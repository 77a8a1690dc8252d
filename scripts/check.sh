#!/usr/bin/env bash
# The quick tier (`make check`, before every commit): lint, format, and the unit and property tests
# under the `quick` Hypothesis profile, without the `slow` tests and the notebooks. `make test`
# (scripts/test.sh, what CI runs) runs everything under the `ci` profile.
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in python ruff; do  # a fresh clone has no environment yet: say so, not make's "Error 127"
    if [ ! -x ".venv/bin/$tool" ]; then
        echo "make check: .venv/bin/$tool is missing: run \`make setup\` first (it builds .venv with the test tools)" >&2
        exit 2
    fi
done
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-quick}
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# two workers when pytest-xdist is installed (the [test] extra): the tier is mostly single-threaded torch
workers=()
if .venv/bin/python -c "import xdist" 2>/dev/null; then
    workers=(-n "${CHECK_WORKERS:-2}")
fi
.venv/bin/python -m pytest tests -m "not slow" -q -p no:cacheprovider "${workers[@]}" "$@"
