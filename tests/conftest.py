"""Suite wiring: the multi-process tests (marked ``slow``: torchrun / gloo jobs of 2-4 processes)
share one xdist group. ``scripts/test.sh`` runs pytest with ``-n auto --dist loadgroup``, so they
run one after another on one worker while the other workers take the in-process tests; two
process jobs at once would only fight over the cores (and their rank-timeout checks).
``tests/test_suite_wiring.py`` fails when grouping stops working (pytest >= 9.2 with
pytest-xdist 3.8 drops it silently: pytest-xdist issue #1386).

Every test process computes on one intra-op thread (``OMP_NUM_THREADS``, unless set already),
and so do the torchrun jobs it starts, which inherit it: the workers and the jobs share the
machine's cores, and a second OpenMP thread per process only spins waiting for the other's work
(measured on 2 cores, the in-process tests on 2 workers: 6m13s with torch's default of 2
threads, 4m51s with 1)."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.xdist_group("multiprocess"))
