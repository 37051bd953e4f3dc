#!/usr/bin/env bash
# Sets up .venv if needed and runs the whole test suite (slow multi-process tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest "$@"
