#!/usr/bin/env bash
# Sets up .venv if needed and runs the whole test suite (slow multi-process tests included), on
# every core: in-process tests spread over the workers, the multi-process ones in order on one
# (tests/conftest.py). Arguments go to pytest ("-n 0" runs in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -n auto --dist loadgroup "$@"
