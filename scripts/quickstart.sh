#!/usr/bin/env bash
# Sets up .venv if needed and runs the quickstart: plan the Llama-style example on dp=2 x tp=2,
# check it on a simulated mesh, export it and run the export on 4 gloo processes with torchrun --check.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python examples/quickstart.py "$@"
