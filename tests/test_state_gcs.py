"""`EasyDeLState.save_state` on gs:// (fake-gcs-server): a re-save never loses the previous state.

Object stores have no rename, so a gs:// save writes the new version into a new folder `state.<hex>/` (marked ours
first) and commits it with ONE write: the folder's `easydel_state.json`, which names that version folder and carries
the digests. Until that write lands, the previous state file and every file it names are untouched; after it, the
replaced version (our marked folder, or the files an older in-place save named) is removed. Each test here injects a
failure, or a real SIGKILL (`serialization_worker.py state_gcs_kill`), at one write of a re-save and checks that
exactly one whole version loads bit-exactly, and that the next save works and leaves one version folder."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import eformer_nb.infra.base_state as bs
import eformer_nb.infra.mixins.files as files
import eformer_nb.serialization.durable as durable
import eformer_nb.serialization.serialization as ser
from eformer_nb.infra.base_state import STATE_FILE, EasyDeLState
from eformer_nb.modules.llama import LlamaForCausalLM
from eformer_nb.serialization.durable import MARKER_FILE

pytestmark = pytest.mark.timeout(300)
HERE = Path(__file__).parent
WORKER = HERE / "serialization_worker.py"
sys.path.insert(0, str(HERE))
from serialization_worker import TX_LR, state_of  # noqa: E402


def _bits(state) -> tuple:
    leaves = jax.tree.leaves((state.graphstate, state.opt_state))
    return int(state.step), [(str(x.dtype), np.shape(x), np.asarray(x).tobytes()) for x in leaves]


def _load(root):
    return EasyDeLState.load_state(root, tx=optax.adam(TX_LR), verbose=False)


def _versions(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if bs._VERSION_DIR.fullmatch(p.name))


def _objects(root) -> dict[str, bytes]:
    "Every object under `root` (relative name -> bytes)."
    return {str(p)[len(str(root)) + 1:]: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_gcs_state_layout_roundtrip_and_resave(gcs_root):
    state1, state2 = state_of(1), state_of(2)
    state1.save_state(gcs_root, verbose=False)
    meta = json.loads((gcs_root / STATE_FILE).read_text())
    (v1,) = _versions(gcs_root)
    assert meta["dir"] == v1 and meta["version"] == bs.STATE_FORMAT_VERSION
    assert sorted(p.name for p in gcs_root.iterdir()) == [STATE_FILE, v1]
    (shard,) = [p.name for p in (gcs_root / v1).iterdir() if files._FRESH_SHARD.match(p.name)]  # gs://: index layout
    assert sorted(p.name for p in (gcs_root / v1).iterdir()) == sorted(
        [MARKER_FILE, "config.json", shard, files.WEIGHTS_INDEX_NAME, bs.OPTIMIZER_FILE, STATE_FILE])
    assert _bits(_load(gcs_root)) == _bits(state1)
    model = LlamaForCausalLM.from_pretrained(str(gcs_root / v1))  # the version folder is a Hugging Face folder
    assert _bits(model.to_state().replace(step=state1.step, opt_state=state1.opt_state))[1][:3] == _bits(state1)[1][:3]
    state2.save_state(gcs_root, verbose=False)
    (v2,) = _versions(gcs_root)
    assert v2 != v1 and json.loads((gcs_root / STATE_FILE).read_text())["dir"] == v2
    assert _bits(_load(gcs_root)) == _bits(state2)
    state2.save_state(gcs_root, verbose=False, save_optimizer=False)  # a state without an optimizer state
    with pytest.raises(FileNotFoundError, match="holds none"):
        _load(gcs_root)
    assert int(EasyDeLState.load_state(gcs_root, verbose=False).step) == 2


def _fail_at(point: str, root, monkeypatch) -> None:
    "Make the next re-save raise at `point`."
    boom = OSError(28, f"injected failure at {point}")

    def raiser(*a, **k):
        raise boom

    def after(real):
        def f(*a, **k):
            real(*a, **k)
            raise boom
        return f

    if point == "model":
        monkeypatch.setattr(files, "_write_committed", after(files._write_committed))  # gs://: in place
    elif point == "optimizer":
        monkeypatch.setattr(bs, "_write_optimizer_file", raiser)
    elif point in ("version_file", "commit"):  # the version folder's own state file; the folder's (the commit)
        real = durable.write_json
        target = root / STATE_FILE

        def json_write(f, obj):
            if (f == target) == (point == "commit") and f.name == STATE_FILE:
                raise boom
            return real(f, obj)
        monkeypatch.setattr(durable, "write_json", json_write)
        if point == "commit":  # the commit is a write conditional on the state file's generation (only that write:
            real_if = durable.write_json_if_generation  # the model's save_pretrained commits its index the same way)

            def commit_fails(f, obj, generation):
                if f == target:
                    raise boom
                return real_if(f, obj, generation)
            monkeypatch.setattr(durable, "write_json_if_generation", commit_fails)
    else:
        raise ValueError(point)


@pytest.mark.parametrize("point", ["model", "optimizer", "version_file", "commit"])
def test_gcs_state_injected_failure_keeps_previous(gcs_root, monkeypatch, point):
    """A failure at any write before the commit: the previous state loads bit-exactly, every previous object is
    byte-identical, the only new objects are in one new marked version folder; the next save removes it."""
    state1 = state_of(1)
    state1.save_state(gcs_root, verbose=False)
    before = _objects(gcs_root)
    with monkeypatch.context() as m:
        _fail_at(point, gcs_root, m)
        with pytest.raises(OSError, match=f"injected failure at {point}"):
            state_of(2).save_state(gcs_root, verbose=False)
    after = _objects(gcs_root)
    assert {k: after[k] for k in before} == before
    new = {k.split("/")[0] for k in set(after) - set(before)}
    assert len(new) == 1 and bs._VERSION_DIR.fullmatch(new.pop())
    assert _bits(_load(gcs_root)) == _bits(state1)
    state_of(3).save_state(gcs_root, verbose=False)
    assert len(_versions(gcs_root)) == 1 and _bits(_load(gcs_root)) == _bits(state_of(3))


def test_gcs_state_failure_after_commit_loads_the_new_one(gcs_root, monkeypatch):
    "A failure while the replaced version is removed: the new state is committed and loads; the next save cleans up."
    state_of(1).save_state(gcs_root, verbose=False)
    with monkeypatch.context() as m:
        m.setattr(bs, "_drop_replaced", lambda *a: (_ for _ in ()).throw(OSError("injected failure at drop")))
        with pytest.raises(OSError, match="at drop"):
            state_of(2).save_state(gcs_root, verbose=False)
    assert _bits(_load(gcs_root)) == _bits(state_of(2)) and len(_versions(gcs_root)) == 2
    state_of(3).save_state(gcs_root, verbose=False)
    assert len(_versions(gcs_root)) == 1 and _bits(_load(gcs_root)) == _bits(state_of(3))


def test_gcs_state_removes_only_ours(gcs_root, tmp_path):
    """An older in-place state (files at the folder's root, no version folder) is replaced: the files its state file
    names go after the commit; a user's file and an unmarked `state.<hex>` folder stay."""
    old = state_of(1)
    old.save_state(tmp_path / "flat", verbose=False)  # what an in-place gs:// save wrote: everything at the root
    for f in (tmp_path / "flat").iterdir():
        if f.name != MARKER_FILE:
            (gcs_root / f.name).write_bytes(f.read_bytes())
    assert "dir" not in json.loads((gcs_root / STATE_FILE).read_text()) and (gcs_root / "model.safetensors").exists()
    assert _bits(_load(gcs_root)) == _bits(old)
    (gcs_root / "notes.txt").write_text("mine")
    (gcs_root / "state.0badc0de" / "keep.txt").write_text("not marked: not ours")
    state_of(2).save_state(gcs_root, verbose=False, overwrite=True)
    names = sorted(p.name for p in gcs_root.iterdir())
    (v,) = [n for n in _versions(gcs_root) if n != "state.0badc0de"]
    assert names == sorted([STATE_FILE, "notes.txt", "state.0badc0de", v]), names
    assert (gcs_root / "state.0badc0de" / "keep.txt").read_text() == "not marked: not ours"
    assert _bits(_load(gcs_root)) == _bits(state_of(2))


STATE_KILL_POINTS = {"model": 1, "optimizer": 1, "commit": 1, "drop": 2}  # point -> the state that must load after


@pytest.mark.parametrize("point", list(STATE_KILL_POINTS))
def test_gcs_state_resave_sigkill_keeps_a_whole_version(gcs_root, gcs_emulator, point):
    """A real process re-saving a gs:// state, SIGKILLed after the new model files (`model`), after the optimizer file
    (`optimizer`), just before the commit (`commit`) or just after it (`drop`): before the commit the previous state
    loads bit-exactly, after it the new one. The dead writer's lock object is named by the next save; once it is
    deleted, the next save works and leaves exactly one version folder."""
    env = dict(__import__("os").environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(HERE.parent))
    out = subprocess.run([sys.executable, str(WORKER), "state_gcs_kill", gcs_emulator.url, str(gcs_root), point],
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == -signal.SIGKILL and out.stdout.strip() == "re-saving", out.stdout + out.stderr[-3000:]
    want = state_of(STATE_KILL_POINTS[point])
    assert _bits(_load(gcs_root)) == _bits(want)
    lock = gcs_root.parent / f".{gcs_root.name}.lock"
    with pytest.raises(ser.CheckpointLockedError, match="delete that object"):
        state_of(3).save_state(gcs_root, verbose=False)
    assert _bits(_load(gcs_root)) == _bits(want)
    lock.unlink()
    state_of(3).save_state(gcs_root, verbose=False)
    assert len(_versions(gcs_root)) == 1 and _bits(_load(gcs_root)) == _bits(state_of(3))


def test_gcs_state_broken_lock_first_commit_wins_whole(gcs_root, monkeypatch):
    """A live writer's lock object is deleted (taken for a dead writer's); a second writer starts and writes its version
    folder, then waits at its commit while the first one commits. The second one's start used to remove the first
    one's in-flight version folder (it looked like a crashed save's), so the first commit named a folder that was
    gone. Now other saves' folders are removed only after a commit: the first state loads bit-exactly, the second
    writer loses with CheckpointLockedError, and one version folder is left."""
    import threading

    state_of(1).save_state(gcs_root, verbose=False)
    real, box = durable.write_json_if_generation, {}
    b_at_commit, a_done = threading.Event(), threading.Event()
    lock = gcs_root.parent / f".{gcs_root.name}.lock"

    def run_b():
        try:
            state_of(3).save_state(gcs_root, verbose=False)
        except BaseException as e:  # noqa: BLE001 - asserted below
            box["err"] = e
        finally:
            b_at_commit.set()

    def gate(f, obj, generation):
        if f.name == STATE_FILE and threading.current_thread().name == "writer-b":
            b_at_commit.set()
            assert a_done.wait(120)
        elif f.name == STATE_FILE and "b" not in box:
            lock.unlink()
            box["b"] = threading.Thread(target=run_b, name="writer-b")
            box["b"].start()
            assert b_at_commit.wait(240) and "err" not in box, box.get("err")
        return real(f, obj, generation)

    monkeypatch.setattr(durable, "write_json_if_generation", gate)
    try:
        state_of(2).save_state(gcs_root, verbose=False)
    finally:
        a_done.set()
        box["b"].join(240)
        monkeypatch.setattr(durable, "write_json_if_generation", real)
    assert isinstance(box.get("err"), ser.CheckpointLockedError), box.get("err")
    assert _bits(_load(gcs_root)) == _bits(state_of(2))
    assert len(_versions(gcs_root)) == 1 and not lock.exists()


def test_gcs_state_first_save_killed_in_its_model_write(gcs_root):
    """What a SIGKILL during the model write of a first gs:// save leaves: a marked version folder and, beside it, the
    lock object of that folder's save_pretrained. Both are ours: the next save goes through (it used to be refused as
    'not a saved state' naming the lock object) and removes them after its commit."""
    (gcs_root / "state.deadbeef" / MARKER_FILE).write_text("{}")
    (gcs_root / "state.deadbeef" / "model-0badc0de-00001-of-00001.safetensors").write_bytes(b"torn")
    (gcs_root / ".state.deadbeef.lock").write_bytes(b"pid 1 on a dead host (save 00)")
    state_of(1).save_state(gcs_root, verbose=False)
    assert _bits(_load(gcs_root)) == _bits(state_of(1))
    assert len(_versions(gcs_root)) == 1 and "state.deadbeef" not in _versions(gcs_root)
    assert not (gcs_root / ".state.deadbeef.lock").exists()
