"""The suite's scheduling (tests/conftest.py) holds: under ``--dist loadgroup`` a multi-process
test carries its group, so xdist runs all of them on one worker, one after another."""
import pytest


@pytest.mark.slow
def test_multiprocess_tests_share_one_xdist_group(request):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("only meaningful on an xdist worker under --dist loadgroup (scripts/test.sh)")
    # xdist groups by a "@<group>" suffix on the node id; a pytest that ignores the suffix
    # (9.2 with pytest-xdist 3.8) spreads the group over every worker without a word
    assert request.node.nodeid.endswith("@multiprocess"), request.node.nodeid
