#!/usr/bin/env bash
# One CUDA device, bf16: autoshard's program at mesh size 1 vs the eager model (overhead ratio)
# and model FLOP utilization; one summary line, bounded to 5 minutes. Extra arguments go to
# benchmarks/gpu_check.py (e.g. --layers 4 --dim 2048, or --device cpu to check the logic).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || bash scripts/bootstrap.sh   # .venv with torch; expecttest for torch's test model
"$PY" -c "import expecttest" 2>/dev/null || "$PY" -m pip install -q expecttest
exec timeout 300 "$PY" benchmarks/gpu_check.py "$@"
