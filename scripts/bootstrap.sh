#!/usr/bin/env bash
# Creates .venv (once) with the CPU build of torch and autoshard installed in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import numpy, torch, sympy, networkx, tabulate, pytest, xdist, transformers, expecttest, autoshard.passes, autoshard.cost
assert tuple(int(v) for v in pytest.__version__.split('.')[:2]) < (9, 2)" 2>/dev/null; then
  # torch==2.13.0 is pinned: on a CPU machine of this kind the CPU wheel is on disk;
  # an unpinned torch would pull a multi-GB CUDA build. numpy: torch warns on import without it.
  # transformers is for the tests only (tests/test_hf_models.py builds tiny models from configs);
  # expecttest too: torch's test Transformer module (benchmarks/vs_pytorch.py) imports it.
  # pytest-xdist runs the suite on every core (scripts/test.sh). pytest < 9.2: from 9.2 on,
  # pytest-xdist 3.8's --dist loadgroup silently stops grouping (pytest-xdist issue #1386), and
  # the multi-process tests would run two at a time (tests/test_suite_wiring.py checks it).
  .venv/bin/pip install -q "torch==2.13.0" numpy sympy networkx tabulate safetensors "pytest<9.2" pytest-xdist "transformers==5.24.0" expecttest
  .venv/bin/pip install -q --no-build-isolation -e .
fi
