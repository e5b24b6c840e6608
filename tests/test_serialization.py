"""eformer_nb.serialization against the real thing: two JAX processes on 127.0.0.1, SIGKILLed savers, fake-gcs-server.

`any_root` tests run on a local directory and on gs:// (TensorStore's gcs driver pointed at the emulator by
`fsspec_utils.kvstore_spec`, which sets TENSORSTORE_GCS_HTTP_URL: the gcs kvstore spec of tensorstore 0.1.86 has no
endpoint member)."""
from __future__ import annotations

import datetime as dt
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eformer_nb.serialization.serialization as ser_format
from eformer_nb.paths import ePath
from eformer_nb.serialization import (AsyncCheckpointManager, CheckpointInterval, CheckpointManager, Checkpointer,
                                      TornCheckpointError, find_latest_checkpoint, tree_deserialize_leaves,
                                      tree_serialize_leaves)
from eformer_nb.serialization.base_manager import METADATA_FILE, list_checkpoints

pytestmark = pytest.mark.timeout(300)
HERE = Path(__file__).parent
WORKER = HERE / "serialization_worker.py"
sys.path.insert(0, str(HERE))
from serialization_worker import expected  # noqa: E402


def _env(devices: int) -> dict:
    root = str(HERE.parent)
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _mesh():
    assert len(jax.devices()) >= 8, "these tests need 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8"
    return jax.make_mesh((2, 4), ("fsdp", "tp"), devices=jax.devices()[:8])


def _bits(tree):
    return jax.tree.map(lambda x: (type(x).__name__, str(x.dtype), np.asarray(x).tobytes())
                        if hasattr(x, "dtype") else (type(x).__name__, repr(x)), tree)


def _state(step: int, mesh):
    rng = np.random.default_rng(step)
    w = jax.device_put(jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16), NamedSharding(mesh, P("fsdp", "tp")))
    return {"params": {"w": w, "q": jnp.asarray(rng.integers(-8, 8, (64, 64)), jnp.int4),
                       "fp8": jnp.asarray(rng.standard_normal((32, 32)), jnp.float8_e4m3fn)},
            "opt": [jnp.int32(step), (0.5, None)], "step": step, "name": "run"}


# --- local and gs:// through the same code ---------------------------------------------------------------------

def test_roundtrip_and_reshard(any_root):
    mesh = _mesh()
    tree = _state(3, mesh)
    tree_serialize_leaves(any_root / "tree", tree)
    assert _bits(tree_deserialize_leaves(any_root / "tree")) == _bits(tree)
    other = NamedSharding(mesh, P("tp", "fsdp"))
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=other if x.ndim == 2 else None)
                            if isinstance(x, jax.Array) else x, tree)
    back = tree_deserialize_leaves(any_root / "tree", template=template)
    assert back["params"]["w"].sharding == other
    assert _bits(back) == _bits(tree)


def test_manager_injected_failure_keeps_previous(any_root):
    "A save that fails part-way through its arrays leaves the previous checkpoint latest and untouched; nothing torn is listed."
    mesh = _mesh()
    mgr = CheckpointManager(any_root)
    mgr.save(_state(1, mesh), 1)
    before = {str(p.relative_to(any_root)): p.read_bytes() for p in any_root.rglob("*") if p.is_file()}
    real = ser_format._write_arrays

    def failing(tree_dir, plan, compression):
        real(tree_dir, plan._replace(writes=plan.writes[:1]), compression)  # one array written, then the crash
        raise OSError("injected failure")

    ser_format._write_arrays = failing
    try:
        with pytest.raises(OSError, match="injected failure"):
            mgr.save(_state(2, mesh), 2)
    finally:
        ser_format._write_arrays = real
    assert mgr.all_steps() == [1]
    assert find_latest_checkpoint(any_root).name == "step-1"
    after = {str(p.relative_to(any_root)): p.read_bytes() for p in (any_root / "step-1").rglob("*") if p.is_file()}
    assert after == {k: v for k, v in before.items() if k.startswith("step-1/")}  # byte for byte
    assert _bits(mgr.load(1)) == _bits(_state(1, mesh))
    torn = any_root / ("step-2.partial" if any_root.protocol == "file" else "step-2")
    assert torn.exists()
    if any_root.protocol != "file":
        with pytest.raises(TornCheckpointError, match="never committed"):
            mgr.load(2)
    assert CheckpointManager(any_root).removed_stale == [torn.name]  # a new manager cleans it
    assert not torn.exists() and mgr.all_steps() == [1]


def test_checkpointer_and_async(any_root):
    mesh = _mesh()
    clock = [dt.datetime(2026, 1, 1)]
    with AsyncCheckpointManager(checkpoint_dir=any_root) as mgr:
        ck = Checkpointer(any_root, dt.timedelta(minutes=3), [CheckpointInterval(4)], manager=mgr,
                          dt_now_injection=lambda: clock[0])
        for step in range(1, 9):
            clock[0] += dt.timedelta(minutes=2)
            ck.on_step(_state(step, mesh), step=step)
        ck.wait_until_finished()
        assert mgr.all_steps() == [4, 8]
        assert _bits(ck.load_checkpoint()) == _bits(_state(8, mesh))


def test_corrupt_metadata_is_named(any_root):
    mgr = CheckpointManager(any_root)
    mgr.save({"x": 1}, 5)
    (any_root / "step-5" / METADATA_FILE).write_text('{"format": "eformer_nb.checkpoint", ')
    with pytest.raises(ValueError, match=r"metadata.json' is not valid JSON"):
        mgr.load(5)


def test_gcs_tensorstore_uses_the_emulator(gcs_root, gcs_emulator):
    tree_serialize_leaves(gcs_root, {"w": jnp.arange(4096.0)})
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == gcs_emulator.url
    names = {p.name for p in gcs_root.rglob("*")}
    assert {"index.json", "zarr.json"} <= names


# --- two JAX processes -------------------------------------------------------------------------------------------

def test_two_processes_save_and_reshard(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(WORKER), "multiprocess", str(port), str(i), str(tmp_path / "run")],
                              env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
        assert f"process {i}: checked 4 shards" in out
        assert f"process {i}: policies agreed on [3, 4, 7, 8]" in out
    # one commit: a single step directory, no work directory left, one metadata.json
    run = ePath(tmp_path / "run")
    assert sorted(p.name for p in run.iterdir()) == ["policies", "step-7"]
    assert [s for s, _ in list_checkpoints(run)] == [7]


# --- crash safety: SIGKILL at random moments ---------------------------------------------------------------------

def test_sigkill_loop(tmp_path):
    rng = random.Random(20261123)
    root = tmp_path / "crash"
    trials, kills_mid_save = 20, 0
    for trial in range(trials):
        p = subprocess.Popen([sys.executable, str(WORKER), "crashloop", str(root)], env=_env(1),
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            deadline = time.monotonic() + 120
            line = p.stdout.readline()  # "ready N": at least one checkpoint of this run committed
            assert line.startswith("ready"), f"trial {trial}: worker said {line!r}"
            assert time.monotonic() < deadline
            time.sleep(rng.uniform(0.0, 0.4))
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
            p.stdout.close()
        base = ePath(root)
        kills_mid_save += any(c.name.endswith(".partial") for c in base.iterdir())
        listed = list_checkpoints(base)
        assert listed, f"trial {trial}: nothing listed"
        for step, path in listed:  # every listed checkpoint is whole
            assert (path / METADATA_FILE).is_file()
        step, path = listed[-1]
        back = CheckpointManager(root, clean=False).load(step)
        exp = expected(step)
        assert back["step"] == step
        assert np.asarray(back["a"]).tobytes() == exp["a"].tobytes() and np.asarray(back["b"]).tobytes() == exp["b"].tobytes()
    print(f"{trials} SIGKILLs, {kills_mid_save} landed inside a save")
    assert kills_mid_save >= 1  # the kills did hit saves in flight
