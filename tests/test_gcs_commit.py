"""The gs:// commit of a checkpoint against a real GCS emulator (fake-gcs-server): the commit write of `metadata.json`
is conditional on the generation read when the save started, and a re-save under another prefix removes the previous
version's tree after the commit (locally and on gs://), never anything that is not ours."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import eformer_nb.serialization.base_manager as bm
import eformer_nb.serialization.durable as durable
from eformer_nb.paths import ePath
from eformer_nb.serialization import tree_deserialize_leaves, tree_serialize_leaves
from eformer_nb.serialization.serialization import CheckpointLockedError

pytestmark = pytest.mark.timeout(300)
N = 1 << 16  # 512 KiB of float64: chunk objects, not a leaf inline in the index


def _objects(root: ePath) -> dict[str, bytes]:
    "Every file under `root` (local or gs://) by its path relative to `root`, with its bytes (lock files left out)."
    out = {}
    for p in root.rglob("*"):
        if p.is_file() and not p.name.endswith(".lock"):
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


def test_emulator_honours_generation_preconditions(gcs_root):
    "The precondition the commit relies on really holds on the emulator: a stale or absent generation is refused."
    f = gcs_root / "probe.json"
    assert durable.object_generation(f) == 0
    assert durable.write_json_if_generation(f, {"v": 1}, 0)
    g1 = durable.object_generation(f)
    assert g1 > 0
    assert not durable.write_json_if_generation(f, {"v": 2}, 0)  # not absent any more
    assert not durable.write_json_if_generation(f, {"v": 2}, g1 + 1)  # a generation it never had
    assert durable.write_json_if_generation(f, {"v": 2}, g1)
    assert not durable.write_json_if_generation(f, {"v": 3}, g1)  # stale now
    assert json.loads(f.read_bytes())["v"] == 2
    assert not durable.write_json_if_generation(gcs_root / "absent.json", {"v": 1}, g1)  # a replace of nothing
    assert not (gcs_root / "absent.json").exists()
    g2 = durable.object_generation(f)
    # gcsfs retries a request whose answer was lost: the retry's 412 over our own bytes is our write, not a lost race
    assert durable.write_json_if_generation(f, {"v": 2}, g1)
    assert durable.object_generation(f) == g2


def test_lost_race_keeps_the_winner(gcs_root, monkeypatch):
    """A writer whose lock objects are deleted mid-save while a second writer saves and commits the same step: its
    commit is refused with an error naming the step and the object, the winner's version is untouched (every object
    byte-identical), the loser's own arrays are removed, and the next save works."""
    step = gcs_root / "step-3"
    bm.save_checkpoint_dir({"w": np.full(N, 1.0)}, step, step=3, prefix="model")()
    real, seen = durable.write_json_if_generation, {}

    def another_writer_first(f, obj, generation):
        if not seen:
            seen["loser"] = obj["indexes"]["model"]["arrays"]
            for lock in (gcs_root / ".step-3.lock", step / ".model.lock"):
                assert lock.exists(), lock
                lock.unlink()  # taken for a dead writer's lock
            with ThreadPoolExecutor(1) as ex:  # lock objects are held per thread: this is another writer
                ex.submit(bm.save_checkpoint_dir({"w": np.full(N, 3.0)}, step, step=3, prefix="model")).result()
            seen["winner"] = _objects(step)
        return real(f, obj, generation)

    monkeypatch.setattr(durable, "write_json_if_generation", another_writer_first)  # commit_json's
    with pytest.raises(CheckpointLockedError) as e:
        bm.save_checkpoint_dir({"w": np.full(N, 2.0)}, step, step=3, prefix="model")()
    msg = str(e.value)
    assert f"checkpoint {str(step)!r} (step 3) was committed by another writer" in msg, msg
    assert str(step / "metadata.json") in msg, msg
    monkeypatch.setattr(bm, "write_json_if_generation", real)
    after = _objects(step)
    assert after == seen["winner"]  # nothing of the winner's was touched, nothing of the loser's is left
    assert not any(k.startswith(f"model/{seen['loser']}") for k in after)
    assert np.asarray(tree_deserialize_leaves(step, prefix="model")["w"]).tolist() == [3.0] * N
    assert [p.name for p in gcs_root.iterdir()] == ["step-3"]  # no lock object left behind
    bm.save_checkpoint_dir({"w": np.full(N, 4.0)}, step, step=3, prefix="model")()
    assert np.asarray(bm.CheckpointManager(gcs_root).load(3, prefix="model")["w"]).tolist() == [4.0] * N
    arrays = [p.name for p in (step / "model").iterdir() if p.name.startswith("arrays.")]
    assert len(arrays) == 1, arrays


def test_commit_precondition_is_read_before_the_committed_version(gcs_root, monkeypatch):
    """The generation is read when the save starts: a commit landing after that read (here, between the read and the
    rest of the save) makes this save's commit fail, even though no lock was broken by the test itself."""
    step = gcs_root / "step-1"
    bm.save_checkpoint_dir({"w": np.zeros(N)}, step, step=1)()
    real = bm._committed_trees

    def then_someone_commits(dest, prefix):
        out = real(dest, prefix)
        meta = bm.read_metadata(dest)
        durable.write_json(dest / bm.METADATA_FILE, {k: v for k, v in meta.items() if k != "digest"})  # new generation
        return out

    monkeypatch.setattr(bm, "_committed_trees", then_someone_commits)
    with pytest.raises(CheckpointLockedError, match="is no longer at generation"):
        bm.save_checkpoint_dir({"w": np.ones(N)}, step, step=1)()
    assert np.asarray(tree_deserialize_leaves(step)["w"]).tolist() == [0.0] * N


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_resave_under_another_prefix_drops_the_old_tree(where, tmp_path, request):
    """A re-save of a step under another prefix replaces the checkpoint whole: the old prefix tree is gone after the
    commit (locally by the swap; on gs:// by the drop of the trees the previous metadata named), and the new tree
    loads; before the commit (a failed commit) the old version is whole."""
    root = ePath(tmp_path) / "run" if where == "local" else request.getfixturevalue("gcs_root")
    step = root / "step-1"
    bm.save_checkpoint_dir({"w": np.arange(float(N))}, step, step=1, prefix="model")()
    assert sorted(p.name for p in step.iterdir() if not p.name.startswith(".")) == ["metadata.json", "model"]
    bm.save_checkpoint_dir({"w": -np.arange(float(N))}, step, step=1, prefix="params")()
    assert bm.read_metadata(step)["trees"] == ["params"]
    assert sorted(p.name for p in step.iterdir() if not p.name.startswith(".")) == ["metadata.json", "params"]
    assert not any(k.startswith("model/") for k in _objects(step))
    assert np.asarray(tree_deserialize_leaves(step, prefix="params")["w"]).tolist() == (-np.arange(float(N))).tolist()
    bm.save_checkpoint_dir({"w": np.ones(N)}, step, step=1)()  # to the step's root: params goes
    assert sorted(k.split("/")[0] for k in _objects(step) if not k.startswith("arrays.")) == [
        ".eformer_nb", "index.json", "metadata.json"]
    bm.save_checkpoint_dir({"w": np.zeros(N)}, step, step=1, prefix="model")()  # and back: the root tree goes
    assert sorted({k.split("/")[0] for k in _objects(step)}) == [".eformer_nb", "metadata.json", "model"]
    assert np.asarray(bm.CheckpointManager(root).load(1, prefix="model")["w"]).tolist() == [0.0] * N


def test_gcs_failed_commit_keeps_the_old_prefix_tree(gcs_root, monkeypatch):
    "A prefix switch whose commit fails leaves the previous version byte-identical (its tree is dropped only after)."
    step = gcs_root / "step-1"
    bm.save_checkpoint_dir({"w": np.arange(float(N))}, step, step=1, prefix="model")()
    before = _objects(step)

    def disk_on_fire(f, obj, generation):
        raise OSError("injected: the commit write failed")

    monkeypatch.setattr(durable, "write_json_if_generation", disk_on_fire)  # commit_json's conditional write
    with pytest.raises(OSError, match="injected"):
        bm.save_checkpoint_dir({"w": np.zeros(N)}, step, step=1, prefix="params")()
    after = _objects(step)
    assert {k: v for k, v in after.items() if k in before} == before
    assert all(k.startswith("params/arrays.") for k in set(after) - set(before)), sorted(set(after) - set(before))
    assert np.asarray(tree_deserialize_leaves(step, prefix="model")["w"]).tolist() == list(np.arange(float(N)))


def test_gcs_drop_keeps_what_is_not_named(gcs_root):
    """On gs:// the drop removes only what the previous metadata names and each tree's index proves ours: a user file
    in the old tree directory (a save with overwrite=True) and a tree the metadata never named stay."""
    step = gcs_root / "step-1"
    bm.save_checkpoint_dir({"w": np.arange(float(N))}, step, step=1, prefix="model")()
    tree_serialize_leaves(step, {"z": np.ones(N)}, prefix="extra")  # ours, but not part of the committed metadata
    (step / "model" / "notes.txt").write_text("mine")
    bm.save_checkpoint_dir({"w": np.zeros(N)}, step, step=1, prefix="params", overwrite=True)()
    assert [p.name for p in (step / "model").iterdir()] == ["notes.txt"]
    assert (step / "model" / "notes.txt").read_text() == "mine"
    assert np.asarray(tree_deserialize_leaves(step, prefix="extra")["z"]).tolist() == [1.0] * N
    assert np.asarray(tree_deserialize_leaves(step, prefix="params")["w"]).tolist() == [0.0] * N


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_user_file_inside_a_tree_is_never_dropped(where, tmp_path, request):
    """A user's file inside a tree of ours makes a re-save an error naming `tree/file` (locally the swap used to drop it
    with the tree, without a word); with overwrite=True it is kept, through a same-prefix re-save, a prefix switch and a
    switch back; `delete` refuses the step while it is there."""
    root = ePath(tmp_path) / "run" if where == "local" else request.getfixturevalue("gcs_root")
    step = root / "step-1"
    bm.save_checkpoint_dir({"w": np.arange(float(N))}, step, step=1, prefix="model")()
    (step / "model" / "notes.txt").write_text("mine")
    for prefix in ("model", "params"):
        with pytest.raises(FileExistsError, match=r"not part of an eformer_nb checkpoint: \['model/notes.txt'\]"):
            bm.save_checkpoint_dir({"w": np.zeros(N)}, step, step=1, prefix=prefix)()
    for i, prefix in enumerate(["model", "params", "model"]):
        bm.save_checkpoint_dir({"w": np.full(N, float(i))}, step, step=1, prefix=prefix, overwrite=True)()
        assert (step / "model" / "notes.txt").read_text() == "mine"
        assert np.asarray(tree_deserialize_leaves(step, prefix=prefix)["w"]).tolist() == [float(i)] * N
    assert "params" not in [p.name for p in step.iterdir()]
    with pytest.raises(FileExistsError, match="remove it yourself"):
        bm.CheckpointManager(root).delete(1)
    assert (step / "model" / "notes.txt").read_text() == "mine"


def test_gcs_crash_while_dropping_the_old_tree(gcs_root, monkeypatch):
    """A failure after the commit, while the old prefix tree is being removed: the new version is committed and loads;
    what is left of the old tree has no index (removed first), so it never loads as a part of the checkpoint."""
    step = gcs_root / "step-1"
    bm.save_checkpoint_dir({"w": np.arange(float(N))}, step, step=1, prefix="model")()

    def crash(*a):
        raise OSError("injected: died while dropping the old tree")

    monkeypatch.setattr(bm, "drop_arrays", crash)
    with pytest.raises(OSError, match="injected"):
        bm.save_checkpoint_dir({"w": np.zeros(N)}, step, step=1, prefix="params")()
    monkeypatch.undo()
    assert bm.read_metadata(step)["trees"] == ["params"]
    assert np.asarray(bm.CheckpointManager(gcs_root).load(1, prefix="params")["w"]).tolist() == [0.0] * N
    with pytest.raises(bm.TornCheckpointError, match="has no index.json"):
        tree_deserialize_leaves(step, prefix="model")
    assert all(p.name.startswith("arrays.") for p in (step / "model").iterdir())  # the marked arrays are left
    bm.save_checkpoint_dir({"w": np.ones(N)}, step, step=1, prefix="params")()  # they do not block the next save
    assert np.asarray(tree_deserialize_leaves(step, prefix="params")["w"]).tolist() == [1.0] * N
    assert not (step / "model").exists() or not list((step / "model").iterdir())  # and it removed them
    (step / "user" / "arrays.0badc0de" / "notes.txt").write_text("mine")  # looks like ours, has no marker
    bm.save_checkpoint_dir({"w": np.zeros(N)}, step, step=1, prefix="params", overwrite=True)()
    assert (step / "user" / "arrays.0badc0de" / "notes.txt").read_text() == "mine"  # never removed


def test_gcs_prefix_record_update_is_never_lost(gcs_root, monkeypatch):
    """The folder's prefix record (tensorstore_index.json) is a read-merge-replace: on gs:// the replace is conditional,
    so a record update landing in between (a writer whose lock object was deleted) is merged on the next attempt."""
    folder = gcs_root / "state"
    bm.save_prefix_tree({"mu": np.arange(4.0)}, folder, "tx")()
    real, seen = bm.write_json_if_generation, []

    def another_update_first(f, obj, generation):
        if not seen and f.name == "tensorstore_index.json":  # the record's update (the tree's index commits before it)
            seen.append(generation)
            (folder / ".tensorstore_index.json.lock").unlink()  # taken for a dead writer's
            with ThreadPoolExecutor(1) as ex:
                ex.submit(bm._record_prefix, folder, "other", {"step": 9, "time": 0.0, "user": {}}).result()
        return real(f, obj, generation)

    monkeypatch.setattr(bm, "write_json_if_generation", another_update_first)
    bm.save_prefix_tree({"w": np.ones(3)}, folder, "model", step=7)()
    monkeypatch.undo()
    record = bm.read_prefix_index(folder)["prefixes"]
    assert sorted(record) == ["model", "other", "tx"], record
    assert (record["model"]["step"], record["other"]["step"]) == (7, 9)
    assert not (folder / ".tensorstore_index.json.lock").exists()


def _race(gcs_root: ePath, locks: list[ePath], save_a, save_b, monkeypatch) -> BaseException | None:
    """Writer A saves; at A's commit its lock objects are deleted (taken for a dead writer's) and writer B, another
    thread, saves the same thing up to its own commit and waits there; A commits first, then B goes on. B's error."""
    real = durable.write_json_if_generation
    b_at_commit, a_done, box = threading.Event(), threading.Event(), {}

    def run_b():
        try:
            save_b()
        except BaseException as e:  # noqa: BLE001 - handed to the test, which asserts what it is
            box["err"] = e
        finally:
            b_at_commit.set()

    def gate(f, obj, generation):
        if threading.current_thread().name == "writer-b":
            b_at_commit.set()
            assert a_done.wait(120)
        elif "b" not in box:
            for lock in locks:
                assert lock.exists(), lock
                lock.unlink()
            box["b"] = threading.Thread(target=run_b, name="writer-b")
            box["b"].start()
            assert b_at_commit.wait(120)
            assert "err" not in box, box.get("err")  # B got past its start and wrote its arrays
        return real(f, obj, generation)

    monkeypatch.setattr(durable, "write_json_if_generation", gate)  # every commit is durable.commit_json's
    try:
        save_a()
    finally:
        a_done.set()
        if "b" in box:
            box["b"].join(120)
        monkeypatch.setattr(durable, "write_json_if_generation", real)
    return box.get("err")


def test_broken_lock_first_commit_wins_whole(gcs_root, monkeypatch):
    """A live writer's lock objects are deleted; a second writer starts and is past its start when the first one
    commits. The first one's version must be whole: the second one's start used to remove the first one's
    uncommitted arrays (they looked like a crashed save's), leaving a committed index that named missing chunks. Now
    other saves' arrays go only after a commit, the second writer loses at its conditional commit, and the first
    writer's release leaves the second one's lock object alone."""
    step = gcs_root / "step-5"
    bm.save_checkpoint_dir({"w": np.full(N, 1.0)}, step, step=5, prefix="model")()
    err = _race(gcs_root, [gcs_root / ".step-5.lock", step / ".model.lock"],
                bm.save_checkpoint_dir({"w": np.full(N, 2.0)}, step, step=5, prefix="model"),
                bm.save_checkpoint_dir({"w": np.full(N, 3.0)}, step, step=5, prefix="model"), monkeypatch)
    assert isinstance(err, CheckpointLockedError) and "was committed by another writer" in str(err), err
    assert np.asarray(tree_deserialize_leaves(step, prefix="model")["w"]).tolist() == [2.0] * N
    arrays = [p.name for p in (step / "model").iterdir() if p.name.startswith("arrays.")]
    assert len(arrays) == 1, arrays  # the loser's arrays are gone, the old version's too
    assert not [p.name for p in gcs_root.rglob("*.lock")]
    bm.save_checkpoint_dir({"w": np.full(N, 4.0)}, step, step=5, prefix="model")()  # and the next save works
    assert np.asarray(tree_deserialize_leaves(step, prefix="model")["w"]).tolist() == [4.0] * N


def test_bare_gcs_tree_commit_is_conditional(gcs_root, monkeypatch):
    """The same race on a bare gs:// tree (`tree_serialize_leaves`, whose commit is index.json): the second writer's
    index write used to be unconditional. Now it is conditional on the generation read at its start: it loses with a
    clear error, removes only its own arrays, and the first writer's tree loads bit-exactly."""
    d = gcs_root / "tree"
    tree_serialize_leaves(d, {"w": np.full(N, 1.0)})
    err = _race(gcs_root, [gcs_root / ".tree.lock"], lambda: tree_serialize_leaves(d, {"w": np.full(N, 2.0)}),
                lambda: tree_serialize_leaves(d, {"w": np.full(N, 3.0)}), monkeypatch)
    assert isinstance(err, CheckpointLockedError), err
    assert f"tree {str(d)!r} was committed by another writer" in str(err) and "index.json" in str(err), err
    assert np.asarray(tree_deserialize_leaves(d)["w"]).tolist() == [2.0] * N
    assert len([p for p in d.iterdir() if p.name.startswith("arrays.")]) == 1
    assert not (gcs_root / ".tree.lock").exists()


def test_lock_release_leaves_another_writers_lock(gcs_root):
    "A save whose lock object was replaced by another writer's does not delete that one when it finishes."
    from eformer_nb.serialization.durable import _remote_lock

    d = gcs_root / "x"
    with _remote_lock(d, "tree"):
        lock = gcs_root / ".x.lock"
        lock.unlink()
        lock.write_bytes(b"pid 1 on elsewhere (save 00)")  # the other writer's
    assert lock.read_bytes() == b"pid 1 on elsewhere (save 00)"
    lock.unlink()
    with _remote_lock(d, "tree"):
        assert lock.exists()
    assert not lock.exists()  # our own is removed
