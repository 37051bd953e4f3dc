#!/usr/bin/env bash
# Sets up .venv if needed and runs the quickstart: plan the Llama-style example on dp=2 x tp=2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python examples/quickstart.py "$@"
