"""Shared pytest fixtures.

GCS: `gcs_emulator` starts fake-gcs-server on a free loopback port once per session and its finalizer stops it,
also when tests fail. `gcs_fs` points every `gs://` ePath at it (`set_gcs_filesystem`) and creates the bucket
`GCS_TEST_BUCKET`; `gcs_root` is a fresh, not yet existing `gs://` directory for one test. `any_root` runs a test
body twice: on a local temporary directory and on a `gs://` directory. `warnings_seen` collects the warnings that
`infra.mixins.files` logs during a test.

Parallel runs: `make pytest` runs two pytest-xdist workers with `--dist loadgroup`. Every test gets the group of its
module, so a module runs whole on one worker and its shared set-up (a server, a model, a cluster) starts once; the
modules that start Ray clusters share one group, `ray`, and so run one after another on one worker: two Ray clusters
starting at once on a 2-core machine can miss Ray's start window. (The groups reach the scheduler as `@group` suffixes
that xdist's worker adds to the node ids from the marks: this file's hook has to run first, and pytest 9.2 keeps node
ids where xdist 3.8 does not write them, so settings.ini pins pytest below 9.2. Without either, every test was
scheduled alone; `test_suite_groups.py` fails if that happens again.)
"""
from __future__ import annotations

import uuid

import pytest

from gcs_emulator import GCSEmulator

GCS_TEST_BUCKET = "eformer-nb-tests"

RAY_MODULES = {"test_demo", "test_executor_api", "test_executor_faults", "test_ray_stress", "test_robust_budgets",
               "test_hosts"}


def pytest_configure(config):  # where pytest-xdist is not installed (the client venv) the mark is still known
    config.addinivalue_line("markers", "xdist_group(name): the tests of one group run on one xdist worker")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker turns the marks into node-id suffixes: its plugin is
def pytest_collection_modifyitems(config, items):  # registered after this file, so it would run first and see none
    for item in items:
        name = item.path.stem
        item.add_marker(pytest.mark.xdist_group("ray" if name in RAY_MODULES else name))


@pytest.fixture(scope="session")
def gcs_emulator():
    emulator = GCSEmulator()
    emulator.start()
    try:
        yield emulator
    finally:
        emulator.stop()


@pytest.fixture(scope="session")
def gcs_fs(gcs_emulator):
    from eformer_nb.paths import ePath, make_gcs_filesystem, set_gcs_filesystem

    fs = make_gcs_filesystem(endpoint_url=gcs_emulator.url)
    previous = set_gcs_filesystem(fs)
    try:
        ePath(f"gs://{GCS_TEST_BUCKET}").mkdir(exist_ok=True)
        yield fs
    finally:
        set_gcs_filesystem(previous)


@pytest.fixture
def gcs_root(gcs_fs):
    from eformer_nb.paths import ePath

    return ePath(f"gs://{GCS_TEST_BUCKET}/{uuid.uuid4().hex[:12]}/root")


@pytest.fixture(params=["local", "gcs"])
def any_root(request, tmp_path):
    from eformer_nb.paths import ePath

    if request.param == "local":
        return ePath(tmp_path) / "root"
    return request.getfixturevalue("gcs_root")


@pytest.fixture
def warnings_seen():
    import logging

    import eformer_nb.infra.mixins.files as files

    seen, handler = [], logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    files.logger.logger.addHandler(handler)
    try:
        yield seen
    finally:
        files.logger.logger.removeHandler(handler)
