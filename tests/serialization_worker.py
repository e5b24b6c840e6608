"""Subprocess bodies for tests/test_serialization.py (run as `python serialization_worker.py MODE ...`).

`multiprocess PORT PID DIR`: one of two JAX processes (4 host CPU devices each) on 127.0.0.1: together they save one
sharded array as a step checkpoint and restore it onto another sharding; each checks the shards it holds.
`multiprocess_gcs PORT PID URL DIR`: the same two processes saving to gs:// DIR on the fake-gcs-server at URL; each
prints the JSON files it wrote, the chunks it wrote and what its commit callback saw.
`multiprocess_pretrained PORT PID URL GSDIR LOCALDIR`: two JAX processes (4 host CPU devices each) save one tiny Llama
sharded over all 8 devices with `save_pretrained`, to gs:// GSDIR (emulator at URL) and to LOCALDIR, then re-save
another model over both in place; each process loads every version back and compares it with the full weights; then
the same with `EasyDeLState.save_state` / `load_state` (a save and a re-save); then a tree restored onto process 0's
first device only (process 1 holds no shard of it).
`gcs_kill URL DIR POINT`: saves step 1 to gs:// DIR on the emulator at URL, then SIGKILLs itself at POINT of a
re-save of step 1 (`arrays`, `commit`, `copy`, `drop`).
`state_gcs_kill URL DIR POINT`: saves `state_of(1)` with `save_state` to gs:// DIR on the emulator at URL, then
SIGKILLs itself at POINT of a re-save of `state_of(2)` (`model`, `optimizer`, `commit`, `drop`).
`crashloop DIR [KIND]`: saves forever (the test SIGKILLs it); prints "ready N" after each save. KIND `ckpt`
(the default): step checkpoints 1, 2, 3, ..., each re-saved once (an overwrite), old ones deleted; `tree`:
`tree_serialize_leaves` over the same directory, `expected(N)` each time; `state`: `EasyDeLState.save_state` over
the same folder, `state_of(1)` and `state_of(2)` in turn.
`fsize DIR LIMIT [KIND]`: under RLIMIT_FSIZE=LIMIT bytes (SIGXFSZ ignored, so a write past it fails with EFBIG) tries to
save step 2 and to re-save step 1 under DIR (`ckpt`), to overwrite the tree at DIR (`tree`) or the state at DIR
(`state`); prints a JSON object attempt -> "saved" or the error raised.
"""
from __future__ import annotations

import sys

import numpy as np


def expected(step: int) -> dict:
    "The deterministic content of the crash-loop checkpoint of `step`."
    rng = np.random.default_rng(step)
    return {"a": rng.standard_normal((256, 256)).astype(np.float32),
            "b": rng.integers(0, 2**31, (128, 512), dtype=np.int64), "step": step}


TX_LR = 1e-3


def state_of(step: int):
    "A tiny Llama training state (Adam) whose parameters depend on `step`, at step `step`."
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from eformer_nb.modules.llama import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2)
    state = LlamaForCausalLM(cfg, rngs=nnx.Rngs(step)).to_state().init_tx(optax.adam(TX_LR))
    return state.replace(step=jnp.int32(step))


def run_pair(mode: str, args_of, env: dict, timeout: float = 240, script: str | None = None) -> list[tuple[int, str]]:
    """Run `python serialization_worker.py MODE PORT PID *args_of(PID)` (or `script` in its place) as the two JAX
    processes of one job (a free loopback port for their coordinator); `[(exit code, output)]` per process. One still
    running after `timeout` seconds is killed (and reads as failed)."""
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    me = os.path.abspath(script or __file__)
    procs = [subprocess.Popen([sys.executable, me, mode, str(port), str(i), *args_of(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired as e:
        outs.append(f"timed out after {timeout} s: {e}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    outs += [""] * (2 - len(outs))
    return [(p.returncode, out) for p, out in zip(procs, outs)]


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


def multiprocess_gcs(port: int, pid: int, url: str, root: str) -> None:
    import json

    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=120)
    from jax.sharding import NamedSharding, PartitionSpec as P

    import eformer_nb.serialization.base_manager as bm
    import eformer_nb.serialization.serialization as ser
    from eformer_nb.paths import ePath, make_gcs_filesystem, set_gcs_filesystem
    from eformer_nb.serialization import CheckpointManager, read_metadata

    set_gcs_filesystem(make_gcs_filesystem(endpoint_url=url))
    wrote, chunks = [], []
    real_json, real_arrays = ser.write_json, ser._write_arrays

    def spy_json(f, obj):  # records, then writes for real
        wrote.append(ePath(f).name)
        return real_json(f, obj)

    def spy_arrays(tree_dir, plan, compression):
        chunks.append(sum(len(owned) for _, _, owned in plan.writes))
        return real_arrays(tree_dir, plan, compression)

    import eformer_nb.serialization.durable as durable

    real_if = durable.write_json_if_generation

    def spy_if(f, obj, generation):  # gs://: the commit, metadata.json written only at the generation read first
        wrote.append(ePath(f).name)
        return real_if(f, obj, generation)

    ser.write_json, durable.write_json, ser._write_arrays = spy_json, spy_json, spy_arrays  # durable's: metadata.json
    durable.write_json_if_generation = spy_if  # every commit_json goes through it
    mesh = jax.make_mesh((4, 2), ("x", "y"), devices=jax.devices())
    full = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    arr = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("x", "y")), lambda idx: full[idx])
    mgr = CheckpointManager(root)
    seen = {}

    def callback():  # runs on every process after the commit: the committed checkpoint must be visible here
        seen["step"] = read_metadata(mgr.step_path(3))["step"]

    bm.save_checkpoint_dir({"w": arr}, mgr.step_path(3), step=3, commit_callback=callback)()
    back = mgr.load(3, template={"w": jax.ShapeDtypeStruct(full.shape, np.float32, sharding=arr.sharding)})
    for shard in back["w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
    print(f"process {pid}: " + json.dumps({"json": sorted(wrote), "chunks": chunks, "callback": seen}), flush=True)
    jax.distributed.shutdown()


def multiprocess_pretrained(port: int, pid: int, url: str, gs_dir: str, local_dir: str) -> None:
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=120)
    from flax import nnx

    from eformer_nb.escale.mesh import create_mesh
    from eformer_nb.modules.llama import LlamaConfig, LlamaForCausalLM
    from eformer_nb.infra.mixins.files import to_hf_state_dict
    from eformer_nb.paths import make_gcs_filesystem, set_gcs_filesystem

    set_gcs_filesystem(make_gcs_filesystem(endpoint_url=url))
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    mesh = create_mesh((1, 2, 1, 4, 1))  # fsdp=2 x tp=4 over both processes' devices
    for seed in (0, 1):  # a first save, then a re-save in place over it
        with jax.default_device(jax.local_devices()[0]):
            model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed))
            full = to_hf_state_dict(model.split_params_dict())  # every weight, on this process
        model = model.shard_model(mesh=mesh)
        kernel = model.split_params_dict()["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"]
        assert not kernel.is_fully_addressable, kernel.sharding  # really spread over both processes
        for dest in (gs_dir, local_dir):
            model.save_pretrained(dest)
            back = to_hf_state_dict(LlamaForCausalLM.from_pretrained(dest).split_params_dict())
            assert sorted(back) == sorted(full), (sorted(back), sorted(full))
            for name, value in full.items():
                np.testing.assert_array_equal(back[name], value, err_msg=f"{dest}: {name}")
        print(f"process {pid}: save {seed} loads bit-exactly from both", flush=True)
    import optax

    from eformer_nb.infra.base_state import EasyDeLState
    from eformer_nb.infra.mixins.files import host_value

    state = model.to_state().init_tx(optax.adam(1e-3))  # the sharded model's state: its optimizer state sharded alike
    want = [host_value(x) for x in jax.tree.leaves((state.graphstate, state.opt_state))]
    for dest in (gs_dir + "/state", local_dir + "-state"):
        for _ in range(2):  # a first save, then a re-save over it
            state.save_state(dest, verbose=False)
            back = EasyDeLState.load_state(dest, tx=optax.adam(1e-3), verbose=False)
            got = [host_value(x) for x in jax.tree.leaves((back.graphstate, back.opt_state))]
            assert len(got) == len(want)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b, err_msg=dest)
    print(f"process {pid}: save_state loads bit-exactly from both", flush=True)
    from jax.sharding import SingleDeviceSharding

    from eformer_nb.serialization import tree_deserialize_leaves, tree_serialize_leaves

    tree_serialize_leaves(local_dir + "-tree", {"w": np.arange(4096.0)})  # every process calls it (process 0 writes)
    only0 = tree_deserialize_leaves(local_dir + "-tree", shardings=SingleDeviceSharding(jax.devices()[0]))["w"]
    assert only0.shape == (4096,) and len(only0.addressable_shards) == (1 if pid == 0 else 0), only0.sharding
    if pid == 0:
        np.testing.assert_array_equal(np.asarray(only0), np.arange(4096.0))
    print(f"process {pid}: a leaf placed on another process's device restores", flush=True)
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


def gcs_kill(url: str, root: str, point: str) -> None:
    "Save step 1 (`expected(1)`, prefix 'model') to gs:// ROOT, then re-save it (`expected(2)`), SIGKILLed at POINT."
    import os
    import signal

    import eformer_nb.serialization.durable as durable
    import eformer_nb.serialization.serialization as ser
    from eformer_nb.paths import ePath, make_gcs_filesystem, set_gcs_filesystem
    from eformer_nb.serialization import CheckpointManager

    set_gcs_filesystem(make_gcs_filesystem(endpoint_url=url))
    mgr = CheckpointManager(root)
    mgr.save(expected(1), 1, prefix="model")
    kill = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    real_arrays, real_ser_json, real_bm_json, real_drop = ser._write_arrays, ser.write_json, \
        durable.write_json_if_generation, ser.drop_arrays

    def arrays(*a):  # every chunk of the new version is written, nothing committed
        real_arrays(*a)
        if point == "arrays":
            kill()

    def bm_json(f, obj, generation):  # the commit: metadata.json carrying the new index (the conditional write)
        if point == "commit" and ePath(f).name == "metadata.json":
            kill()
        return real_bm_json(f, obj, generation)

    def ser_json(f, obj):  # after the commit: index.json, its copy
        if point == "copy" and ePath(f).name == "index.json":
            kill()
        return real_ser_json(f, obj)

    def drop(*a):  # after the commit: the replaced arrays are removed
        if point == "drop":
            kill()
        return real_drop(*a)

    ser._write_arrays, ser.write_json, ser.drop_arrays = arrays, ser_json, drop
    durable.write_json_if_generation = bm_json  # commit_json's conditional write
    print("re-saving", flush=True)
    mgr.save(expected(2), 1, prefix="model")
    print("not killed", flush=True)


def state_gcs_kill(url: str, root: str, point: str) -> None:
    "Save `state_of(1)` to gs:// ROOT, then re-save `state_of(2)` over it, SIGKILLed at POINT."
    import os
    import signal

    import eformer_nb.infra.base_state as bs
    import eformer_nb.infra.mixins.files as files
    import eformer_nb.serialization.durable as durable
    from eformer_nb.paths import ePath, make_gcs_filesystem, set_gcs_filesystem

    set_gcs_filesystem(make_gcs_filesystem(endpoint_url=url))
    state_of(1).save_state(root, verbose=False)
    kill = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    # on gs:// save_pretrained writes in place: `_write_committed`
    real_files, real_opt, real_drop = files._write_committed, bs._write_optimizer_file, bs._drop_replaced

    def model(*a):  # the new version's model files are written
        n = real_files(*a)
        if point == "model":
            kill()
        return n

    def optimizer(*a):  # and its optimizer file: all but the state files
        out = real_opt(*a)
        if point == "optimizer":
            kill()
        return out

    real_commit = durable.write_json_if_generation

    def commit(f, obj, generation):  # the commit: the folder's own state file naming the new version (conditional)
        if point == "commit" and ePath(f) == ePath(root) / bs.STATE_FILE:
            kill()
        return real_commit(f, obj, generation)

    def drop(*a):  # after the commit: the replaced version is removed
        if point == "drop":
            kill()
        return real_drop(*a)

    files._write_committed, bs._write_optimizer_file = model, optimizer
    bs._drop_replaced, durable.write_json_if_generation = drop, commit
    print("re-saving", flush=True)
    state_of(2).save_state(root, verbose=False)
    print("not killed", flush=True)


def crashloop(root: str, kind: str = "ckpt") -> None:
    from eformer_nb.serialization import CheckpointManager, tree_serialize_leaves

    if kind == "tree":
        for step in range(1, 10**9):
            tree_serialize_leaves(root, expected(step))
            print("ready", step, flush=True)
    if kind == "state":
        # two states built once, then re-saved in turn: building one takes ~20x longer than saving it, and the kill
        # is meant to land inside a save
        states = {1: state_of(1), 2: state_of(2)}
        for n in range(10**9):
            states[1 + n % 2].save_state(root, verbose=False)
            print("ready", 1 + n % 2, flush=True)
    mgr = CheckpointManager(root)
    step = (mgr.all_steps() or [0])[-1]
    while True:
        step += 1
        mgr.save(expected(step), step)
        mgr.save(expected(step), step)  # an overwrite of a committed checkpoint: killed half-way too
        if step % 3 == 0 and len(mgr.all_steps()) > 2:
            mgr.delete(mgr.all_steps()[0])  # deletes are killed half-way too
        print("ready", step, flush=True)


def fsize(root: str, limit: int, kind: str = "ckpt") -> None:
    import json
    import resource
    import signal

    import tensorstore  # noqa: F401  (imported before the limit: nothing but the checkpoint's files is written after it)

    from eformer_nb.serialization import CheckpointManager, tree_serialize_leaves

    mgr = CheckpointManager(root, clean=False) if kind == "ckpt" else None
    state = state_of(2) if kind == "state" else None  # built before the limit
    attempts = {"ckpt": {"2": lambda: mgr.save(expected(2), 2), "1": lambda: mgr.save(expected(1), 1)},
                "tree": {"2": lambda: tree_serialize_leaves(root, expected(2))},
                "state": {"2": lambda: state.save_state(root, verbose=False)}}[kind]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    out = {}
    for name, attempt in attempts.items():  # ckpt: a new step, then the committed one again
        try:
            attempt()
            out[name] = "saved"
        except (OSError, ValueError) as e:  # reported, and the parent test asserts on it
            out[name] = f"{type(e).__name__}: {e}"
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "multiprocess":
        multiprocess(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    elif mode == "multiprocess_gcs":
        multiprocess_gcs(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    elif mode == "multiprocess_pretrained":
        multiprocess_pretrained(int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7])
    elif mode == "gcs_kill":
        gcs_kill(*sys.argv[2:5])
    elif mode == "state_gcs_kill":
        state_gcs_kill(*sys.argv[2:5])
    elif mode == "crashloop":
        crashloop(*sys.argv[2:4])
    elif mode == "fsize":
        fsize(sys.argv[2], int(sys.argv[3]), *sys.argv[4:5])
    else:
        sys.exit(f"unknown mode {mode!r}; expected multiprocess, multiprocess_gcs, gcs_kill, state_gcs_kill, "
                 "crashloop or fsize")
