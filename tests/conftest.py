"""Suite wiring: the multi-process tests (marked ``slow``: torchrun / gloo jobs of 2-4 processes)
share one xdist group. ``scripts/test.sh`` runs pytest with ``-n auto --dist loadgroup``, so they
run one after another on one worker while the other workers take the in-process tests; two
process jobs at once would only fight over the cores (and their rank-timeout checks).

The property and fuzz modules each get a group too: their summary test (last in the module)
counts the outcomes of every seed and runs the seeds it has not seen, so on its own worker it
reads the results instead of running about half of the module again.
``tests/test_suite_wiring.py`` fails when grouping stops working (pytest >= 9.2 with
pytest-xdist 3.8 drops it silently: pytest-xdist issue #1386)."""
import pytest

MODULE_GROUPS = {"test_property.py": "property", "test_fuzz_exact.py": "fuzz"}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.xdist_group("multiprocess"))
        elif item.path.name in MODULE_GROUPS:
            item.add_marker(pytest.mark.xdist_group(MODULE_GROUPS[item.path.name]))
