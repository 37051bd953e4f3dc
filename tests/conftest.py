"""Suite wiring: the multi-process tests (marked ``slow``: torchrun / gloo jobs of 2-4 processes)
share one xdist group. ``scripts/test.sh`` runs pytest with ``-n auto --dist loadgroup``, so they
run one after another on one worker while the other workers take the in-process tests; two
process jobs at once would only fight over the cores (and their rank-timeout checks)."""
import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.xdist_group("multiprocess"))
