"""`make pytest` keeps each module on one pytest-xdist worker and the Ray modules together (`conftest.py`'s groups,
`--dist loadgroup`). xdist tells the scheduler a test's group by a `@group` suffix on its node id; pytest 9.2 keeps
node ids elsewhere, so the suffix silently stopped reaching the scheduler and every test was scheduled alone (two
docs-site builds raced on `_docs/`, Ray modules ran side by side): settings.ini pins pytest below 9.2 until xdist
follows (pytest-xdist issue 1386)."""
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
