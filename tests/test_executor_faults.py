"""Executor faults on a real 3-node Ray cluster on this machine (`ray.cluster_utils.Cluster`).

Ray binds its nodes to this host's own interface address (asking for 127.0.0.1 makes `Cluster.add_node`
fail to reach the GCS in this container), so the cluster runs locally but on that address; the dashboard,
which the state API needs, listens on 127.0.0.1 on a free port.

Node 0 is the head (1 CPU). Nodes 1 and 2 each pose as a v4-8 TPU slice: 1 CPU and the resources Ray puts
on a TPU host (`TPU: 4`, `TPU-v4-8-head: 1`, and the slice's name). Faults are real: worker processes are
SIGKILLed mid-task, and a slice's node is removed from the cluster mid-job (and a replacement added).
After every test nothing the executor started may be left: no alive actors, no running tasks, no placement
groups (Ray's state API). Every wait is bounded.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import tempfile
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from eformer_nb.executor.cluster_util import _local_start_env, ray_processes, stop_processes  # noqa: E402
from eformer_nb.executor.ray import (  # noqa: E402
    CpuAcceleratorConfig, JobFailed, JobPreempted, RayExecutor, TpuAcceleratorConfig, execute_multislice_resumable,
)

pytestmark = pytest.mark.timeout(300)
SLICES = ("slice-a", "slice-b")


def _free_port() -> int:
    """A free loopback port for the dashboard, never one of Ray's own default ports (the kernel once handed out 52365,
    the dashboard agent's: Ray then refused the node, two of its components on one port)."""
    from ray._private import ray_constants as rc
    reserved = {rc.DEFAULT_PORT, rc.DEFAULT_DASHBOARD_PORT, rc.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT,
                rc.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT + 1, 10001}  # gcs, dashboard, agent http (+ grpc), client server
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in reserved:
            return port


def _slice_node_args(name: str, temp_dir: str) -> dict:
    return dict(num_cpus=1, resources={"TPU": 4, "TPU-v4-8-head": 1, name: 1}, temp_dir=temp_dir)


def _retry_startup(make, tries: int = 3):
    "Ray gives a node 30 s to register; on a loaded machine that can fail: try again (bounded)."
    for i in range(tries):
        try:
            return make()
        except Exception as e:  # only Ray's start-up timeout is retried; anything else is raised at once
            if "timed out during startup" not in str(e) or i == tries - 1:
                raise


class _Cluster:
    def __init__(self):
        from ray.cluster_utils import Cluster

        # A private temp dir (not the shared /tmp/ray) and the executor's start environment: its raised Ray
        # start-up timeouts, and the mark by which `ray_processes` finds every process of this cluster at shutdown.
        self.temp_dir = tempfile.mkdtemp(prefix="eformer-ray-faults-")
        self._env = contextlib.ExitStack()
        self._env.enter_context(_local_start_env(self.temp_dir))
        self.cluster = Cluster()
        self.slices = {}

        def head():
            port = _free_port()  # a fresh port per try: a timed-out try may still hold its port
            self.dashboard = f"http://127.0.0.1:{port}"
            return self.cluster.add_node(num_cpus=1, include_dashboard=True, dashboard_host="127.0.0.1",
                                         dashboard_port=port, temp_dir=self.temp_dir)

        try:
            _retry_startup(head)
            for name in SLICES:
                self.slices[name] = _retry_startup(lambda: self._add_slice(name))
            ray.init(address=self.cluster.address, log_to_driver=False)
            self.cluster.wait_for_nodes(timeout=120)
        except BaseException:
            self.shutdown()
            raise

    def _add_slice(self, name: str):
        return self.cluster.add_node(**_slice_node_args(name, self.temp_dir))

    def replace_slice(self, name: str) -> None:
        "Add a fresh node for slice `name` (after its node was removed)."
        self.slices[name] = _retry_startup(lambda: self._add_slice(name))
        self.cluster.wait_for_nodes(timeout=120)

    def shutdown(self):
        "Stop Ray, then every process still marked with this cluster's temp dir; remove the dir (made here)."
        try:
            if ray.is_initialized():
                ray.shutdown()
            self.cluster.shutdown()
        finally:
            self._env.close()
            left = ray_processes(self.temp_dir)
            stop_processes(left, grace_s=5)
            shutil.rmtree(self.temp_dir, ignore_errors=False)
            assert not ray_processes(self.temp_dir), f"Ray processes of {self.temp_dir} survived shutdown"


@pytest.fixture(scope="module")
def cluster():
    import sys

    from ray import cloudpickle

    # the job functions below live in this test module, which Ray's workers cannot import: send them by value
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    c = _Cluster()
    try:
        yield c
    finally:
        c.shutdown()


def _leftovers(dashboard: str) -> dict:
    """Alive actors, running tasks and created placement groups, by Ray's state API.

    A task that was running on a node that was removed stays `RUNNING` in the task store (no event ever
    ends it); it counts only while its worker process still exists."""
    import psutil
    from ray.util.state import list_actors, list_placement_groups, list_tasks

    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    tasks = list_tasks(address=dashboard, filters=[("state", "=", "RUNNING")], timeout=30, detail=True)
    return {
        "actors": [a.class_name for a in list_actors(address=dashboard, filters=[("state", "=", "ALIVE")], timeout=30)],
        "tasks": [t.name for t in tasks if t.node_id in alive or (t.worker_pid and psutil.pid_exists(t.worker_pid))],
        "placement_groups": [p.placement_group_id for p in
                             list_placement_groups(address=dashboard, filters=[("state", "=", "CREATED")], timeout=30)],
    }


@pytest.fixture
def clean(cluster):
    "After the test: nothing left running (deaths are asynchronous, so poll, bounded)."
    yield cluster
    deadline = time.monotonic() + 60
    while (left := _leftovers(cluster.dashboard)) != {"actors": [], "tasks": [], "placement_groups": []}:
        assert time.monotonic() < deadline, f"orphans left by the executor: {left}"
        time.sleep(0.5)


def _wait_for_file(path: str, timeout: float = 120, nonempty: bool = True) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and ((text := open(path).read()) or not nonempty):
            return text
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not appear within {timeout}s")


def _sleep_on_first_try(state_dir: str) -> dict:
    "Attempt k writes `k.pid` (its pid and node); the first attempt then sleeps until killed, later ones return."
    k = len([f for f in os.listdir(state_dir) if f.endswith(".pid")])
    with open(os.path.join(state_dir, f"{k}.tmp"), "w") as f:
        f.write(f"{os.getpid()} {os.environ.get('EFORMER_SLICE_NAME', '')}")
    os.rename(os.path.join(state_dir, f"{k}.tmp"), os.path.join(state_dir, f"{k}.pid"))
    if k == 0:
        time.sleep(120)
    with open(os.path.join(state_dir, f"{k}.started"), "w") as f:
        f.write(repr(time.time()))
    return {"attempt": k, "slice": os.environ.get("EFORMER_SLICE_NAME")}


def test_sigkilled_worker_is_retried_as_preemption(clean, tmp_path):
    killed_at = {}

    def kill_first_worker():
        pid = int(_wait_for_file(str(tmp_path / "0.pid")).split()[0])
        killed_at["t"] = time.time()
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_first_worker, daemon=True)
    killer.start()
    st = RayExecutor.execute_resumable(_sleep_on_first_try, CpuAcceleratorConfig(core_count=1),
                                       max_retries_preemption=2, max_retries_failure=0, retry_delay_s=0.1,
                                       timeout_s=150,
                                       state_dir=str(tmp_path))
    killer.join(timeout=10)
    assert st.ok, st
    assert st.result == [{"attempt": 1, "slice": None}]
    assert [(a.outcome, a.reason) for a in st.attempts] == [("preempted", "worker-crashed"), ("succeeded", "")]
    restart_s = float((tmp_path / "1.started").read_text()) - killed_at["t"]
    print(f"kill -> retried task running: {restart_s:.2f}s")
    assert 0 < restart_s < 120


def test_node_removed_mid_job_is_preemption_and_moves_to_other_slice(clean, tmp_path):
    removed = {}

    def remove_first_slice():
        name = _wait_for_file(str(tmp_path / "0.pid")).split()[1]
        removed["slice"] = name
        clean.cluster.remove_node(clean.slices[name])

    remover = threading.Thread(target=remove_first_slice, daemon=True)
    remover.start()
    cfg = TpuAcceleratorConfig("v4-8", cpu_count=1)
    st = RayExecutor.execute_resumable(_sleep_on_first_try, cfg, max_retries_preemption=3, max_retries_failure=0,
                                       retry_delay_s=0.5, timeout_s=150, schedule_timeout_s=60, state_dir=str(tmp_path))
    remover.join(timeout=60)
    try:
        assert st.ok, st
        assert [a.outcome for a in st.attempts] == ["preempted", "succeeded"], st.attempts
        assert st.attempts[0].reason in ("node-died", "actor-died", "object-lost", "worker-crashed"), st.attempts[0]
        [result] = st.result
        assert result["attempt"] == 1 and result["slice"] != removed["slice"] and result["slice"] in SLICES
    finally:
        clean.replace_slice(removed["slice"])


def _always_killed():
    os.kill(os.getpid(), signal.SIGKILL)


def _always_raises(x):
    raise ValueError(f"bad value {x}")


def test_exhausted_budgets_end_with_the_last_error(clean):
    st = RayExecutor.execute_resumable(_always_killed, CpuAcceleratorConfig(core_count=1), max_retries_preemption=1,
                                       max_retries_failure=5, retry_delay_s=0.1, timeout_s=120)
    assert isinstance(st, JobPreempted) and len(st.attempts) == 2, st
    assert isinstance(st.error, ray.exceptions.WorkerCrashedError)

    st = RayExecutor.execute_resumable(_always_raises, CpuAcceleratorConfig(core_count=1), max_retries_preemption=5,
                                       max_retries_failure=1, retry_delay_s=0.1, timeout_s=120, x=7)
    assert isinstance(st, JobFailed) and [a.outcome for a in st.attempts] == ["failed", "failed"], st
    # the remote traceback reaches the caller: in the error, in the attempt record, and when re-raised
    assert isinstance(st.error, ValueError) and "in _always_raises" in str(st.error)
    assert "bad value 7" in st.attempts[-1].error and "_always_raises" in st.attempts[-1].error
    with pytest.raises(ValueError, match="bad value 7"):
        st.unwrap()


def _multislice_fn(state_dir: str) -> dict:
    "Slice 1 fails on the first attempt, once slice 0 has started; every run is recorded."
    slice_id = os.environ["MEGASCALE_SLICE_ID"]
    runs = len([f for f in os.listdir(state_dir) if f.startswith(f"s{slice_id}-")])
    open(os.path.join(state_dir, f"s{slice_id}-{runs}"), "w").close()
    if slice_id == "1" and runs == 0:
        _wait_for_file(os.path.join(state_dir, "s0-0"), timeout=60, nonempty=False)  # slice 0 is running too
        raise RuntimeError("slice 1 fails once")
    megascale = {k: v for k, v in os.environ.items() if k.startswith("MEGASCALE_")}
    return megascale | {"slice": os.environ["EFORMER_SLICE_NAME"]}


def test_multislice_one_slice_failing_restarts_all(clean, tmp_path):
    st = execute_multislice_resumable(_multislice_fn, TpuAcceleratorConfig(type="v4-8", pod_count=2, cpu_count=1),
                                      max_retries_preemption=2, max_retries_failure=2, timeout_s=150,
                                      schedule_timeout_s=60, retry_delay_s=0.1, state_dir=str(tmp_path))
    assert st.ok, st
    assert [a.outcome for a in st.attempts] == ["failed", "succeeded"]
    assert "slice 1 fails once" in st.attempts[0].error
    (s0,), (s1,) = st.result
    assert (s0["MEGASCALE_SLICE_ID"], s1["MEGASCALE_SLICE_ID"], s0["MEGASCALE_NUM_SLICES"]) == ("0", "1", "2")
    assert s0["MEGASCALE_COORDINATOR_ADDRESS"] == s1["MEGASCALE_COORDINATOR_ADDRESS"]
    assert {s0["slice"], s1["slice"]} == set(SLICES)
    # slice 0 ran again although only slice 1 failed: the whole job restarted
    assert sorted(os.listdir(tmp_path)) == ["s0-0", "s0-1", "s1-0", "s1-1"]


def _jax_psum() -> tuple[int, int, float]:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from eformer_nb.executor.cluster_util import DistributedConfig

    cfg = DistributedConfig().initialize()
    x = jax.numpy.array([jax.process_index() + 1.0])
    total = jax.pmap(lambda v: jax.lax.psum(v, "p"), axis_name="p")(x)
    return cfg.process_id, jax.process_count(), float(total[0])


def test_jax_psum_across_two_executor_workers(clean):
    cfg = CpuAcceleratorConfig(core_count=1, worker_count=2).with_environment_variables(
        JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    st = RayExecutor.execute(_jax_psum, cfg, timeout_s=240, schedule_timeout_s=60)
    assert st.ok, st
    assert st.result == [(0, 2, 3.0), (1, 2, 3.0)]
