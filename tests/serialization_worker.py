"""Subprocess bodies for tests/test_serialization.py (run as `python serialization_worker.py MODE ...`).

`multiprocess PORT PID DIR`: one of two JAX processes (4 host CPU devices each) on 127.0.0.1: together they save one
sharded array as a step checkpoint and restore it onto another sharding; each checks the shards it holds.
`crashloop DIR`: saves step checkpoints 1, 2, 3, ... forever (the test SIGKILLs it); prints "ready" after the first.
`fsize DIR LIMIT`: under RLIMIT_FSIZE=LIMIT bytes (SIGXFSZ ignored, so a write past it fails with EFBIG) tries to save
step 2 and to re-save step 1 under DIR; prints a JSON object step -> "saved" or the error raised.
"""
from __future__ import annotations

import sys

import numpy as np


def expected(step: int) -> dict:
    "The deterministic content of the crash-loop checkpoint of `step`."
    rng = np.random.default_rng(step)
    return {"a": rng.standard_normal((256, 256)).astype(np.float32),
            "b": rng.integers(0, 2**31, (128, 512), dtype=np.int64), "step": step}


def multiprocess(port: int, pid: int, root: str) -> None:
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=120)
    from jax.sharding import NamedSharding, PartitionSpec as P

    from eformer_nb.serialization import CheckpointManager, read_metadata

    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = jax.make_mesh((4, 2), ("x", "y"), devices=jax.devices())
    full = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    src = NamedSharding(mesh, P("x", "y"))
    arr = jax.make_array_from_callback(full.shape, src, lambda idx: full[idx])
    mgr = CheckpointManager(root)
    mgr.save({"w": arr, "note": "two processes"}, 7, extras={"writer": "both"})
    assert mgr.all_steps() == [7], mgr.all_steps()
    meta = read_metadata(mgr.step_path(7))
    assert meta["process_count"] == 2, meta
    # restore onto another sharding: columns split over 'x', rows over 'y'
    dst = NamedSharding(mesh, P("y", "x"))
    back = mgr.load(7, template={"w": jax.ShapeDtypeStruct(full.shape, np.float32, sharding=dst), "note": ""})
    assert back["note"] == "two processes"
    assert back["w"].sharding == dst
    for shard in back["w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
    print(f"process {pid}: checked {len(back['w'].addressable_shards)} shards", flush=True)
    policies(pid, root, arr, full)
    jax.distributed.shutdown()


def policies(pid: int, root: str, arr, full) -> None:
    "Checkpointer + AsyncCheckpointManager on two processes whose clocks disagree: process 0 decides for both."
    import datetime as dt

    from eformer_nb.serialization import AsyncCheckpointManager, CheckpointInterval, Checkpointer

    t0 = dt.datetime(2026, 1, 1)
    clock = {"step": 0}
    speed = 1 if pid == 0 else 7  # process 1's clock runs 7x faster: left alone it would save other steps
    now = lambda: t0 + dt.timedelta(minutes=speed * clock["step"])
    with AsyncCheckpointManager(checkpoint_dir=f"{root}/policies") as mgr:
        ck = Checkpointer(f"{root}/policies", dt.timedelta(minutes=3), [CheckpointInterval(4)], manager=mgr,
                          dt_now_injection=now)
        saved = []
        for step in range(1, 11):
            clock["step"] = step
            if ck.on_step({"w": arr, "step": step}, step=step):
                saved.append(step)
        ck.wait_until_finished()
        assert saved == [3, 4, 7, 8], saved  # process 0's clock: temporaries at 3 and 7, permanent at 4 and 8
        assert mgr.all_steps() == [4, 8], mgr.all_steps()
        back = ck.load_checkpoint(step=8)
        assert back["step"] == 8
        for shard in back["w"].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
    print(f"process {pid}: policies agreed on {saved}", flush=True)


def crashloop(root: str) -> None:
    from eformer_nb.serialization import CheckpointManager

    mgr = CheckpointManager(root)
    step = (mgr.all_steps() or [0])[-1]
    while True:
        step += 1
        mgr.save(expected(step), step)
        if step % 3 == 0 and len(mgr.all_steps()) > 2:
            mgr.delete(mgr.all_steps()[0])  # deletes are killed half-way too
        print("ready", step, flush=True)


def fsize(root: str, limit: int) -> None:
    import json
    import resource
    import signal

    import tensorstore  # noqa: F401  (imported before the limit: nothing but the checkpoint's files is written after it)

    from eformer_nb.serialization import CheckpointManager

    mgr = CheckpointManager(root, clean=False)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    out = {}
    for step in (2, 1):  # a new step, then the committed one again
        try:
            mgr.save(expected(step), step)
            out[step] = "saved"
        except (OSError, ValueError) as e:  # reported, and the parent test asserts on it
            out[step] = f"{type(e).__name__}: {e}"
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "multiprocess":
        multiprocess(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    elif mode == "crashloop":
        crashloop(sys.argv[2])
    elif mode == "fsize":
        fsize(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(f"unknown mode {mode!r}; expected multiprocess, crashloop or fsize")
