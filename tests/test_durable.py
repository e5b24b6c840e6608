"""Faults injected into `serialization.durable` (its chapter states each promise and links here): a work directory is
made whole or not at all, a removal killed part-way leaves a directory still marked as ours, and the swap without
renameat2 gives the same result as with it."""
from __future__ import annotations

import json
import os

import pytest

import eformer_nb.serialization.durable as durable
from eformer_nb.paths import ePath
from eformer_nb.serialization.durable import (MARKER_FILE, Ownership, fresh_work_dir, remove_marked, rename_into_place,
                                              write_file)

pytestmark = pytest.mark.timeout(60)


def test_fresh_work_dir_is_whole_or_absent(tmp_path, monkeypatch):
    """A failure while marking the work directory (the marker's write fails, as on a full disk) leaves no unmarked
    `.partial` behind to block every later save of that folder, and no temporary directory."""
    dest = ePath(tmp_path) / "step-3"

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(json, "dumps", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        fresh_work_dir(dest)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == []
    work = fresh_work_dir(dest)
    assert (work.name, sorted(os.listdir(work)), sorted(os.listdir(tmp_path))) == \
        ("step-3.partial", [MARKER_FILE], ["step-3.partial"])


def _trace_fsync_and_rename(monkeypatch) -> list[tuple]:
    "The real `os.fsync` and `os.replace`, each call recorded in order as `('fsync', path)` / `('rename', src, dst)`."
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *a, **k):
        events.append(("rename", os.fspath(src), os.fspath(dst)))
        return real_replace(src, dst, *a, **k)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def test_write_file_syncs_the_file_then_renames_then_syncs_the_folder(tmp_path, monkeypatch):
    """`write_file`'s promise: once it returns, the new bytes survive a power cut. The temporary is fsynced before the
    rename makes it visible, and the folder after it (the rename is an entry in the folder: without that fsync the
    name can still point at the old file, or at nothing, after a crash). Without fsync=False, neither."""
    events = _trace_fsync_and_rename(monkeypatch)
    f = ePath(tmp_path) / "meta.json"
    write_file(f, [b"{}"])
    tmp = events[0][1] if events and events[0][0] == "fsync" else None  # the temporary, named on the fly
    assert tmp != str(f) and events == [("fsync", tmp), ("rename", tmp, str(f)), ("fsync", str(tmp_path))], events
    assert f.read_bytes() == b"{}"
    events.clear()
    write_file(f, [b"[]"], fsync=False)  # the caller syncs
    assert [e[0] for e in events] == ["rename"] and f.read_bytes() == b"[]"


def _remove_killed_part_way(d: ePath, monkeypatch) -> None:
    "Fill marked directory `d`, then `remove_marked(d)` with the removal of its last file failing (a crash there)."
    (d / "arrays").mkdir(parents=True)
    for name in (MARKER_FILE, "a.bin", "arrays/c.bin", "z.bin"):
        (d / name).write_text(name)
    real_unlink = os.unlink

    def killed_at_z(path, *args, **kwargs):
        if os.fspath(path).endswith("z.bin"):
            raise RuntimeError("killed while removing the old version")
        return real_unlink(path, *args, **kwargs)
    monkeypatch.setattr(os, "unlink", killed_at_z)
    with pytest.raises(RuntimeError, match="killed while removing"):
        remove_marked(d)
    monkeypatch.undo()


def test_remove_marked_leaves_the_marker_last(tmp_path, monkeypatch):
    """A removal killed part-way (the removal of one file fails) leaves a directory still marked as ours, which the
    next clean removes; an unmarked one would be refused by every later save as not ours."""
    d = ePath(tmp_path) / "old.partial"
    _remove_killed_part_way(d, monkeypatch)
    assert sorted(p.name for p in d.iterdir()) == [MARKER_FILE, "z.bin"]  # still ours
    remove_marked(d)
    assert not d.exists()


@pytest.mark.parametrize("exchange", [True, False])
def test_rename_into_place_with_and_without_renameat2(tmp_path, monkeypatch, exchange):
    """Re-saving a folder swaps it atomically (renameat2), or, where that call is missing, takes two renames: either
    way the new version is in place, the user's files are kept and no work directory is left."""
    if not exchange:
        monkeypatch.setattr(durable, "_exchange", lambda a, b: False)
    folder, models = ePath(tmp_path) / "model", Ownership(r"model\.safetensors")
    for version in (b"v1", b"v2"):
        work = fresh_work_dir(folder, keep=models.foreign(folder))
        (work / "model.safetensors").write_bytes(version)
        rename_into_place(work, folder)
        if version == b"v1":
            (folder / "README.md").write_text("my notes")
    assert ((folder / "model.safetensors").read_bytes(), (folder / "README.md").read_text()) == (b"v2", "my notes")
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_a_version_moved_aside_is_put_back(tmp_path):
    """A re-save killed between its two renames (the committed version moved aside, the new one not in place): the
    next `rename_into_place` (or `clean_stale`) puts the committed one back first."""
    folder = ePath(tmp_path) / "step-1"
    aside = ePath(tmp_path) / ("step-1" + durable.OLD_SUFFIX)
    aside.mkdir()
    (aside / "metadata.json").write_text("{}")
    assert durable.restore_moved_aside(folder) and (folder / "metadata.json").exists() and not aside.exists()
    assert not durable.restore_moved_aside(folder)  # nothing moved aside now


def test_torn_checkpoint_save_is_never_listed(tmp_path, monkeypatch):
    """A checkpoint save that fails part-way through its arrays leaves only a marked `.partial`: the last committed
    checkpoint stays the latest, bit-exact, and `clean_stale` removes the leftover."""
    import numpy as np

    import eformer_nb.serialization.serialization as ser
    from eformer_nb.serialization.base_manager import clean_stale, list_checkpoints, save_checkpoint_dir

    base = ePath(tmp_path)
    save_checkpoint_dir({"w": np.arange(4096.0)}, base / "step-12", step=12)()
    real = ser._write_arrays

    def failing(tree_dir, plan, compression):  # write the first array, then fail: a torn save
        real(tree_dir, plan._replace(writes=plan.writes[:1]), compression)
        raise RuntimeError("disk on fire")
    monkeypatch.setattr(ser, "_write_arrays", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        save_checkpoint_dir({"a": np.ones(2048), "b": np.ones(2048)}, base / "step-20", step=20)()
    monkeypatch.undo()
    assert [s for s, _ in list_checkpoints(base)] == [12]
    assert ser.tree_deserialize_leaves(base / "step-12")["w"].tolist() == np.arange(4096.0).tolist()
    assert sorted(p.name for p in base.iterdir() if not p.name.startswith(".")) == ["step-12", "step-20.partial"]
    assert clean_stale(base) == ["step-20.partial"]
    assert sorted(p.name for p in base.iterdir() if not p.name.startswith(".")) == ["step-12"]


def test_half_removed_old_version_is_cleaned_and_the_step_saves_again(tmp_path, monkeypatch):
    """The old version of a re-save removed part-way (a crash while `remove_marked` runs) is still marked: the next
    `clean_stale` removes it and the step saves again (an unmarked one made every later save of the step fail with
    "exists and was not made by eformer_nb")."""
    import numpy as np

    from eformer_nb.serialization.base_manager import clean_stale, save_checkpoint_dir

    base = ePath(tmp_path)
    _remove_killed_part_way(base / "step-30.partial", monkeypatch)
    assert clean_stale(base) == ["step-30.partial"]
    assert save_checkpoint_dir({"w": np.ones(3)}, base / "step-30", step=30)().name == "step-30"
