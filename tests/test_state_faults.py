"""`EasyDeLState.save_state` on a local disk, with faults injected: a failed write, a slowed or failing fsync, a model
whose `save_pretrained` clears its folder. Each test checks that the previous state loads whole, or that the new one
does, and that the error names what failed. The `SIGKILL` and `RLIMIT_FSIZE` versions are in `test_serialization.py`,
the gs:// ones in `test_state_gcs.py`. One device is enough: the state is not sharded."""
from __future__ import annotations

import os
import sys
import threading
import time
import unittest
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eformer_nb.infra.base_state as bs
import eformer_nb.infra.mixins.files as files
import eformer_nb.serialization.durable as durable
from eformer_nb.infra.base_state import OPTIMIZER_FILE, STATE_FILE, EasyDeLState
from eformer_nb.modules.llama import LlamaForCausalLM
from eformer_nb.serialization.durable import MARKER_FILE

pytestmark = pytest.mark.timeout(300)
sys.path.insert(0, str(Path(__file__).parent))
from serialization_worker import TX_LR, state_of  # noqa: E402


def _bits(state) -> tuple:
    leaves = jax.tree.leaves((state.graphstate, state.opt_state))
    return int(state.step), [(str(x.dtype), np.shape(x), np.asarray(x).tobytes()) for x in leaves]


def _load(folder):
    return EasyDeLState.load_state(folder, tx=optax.adam(TX_LR), verbose=False)


@pytest.fixture(scope="module")
def state():
    "A tiny Llama state with its Adam state, at step 12 (built once: the tests only save and load it)."
    return state_of(12)


def _open_on(fd: int, path: Path) -> bool:
    "Whether descriptor `fd` is open on `path` now (a closed number may be reused for another file)."
    link = f"/proc/self/fd/{fd}"
    return os.path.lexists(link) and os.readlink(link) == str(path.resolve())


def test_background_fsync_error_reaches_the_caller(tmp_path, monkeypatch):
    """An fsync that fails on `_BackgroundSync`'s thread (an injected EIO) fails `wait()` naming the file, never only
    a message printed by the thread; `wait(raise_error=False)` only waits; the descriptor is closed either way."""
    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * 4096)

    def failing_fsync(fd):
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", failing_fsync)
        sync = bs._BackgroundSync(f)
        sync._thread.join()
    with pytest.raises(OSError, match=r"f\.bin': fsync failed \(\[Errno 5\] Input/output error\)"):
        sync.wait()
    sync.wait(raise_error=False)  # for a caller that is failing already
    assert not sync._thread.is_alive() and not _open_on(sync._fd, f)


def test_failed_resave_keeps_the_previous_state(state, tmp_path, monkeypatch):
    """The model is written, then the disk fills up: the re-save fails with the disk's error and the previous state
    loads bit-exactly (the new version was written into a `.partial` folder that is never swapped in)."""
    state.save_state(tmp_path / "ckpt", verbose=False)
    before = _bits(_load(tmp_path / "ckpt"))

    def disk_full(st, work, *args):
        st.model.save_pretrained(str(work))
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(bs, "_write_state", disk_full)
        with pytest.raises(OSError, match="No space left on device"):
            state.replace(step=jnp.int32(99)).save_state(tmp_path / "ckpt", verbose=False)
    assert _bits(_load(tmp_path / "ckpt")) == before == _bits(state)


def test_optimizer_fsync_overlaps_the_model_and_is_awaited(state, tmp_path, monkeypatch):
    """The optimizer file's fsync runs on a thread (slowed here by 1 s): the model file is written while it runs, and
    the state file only after it ended."""
    events, started = [], threading.Event()
    real_fsync, real_shard, real_json = os.fsync, files._write_shard, durable.write_json

    def slow_fsync(fd):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        main = threading.current_thread() is threading.main_thread()
        if OPTIMIZER_FILE in name:
            events.append(("fsync start", OPTIMIZER_FILE, main))
            started.set()
            time.sleep(1.0)
        real_fsync(fd)
        if OPTIMIZER_FILE in name:
            events.append(("fsync end", OPTIMIZER_FILE, main))

    def shard(f, tensors):
        started.wait(timeout=10)  # the model is written once that fsync runs (if it never starts, the order fails)
        real_shard(f, tensors)
        events.append(("written", f.name, True))

    def state_json(f, obj):
        real_json(f, obj)
        if f.name == STATE_FILE:
            events.append(("written", f.name, True))

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", slow_fsync)
        m.setattr(files, "_write_shard", shard)
        m.setattr(durable, "write_json", state_json)
        state.save_state(tmp_path / "order", verbose=False)
    assert events == [("fsync start", OPTIMIZER_FILE, False), ("written", "model.safetensors", True),
                      ("fsync end", OPTIMIZER_FILE, False), ("written", STATE_FILE, True)]
    assert _bits(_load(tmp_path / "order")) == _bits(state)


def test_optimizer_fsync_error_fails_the_save(state, tmp_path, monkeypatch):
    """An fsync of the optimizer file that fails (an injected EIO) fails the save naming the file; the previous state
    stays loadable, the failed save's marked `.partial` folder is left, and the next save clears it."""
    state.save_state(tmp_path / "order", verbose=False)
    real_fsync = os.fsync

    def eio_fsync(fd):
        if OPTIMIZER_FILE in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", eio_fsync)
        with pytest.raises(OSError, match=r"optimizer\.safetensors': fsync failed \(\[Errno 5\] Input/output error\)"):
            state.replace(step=jnp.int32(77)).save_state(tmp_path / "order", verbose=False)
    assert _bits(_load(tmp_path / "order")) == _bits(state)  # the previous save, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["order", "order.partial"]
    assert (tmp_path / "order.partial" / MARKER_FILE).exists()
    state.save_state(tmp_path / "order", verbose=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["order"]


def test_save_pretrained_that_clears_the_folder(state, tmp_path, monkeypatch):
    """A model whose `save_pretrained` removes the optimizer file written before it still gets a whole state: the save
    sees the file is gone, says so, and writes it again."""
    real = LlamaForCausalLM.save_pretrained

    def clearing_save_pretrained(self, d, **kw):  # removes what it did not write, as some models' savers do
        for p in Path(d).iterdir():
            if p.name == OPTIMIZER_FILE:
                p.unlink()
        return real(self, d, **kw)

    with monkeypatch.context() as m:
        m.setattr(LlamaForCausalLM, "save_pretrained", clearing_save_pretrained)
        with unittest.TestCase().assertLogs(bs._logger.name, "WARNING") as logs:
            state.save_state(tmp_path / "cleared", verbose=False)
    assert f"save_pretrained removed or replaced {OPTIMIZER_FILE}" in logs.output[0], logs.output
    assert _bits(_load(tmp_path / "cleared")) == _bits(state)
