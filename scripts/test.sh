#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two test files at a time (pytest-xdist, a file's tests on one worker, so module fixtures are made once):
# most tests wait on processes they start (imports, launchers, servers), so two cores run two of them.
# Files go out in the order tests/conftest.py gives them (the longest first), not by their number of tests.
exec .venv/bin/python -m pytest -q -n auto --maxprocesses 2 --dist loadfile --no-loadscope-reorder "$@"
