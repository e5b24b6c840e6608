"""`make pytest` keeps each module on one pytest-xdist worker and the Ray modules together (`conftest.py`'s groups,
`--dist loadgroup`). xdist tells the scheduler a test's group by a `@group` suffix that its worker adds to the node
id from the test's marks. The suffix never arrived: conftest's hook added the marks after xdist's hook had read them,
and on pytest 9.2 xdist writes a node-id field pytest no longer reads (pytest-xdist issue 1386). Every test was then
scheduled alone: two docs-site builds raced on `_docs/`, and the Ray modules ran side by side. conftest's hook now runs
first, and settings.ini pins pytest below 9.2 until xdist follows."""
import os

import pytest


def test_each_test_carries_its_group_to_the_scheduler(request):
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        pytest.skip("not under pytest-xdist")
    if request.config.getoption("dist") != "loadgroup" and not request.config.getvalue("loadgroup"):
        pytest.skip("not --dist loadgroup")
    assert request.node.nodeid.endswith("@test_suite_groups"), (
        f"node id {request.node.nodeid!r} has no '@test_suite_groups' suffix: pytest-xdist's loadgroup does not see "
        f"conftest.py's groups (pytest {pytest.__version__})")
