"""eformer_nb.serialization against the real thing: two JAX processes on 127.0.0.1, SIGKILLed savers, fake-gcs-server.

`any_root` tests run on a local directory and on gs:// (TensorStore's gcs driver pointed at the emulator by
`fsspec_utils.kvstore_spec`, which sets TENSORSTORE_GCS_HTTP_URL: the gcs kvstore spec of tensorstore 0.1.86 has no
endpoint member)."""
from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eformer_nb.serialization.durable as durable
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
from serialization_worker import expected, run_pair  # noqa: E402


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


def _hashes(root: ePath) -> dict[str, str]:
    "sha256 of every file under `root`, by relative path."
    files = (p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _chunks_then_fail(real, n: int):
    "A `_write_arrays` that writes the first `n` chunks of the plan (in plan order), then raises."
    def write(tree_dir, plan, compression):
        writes, left = [], n
        for key, chunks, owned in plan.writes:
            if left > 0:
                writes.append((key, chunks, owned[:left]))
            left -= len(owned)
        real(tree_dir, plan._replace(writes=writes), compression)
        raise OSError(f"injected failure after {n} chunks")
    return write


FAULTS = ["chunks:0", "chunks:5", "chunks:all", "index.json", "metadata.json", "rename"]


@pytest.mark.parametrize("resave", [False, True], ids=["new-step", "same-step"])
@pytest.mark.parametrize("fault", FAULTS)
def test_injected_failure_keeps_previous(any_root, fault, resave, monkeypatch):
    """A save that fails at a chosen point of the commit raises, is never listed, and leaves the previous checkpoint
    byte-identical: after the k-th chunk (0, mid-array, all of them), writing index.json, writing metadata.json,
    renaming the work directory."""
    remote = any_root.protocol != "file"
    if remote and fault == "rename":
        pytest.skip("gs:// has no rename: its commit is the one metadata.json write (the metadata.json fault)")
    mesh = _mesh()
    state1 = dict(_state(1, mesh), big=np.arange(3000, dtype=np.float64).reshape(60, 50))  # 8 shards of w + 1 chunk
    mgr = CheckpointManager(any_root)
    mgr.save(state1, 1)
    before = _hashes(any_root / "step-1")
    assert len(before) >= 10, before  # metadata, index, zarr.json x2, 9 chunks
    step = 1 if resave else 2
    if fault.startswith("chunks:"):
        n = fault.split(":")[1]
        failing = _chunks_then_fail(ser_format._write_arrays, 9 if n == "all" else int(n))
        monkeypatch.setattr(ser_format, "_write_arrays", failing)
    elif fault in ("index.json", "metadata.json"):
        # every commit is durable.commit_json (locally a plain durable write, on gs:// the conditional one); locally a
        # checkpoint's metadata.json is DurableSave's write_json into the work directory; a gs:// index.json is the
        # commit's copy (serialization's write_json)
        writers = ((ser_format, "write_json"), (durable, "write_json"), (durable, "write_json_if_generation"))
        for module, name in writers:
            def failing(path, *a, _real=getattr(module, name), **k):
                if ePath(path).name == fault:
                    raise OSError(f"injected failure writing {fault}")
                return _real(path, *a, **k)
            monkeypatch.setattr(module, name, failing)
    else:
        real_replace = os.replace

        def failing_replace(src, dst):
            if str(src).endswith(f"step-{step}.partial"):  # the commit's rename of the work directory
                raise OSError("injected failure renaming the work directory")
            return real_replace(src, dst)

        def failing_exchange(a, b):  # a re-save swaps the two directories in one renameat2 call
            raise OSError("injected failure exchanging the work directory")
        monkeypatch.setattr(os, "replace", failing_replace)
        monkeypatch.setattr(durable, "_exchange", failing_exchange)
    state2 = dict(_state(step, mesh), big=np.zeros((60, 50)))
    with pytest.raises(OSError, match="injected failure"):
        mgr.save(state2, step)
    monkeypatch.undo()
    if remote and fault == "index.json":  # gs://: index.json is written after the commit (metadata.json) as its copy
        assert _bits(mgr.load(step)) == _bits(state2) and mgr.all_steps() == sorted({1, step})
        assert resave or _hashes(any_root / "step-1") == before
        return
    assert mgr.all_steps() == [1] and CheckpointManager(any_root, clean=False).all_steps() == [1]
    assert find_latest_checkpoint(any_root).name == "step-1"
    if remote and resave:  # gs:// re-save: the failed save's marked arrays.<token>/ stay aside until the next save
        after = _hashes(any_root / "step-1")
        assert {k: after.get(k) for k in before} == before  # every previous file, byte for byte
        assert all(k.split("/")[0].startswith("arrays.") for k in set(after) - set(before)), sorted(after)
    else:
        assert _hashes(any_root / "step-1") == before  # every file, byte for byte, and no new one
    assert _bits(mgr.load(1)) == _bits(state1)
    if remote and not resave:
        with pytest.raises(TornCheckpointError, match="never committed"):
            mgr.load(2)
    fresh = CheckpointManager(any_root)  # a new manager cleans what the failed save left
    assert sorted(p.name for p in any_root.iterdir()) == ["step-1"], fresh.removed_stale
    fresh.save(_state(2, mesh), 2)  # and saving works again
    assert fresh.all_steps() == [1, 2]
    assert _hashes(any_root / "step-1") == before or remote and resave


def _fsize(root, limit: int, kind: str) -> dict:
    out = subprocess.run([sys.executable, str(WORKER), "fsize", str(root), str(limit), kind], env=_env(1),
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for attempt, said in result.items():
        assert "File too large" in said or "os_error_code='27'" in said or "errno 27" in said.lower(), result
    return result


def test_file_size_limit_keeps_previous_tree(tmp_path):
    """`tree_serialize_leaves` over a saved tree, on a full disk: it raises, and the old tree's files are byte-identical
    and load (the old code deleted index.json first: the tree was gone)."""
    root = ePath(tmp_path / "tree")
    tree_serialize_leaves(root, expected(1))
    before = _hashes(root)
    _fsize(root, expected(2)["a"].nbytes // 2, "tree")
    after = _hashes(root)
    assert {k: after.get(k) for k in before} == before  # every old file untouched (the failed save's own may remain)
    assert _bits(tree_deserialize_leaves(root)) == _bits(expected(1))
    tree_serialize_leaves(root, expected(3))  # the next save works and clears the failed one's arrays
    assert _bits(tree_deserialize_leaves(root)) == _bits(expected(3))
    assert sum(p.name.startswith("arrays.") for p in root.iterdir()) == 1


def test_tree_overwrite_failing_half_way_keeps_the_previous_tree(tmp_path, monkeypatch):
    """An overwrite of a tree that fails half-way (its first array written, then a disk full in a writer) raises, and
    the previous tree restores bit-exactly (index.json used to go first: no tree at all); the next save removes what
    the failed one left."""
    root = ePath(tmp_path / "atomic")
    tree_serialize_leaves(root, {"a": np.arange(4096.0), "b": np.ones(4096)})
    real = ser_format._write_arrays

    def half_then_disk_full(tree_dir, plan, compression):
        real(tree_dir, plan._replace(writes=plan.writes[:1]), compression)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ser_format, "_write_arrays", half_then_disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        tree_serialize_leaves(root, {"a": -np.arange(4096.0), "b": np.zeros(4096)})
    monkeypatch.undo()
    back = tree_deserialize_leaves(root)
    assert _bits(back) == _bits({"a": np.arange(4096.0), "b": np.ones(4096)})
    assert sum(p.name.startswith("arrays.") for p in root.iterdir()) == 2  # the failed save's, marked, uncommitted
    tree_serialize_leaves(root, {"a": np.zeros(4096)})  # the next save clears what the failed one left
    assert sum(p.name.startswith("arrays.") for p in root.iterdir()) == 1
    assert _bits(tree_deserialize_leaves(root)) == _bits({"a": np.zeros(4096)})


def _state_bits(state) -> tuple:
    return int(state.step), _bits(state.graphstate), _bits(state.opt_state)


def test_file_size_limit_keeps_previous_state(tmp_path):
    """`save_state` over a saved state, on a full disk: it raises, and the previous state loads bit-exactly (the old
    code had deleted easydel_state.json and model.safetensors)."""
    import optax

    from eformer_nb.infra.base_state import EasyDeLState
    from serialization_worker import TX_LR, state_of

    root = ePath(tmp_path / "state")
    state_of(1).save_state(root, verbose=False)
    before = _hashes(root)
    _fsize(root, (root / "model.safetensors").stat().st_size // 2, "state")
    assert _hashes(root) == before
    back = EasyDeLState.load_state(root, tx=optax.adam(TX_LR), verbose=False)
    assert _state_bits(back) == _state_bits(state_of(1))


def test_second_writer_of_a_step_is_told(tmp_path):
    """Two processes saving one step: while this one holds the step (its save lock), another process's save fails
    with an error naming the step and the other writer, and the committed checkpoint stays whole."""
    root = ePath(tmp_path / "two")
    mgr = CheckpointManager(root)
    mgr.save(expected(1), 1)
    script = ("import sys; from eformer_nb.serialization import CheckpointManager\n"
              "from serialization_worker import expected\n"
              "CheckpointManager(sys.argv[1]).save(expected(1), 1)")
    with ser_format.exclusive_writer(root / "step-1", "checkpoint"):
        out = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, timeout=120,
                             env=dict(_env(1), PYTHONPATH=f"{HERE.parent}:{HERE}"))
    assert out.returncode != 0
    said = f"CheckpointLockedError: checkpoint {str(root / 'step-1')!r} is being saved by another writer"
    assert f"{said} (pid {os.getpid()}" in out.stderr, out.stderr[-2000:]
    assert _bits(mgr.load(1)) == _bits(expected(1))


def test_file_size_limit_keeps_previous(tmp_path):
    """A real write failure: a child process under RLIMIT_FSIZE (below one chunk's size, SIGXFSZ ignored) tries a new
    step and a re-save of the committed one; both raise, nothing new is listed, step-1 stays byte-identical."""
    root = ePath(tmp_path / "fsize")
    CheckpointManager(root).save(expected(1), 1)
    before = _hashes(root / "step-1")
    result = _fsize(root, expected(2)["a"].nbytes // 2, "ckpt")
    assert sorted(result) == ["1", "2"], result
    assert list_checkpoints(root)[-1][0] == 1 and [s for s, _ in list_checkpoints(root)] == [1]
    assert find_latest_checkpoint(root).name == "step-1"
    assert _hashes(root / "step-1") == before
    back = CheckpointManager(root, clean=False).load(1)
    assert np.asarray(back["a"]).tobytes() == expected(1)["a"].tobytes()


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


def test_async_background_error_is_raised_once(tmp_path, monkeypatch):
    """A background save that fails part-way (here after its first chunk) leaves no trace in the listing and the
    previous checkpoint byte-identical; the next call to the manager raises it once, with the original as its cause,
    and so does `wait_until_finished` when no other call comes first."""
    from eformer_nb.serialization.async_manager import BackgroundSaveError
    mesh, root = _mesh(), ePath(tmp_path)
    with AsyncCheckpointManager(checkpoint_dir=root) as mgr:
        mgr.save(_state(1, mesh), 1)
        mgr.wait_until_finished()
        before = _hashes(root / "step-1")
        monkeypatch.setattr(ser_format, "_write_arrays", _chunks_then_fail(ser_format._write_arrays, 1))
        mgr.save(_state(2, mesh), 2)  # returns: the failure happens in the background
        with pytest.raises(BackgroundSaveError, match="a background checkpoint save failed: OSError: injected") as e:
            mgr.save(_state(3, mesh), 3)
        assert isinstance(e.value.__cause__, OSError)
        mgr.wait_until_finished()  # raised once: nothing pending now
        mgr.save(_state(4, mesh), 4)
        with pytest.raises(BackgroundSaveError) as e:
            mgr.wait_until_finished()
        assert isinstance(e.value.__cause__, OSError)
        monkeypatch.undo()
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1]
        assert _hashes(root / "step-1") == before
        assert _bits(mgr.load(1)) == _bits(_state(1, mesh))
        mgr.save(_state(5, mesh), 5)  # and saving works again
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 5]


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
    for i, (rc, out) in enumerate(run_pair("multiprocess", lambda i: [str(tmp_path / "run")], _env(4))):
        assert rc == 0, f"process {i} failed:\n{out[-3000:]}"
        assert f"process {i}: checked 4 shards" in out
        assert f"process {i}: policies agreed on [3, 4, 7, 8]" in out
    # one commit: a single step directory, no work directory left, one metadata.json
    run = ePath(tmp_path / "run")
    assert sorted(p.name for p in run.iterdir()) == ["policies", "step-7"]
    assert [s for s, _ in list_checkpoints(run)] == [7]


def test_two_processes_on_gcs_share_the_work(gcs_root, gcs_emulator):
    """Two JAX processes save one sharded array to gs://: each writes its own shards, only process 0 writes the shared
    index.json and metadata.json, and process 1's commit callback runs only once the commit is visible."""
    said = {}
    for i, (rc, out) in enumerate(run_pair("multiprocess_gcs", lambda i: [gcs_emulator.url, str(gcs_root)], _env(4))):
        assert rc == 0, f"process {i} failed:\n{out[-3000:]}"
        line = next(ln for ln in out.splitlines() if ln.startswith(f"process {i}: {{"))
        said[i] = json.loads(line.split(": ", 1)[1])
    assert said[0]["json"] == ["index.json", "metadata.json"], said
    assert said[1]["json"] == [], said  # never the shared files
    assert said[0]["chunks"][0] > 0 and said[1]["chunks"][0] > 0, said  # both wrote shards
    assert said[0]["callback"] == said[1]["callback"] == {"step": 3}, said
    assert [s for s, _ in list_checkpoints(gcs_root)] == [3]
    assert not any(p.name.endswith(".lock") for p in gcs_root.iterdir())


# --- crash safety: SIGKILL at random moments ---------------------------------------------------------------------

def _check_after_kill(root: Path) -> str | None:
    "What is wrong with `root` after a SIGKILL (None: every listed checkpoint is committed and the latest loads whole)."
    listed = list_checkpoints(ePath(root))
    if not listed:
        return "nothing listed"
    for step, path in listed:
        if not (path / METADATA_FILE).is_file() or not (path / "index.json").is_file():
            return f"step {step} listed without its metadata.json / index.json"
    step = listed[-1][0]
    try:
        back = CheckpointManager(root, clean=False).load(step)
    except (OSError, ValueError, RuntimeError) as e:  # a torn checkpoint listed as committed
        return f"latest step {step} does not load: {type(e).__name__}: {str(e)[:200]}"
    exp = expected(step)
    if back["step"] != step or any(np.asarray(back[k]).tobytes() != exp[k].tobytes() for k in ("a", "b")):
        return f"latest step {step} loads other bytes than were saved"
    return None


def _check_tree_after_kill(root: Path) -> str | None:
    "What is wrong with the tree at `root` after a SIGKILL (None: it loads whole, as one of the saved versions)."
    try:
        back = tree_deserialize_leaves(root)
    except (OSError, ValueError, RuntimeError) as e:
        return f"the tree does not load: {type(e).__name__}: {str(e)[:200]}"
    same = _bits(back) == _bits(expected(back["step"]))
    return None if same else f"the tree loads other bytes than step {back['step']}"


def _check_state_after_kill(root: Path) -> str | None:
    "What is wrong with the state folder at `root` after a SIGKILL (None: it loads whole, as one of the saved states)."
    import optax

    from eformer_nb.infra.base_state import EasyDeLState
    from serialization_worker import TX_LR, state_of
    try:
        back = EasyDeLState.load_state(root, tx=optax.adam(TX_LR), verbose=False)
    except (OSError, ValueError, RuntimeError) as e:
        return f"the state does not load: {type(e).__name__}: {str(e)[:200]}"
    step = int(back.step)
    return None if _state_bits(back) == _state_bits(state_of(step)) else f"the state loads other bytes than step {step}"


def _mid_save(root: Path, kind: str) -> bool:
    "True when the kill left a save in flight (a work directory, or a second array directory of the tree)."
    if kind == "tree":
        return sum(p.name.startswith("arrays.") for p in ePath(root).iterdir()) > 1
    if kind == "state":
        return (root.parent / (root.name + ".partial")).exists()
    return any(c.name.endswith(".partial") for c in ePath(root).iterdir())


# kind -> (trials, longest pause after "ready" in s, the check): state saves are slower, so the pauses are longer
SIGKILL_KINDS = {"ckpt": (20, 0.4, _check_after_kill), "tree": (10, 0.4, _check_tree_after_kill),
                 "state": (6, 2.0, _check_state_after_kill)}


@pytest.mark.timeout(600)  # ~40 s on an idle 2-core machine; 20 JAX start-ups take minutes on a loaded one
@pytest.mark.parametrize("kind", list(SIGKILL_KINDS))
def test_sigkill_loop(tmp_path, kind):
    """SIGKILL a process that saves at seeded random moments: step checkpoints (each re-saved once: overwrites) and
    deletes (`ckpt`), a tree overwritten in place (`tree`), a training state re-saved into one folder (`state`).
    Every listed checkpoint, the tree, the state stays whole. A failing trial is recorded and its directory reset, so
    the count of failing trials is reported (against a commit that writes metadata.json before the arrays, about half
    of the 20 `ckpt` trials fail)."""
    trials, pause, check = SIGKILL_KINDS[kind]
    rng = random.Random(20261123)
    root = tmp_path / "crash"
    kills_mid_save, failures = 0, []
    # `trials` kills; past that, more (up to 3x) only while none has landed inside a save: how long a save takes
    # against the rest of the worker's loop depends on the machine, so the loop waits on that condition, not on luck
    for trial in itertools.count():
        if trial >= trials and (kills_mid_save >= 1 or trial >= 3 * trials):
            break
        err = open(tmp_path / f"stderr-{trial}.txt", "w")
        p = subprocess.Popen([sys.executable, str(WORKER), "crashloop", str(root), kind], env=_env(1),
                             stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            deadline = time.monotonic() + 120
            line = p.stdout.readline()  # "ready N": at least one save of this run committed
            said = line or (p.wait(timeout=30), (tmp_path / f"stderr-{trial}.txt").read_text()[-2000:])[1]
            assert line.startswith("ready"), f"trial {trial}: worker exited {p.poll()} before 'ready'; it said {said!r}"
            assert time.monotonic() < deadline
            time.sleep(rng.uniform(0.0, pause))
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
            p.stdout.close()
            err.close()
        kills_mid_save += _mid_save(root, kind)
        problem = check(root)
        if problem is not None:
            failures.append(f"trial {trial}: {problem}")
            for d in (root, root.parent / (root.name + ".partial")):
                if d.exists():
                    ePath(d).rmtree()  # the next trial starts clean, so each failing trial counts once
    print(f"{kind}: {trial} SIGKILLs, {kills_mid_save} landed inside a save, {len(failures)} trials failed")
    assert not failures, f"{len(failures)} of {trial} trials failed:\n" + "\n".join(failures)
    assert kills_mid_save >= 1  # the kills did hit saves in flight


# --- gs:// writers: the lock object and what crashed saves leave ---------------------------------------------------

def test_gcs_second_writer_is_told(gcs_root):
    """On gs:// a step's lock is an object created only if absent (`ifGenerationMatch=0`): while one writer holds it,
    a second save of that step fails naming the step and the lock object, the committed checkpoint stays whole, and
    the lock object is gone once the holder finishes."""
    mgr = CheckpointManager(gcs_root)
    mgr.save(expected(1), 1)
    lock = gcs_root / ".step-1.lock"
    assert not lock.exists()
    held, release = threading.Event(), threading.Event()

    def other_writer():  # another thread: the lock is not re-entrant across threads
        with ser_format.exclusive_writer(gcs_root / "step-1", "checkpoint"):
            held.set()
            release.wait(60)

    t = threading.Thread(target=other_writer)
    t.start()
    try:
        assert held.wait(60)
        assert lock.exists() and f"pid {os.getpid()}" in lock.read_text()
        with pytest.raises(ser_format.CheckpointLockedError) as err:
            mgr.save(expected(2), 1)
        said = str(err.value)
        assert f"checkpoint {str(gcs_root / 'step-1')!r} is being saved by another writer (pid {os.getpid()}" in said
        assert str(lock) in said
        mgr.save(expected(2), 2)  # another step is another lock
    finally:
        release.set()
        t.join(60)
    assert not lock.exists()
    assert _bits(mgr.load(1)) == _bits(expected(1)) and _bits(mgr.load(2)) == _bits(expected(2))
    mgr.save(expected(3), 1)  # free again: the re-save goes through
    assert _bits(mgr.load(1)) == _bits(expected(3))


def test_gcs_stale_lock_is_never_broken_silently(gcs_root):
    "A lock object left by a writer that died refuses the next save with the object to delete; deleting it is enough."
    tree_serialize_leaves(gcs_root / "t", {"w": np.arange(8.0)})
    lock = gcs_root / ".t.lock"
    lock.write_text("pid 4242 on a-host-that-died")
    with pytest.raises(ser_format.CheckpointLockedError, match="pid 4242 on a-host-that-died.*delete that object"):
        tree_serialize_leaves(gcs_root / "t", {"w": np.arange(8.0) * 2})
    assert np.asarray(tree_deserialize_leaves(gcs_root / "t")["w"]).tolist() == list(np.arange(8.0))
    lock.unlink()
    tree_serialize_leaves(gcs_root / "t", {"w": np.arange(8.0) * 2})
    assert np.asarray(tree_deserialize_leaves(gcs_root / "t")["w"]).tolist() == list(np.arange(8.0) * 2)


def test_gcs_crashed_save_arrays_are_cleaned(gcs_root, monkeypatch):
    """A gs:// save that dies after writing chunks leaves its marked `arrays.<token>/`; the next save of the tree (under
    the lock) removes it. An `arrays.<hex>` directory without our marker is never touched."""
    d = gcs_root / "tree"
    tree_serialize_leaves(d, {"w": np.arange(4096.0)})
    committed = ser_format.read_index(d)["arrays"]
    (d / "arrays.deadbeef" / "keep.txt").write_text("not ours")
    with monkeypatch.context() as m:
        m.setattr(ser_format, "_write_arrays", _chunks_then_fail(ser_format._write_arrays, 1))
        with pytest.raises(OSError, match="injected failure"):
            tree_serialize_leaves(d, {"w": np.arange(4096.0) + 1})
    left = sorted(p.name for p in d.iterdir() if p.name.startswith("arrays."))
    assert len(left) == 3 and committed in left and "arrays.deadbeef" in left, left
    assert np.asarray(tree_deserialize_leaves(d)["w"]).tolist() == list(np.arange(4096.0))
    tree_serialize_leaves(d, {"w": np.arange(4096.0) + 2})
    now = ser_format.read_index(d)["arrays"]
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("arrays.")) == sorted(["arrays.deadbeef", now])
    assert (d / "arrays.deadbeef" / "keep.txt").read_text() == "not ours"
    assert np.asarray(tree_deserialize_leaves(d)["w"]).tolist() == list(np.arange(4096.0) + 2)


# --- gs:// re-saves: the commit is one metadata.json write ------------------------------------------------------

GCS_KILL_POINTS = {"arrays": 1, "commit": 1, "copy": 2, "drop": 2}  # point -> the version step-1 must load after


@pytest.mark.parametrize("point", list(GCS_KILL_POINTS))
def test_gcs_resave_sigkill_keeps_a_whole_version(gcs_root, gcs_emulator, point):
    """A re-save of a gs:// checkpoint SIGKILLed between its writes: every new chunk written (`arrays`), just before
    the commit (`commit`: metadata.json), after it (`copy`: before index.json; `drop`: before the old arrays go). Before
    the commit the previous version loads bit-exactly; after it, the new one. The dead writer's lock object is named by
    the next save; once deleted, the next save works and removes what the dead one left (only marked arrays)."""
    out = subprocess.run([sys.executable, str(WORKER), "gcs_kill", gcs_emulator.url, str(gcs_root), point],
                         env=_env(1), capture_output=True, text=True, timeout=240)
    assert out.returncode == -signal.SIGKILL and out.stdout.strip() == "re-saving", out.stdout + out.stderr[-3000:]
    mgr = CheckpointManager(gcs_root, clean=False)
    want = expected(GCS_KILL_POINTS[point])
    assert mgr.all_steps() == [1]
    back = mgr.load(1, prefix="model")
    assert _bits(back) == _bits(want)
    assert _bits(tree_deserialize_leaves(gcs_root / "step-1" / "model")) == _bits(want)  # the tree alone: same one
    for lock in (gcs_root / ".step-1.lock", gcs_root / "step-1" / ".model.lock"):  # the step's, then the tree's
        with pytest.raises(ser_format.CheckpointLockedError, match=f"lock object '{lock}'.*delete that object"):
            mgr.save(expected(3), 1, prefix="model")
        assert _bits(mgr.load(1, prefix="model")) == _bits(want)
        lock.unlink()
    mgr.save(expected(3), 1, prefix="model")
    assert _bits(mgr.load(1, prefix="model")) == _bits(expected(3))
    arrays = [p.name for p in (gcs_root / "step-1" / "model").iterdir() if p.name.startswith("arrays.")]
    assert arrays == [ser_format.read_index(gcs_root / "step-1" / "model")["arrays"]], arrays


def test_gcs_old_format_and_later_tree_saves(gcs_root):
    """A gs:// checkpoint written before metadata.json carried the index (index.json is the tree's only record) still
    loads and re-saves; a `tree_serialize_leaves` into a committed checkpoint later is what loads (the newest `seq`)."""
    mgr = CheckpointManager(gcs_root)
    mgr.save({"w": np.arange(2048.0)}, 1)
    meta_file = gcs_root / "step-1" / METADATA_FILE
    meta = json.loads(meta_file.read_bytes())
    assert meta["indexes"][""]["arrays"] == ser_format.read_index(gcs_root / "step-1")["arrays"]
    old = {k: v for k, v in meta.items() if k not in ("indexes", "digest")}  # as this format was written before
    durable.write_json(meta_file, old)
    idx_file = gcs_root / "step-1" / "index.json"
    ser_format.write_json(idx_file, {k: v for k, v in json.loads(idx_file.read_bytes()).items()
                                      if k not in ("seq", "digest")})
    assert np.asarray(mgr.load(1)["w"]).tolist() == list(np.arange(2048.0))
    mgr.save({"w": np.arange(2048.0) + 1}, 1)  # a re-save over the old format
    assert np.asarray(mgr.load(1)["w"]).tolist() == list(np.arange(2048.0) + 1)
    tree_serialize_leaves(gcs_root / "step-1", {"w": np.arange(2048.0) + 2})  # a later save of the tree alone
    assert np.asarray(mgr.load(1)["w"]).tolist() == list(np.arange(2048.0) + 2)
    assert ser_format.read_index(gcs_root / "step-1")["seq"] == 2  # the old format counts as 0
    arrays = [p.name for p in (gcs_root / "step-1").iterdir() if p.name.startswith("arrays.")]
    assert arrays == [ser_format.read_index(gcs_root / "step-1")["arrays"]], arrays
    meta_file.write_bytes(meta_file.read_bytes().replace(b'"step": 1', b'"step": 7'))
    with pytest.raises(ser_format.CorruptCheckpointError, match="does not match its digest"):
        ser_format.read_index(gcs_root / "step-1")  # a modified commit object is never followed silently
