"""The local write path of `tree_serialize_leaves` (issue 22): for a local uncompressed tree the chunk files are ours
to write (`_write_local`), and they are byte for byte what TensorStore writes, durable before the commit, and a
failure half-way leaves the previous tree whole.

`LOCAL_FAST_WRITE = False` sends every chunk through TensorStore: each test compares the two."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from eformer_nb.serialization import durable
from eformer_nb.serialization import serialization as ser
from eformer_nb.serialization.serialization import tree_deserialize_leaves, tree_serialize_leaves

pytestmark = pytest.mark.timeout(600)

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.int32, np.uint16, np.uint64, np.bool_,
          np.complex64, np.complex128, ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fn]


def _files(tree_dir) -> dict[str, bytes]:
    "Every file under the tree's arrays directory, by path with the save's token taken out."
    out = {}
    for dirpath, _, names in os.walk(tree_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), tree_dir)
            if rel.startswith("arrays.") and name != ".eformer_nb":
                out["arrays" + rel[len("arrays.01234567"):]] = open(os.path.join(dirpath, name), "rb").read()
    return out


def _ours_and_theirs(tmp_path, monkeypatch, tree) -> tuple[dict, dict, list]:
    "The files a save of `tree` writes through the local writer and through TensorStore; the chunk files ours wrote."
    wrote, real = [], ser._chunk_file
    monkeypatch.setattr(ser, "_chunk_file", lambda path, *a: wrote.append(path) or real(path, *a))
    tree_serialize_leaves(tmp_path / "ours", tree)
    monkeypatch.setattr(ser, "LOCAL_FAST_WRITE", False)
    tree_serialize_leaves(tmp_path / "theirs", tree)
    monkeypatch.setattr(ser, "LOCAL_FAST_WRITE", True)
    return _files(tmp_path / "ours"), _files(tmp_path / "theirs"), wrote


def _tree(dtype, mesh) -> dict:
    rng = np.random.default_rng(0)
    raw = rng.standard_normal((64, 128)) * 100
    x = (raw > 0) if dtype is np.bool_ else raw.astype(dtype)
    return {"np": x, "odd": x[:33], "jax": jnp.asarray(x), "rows": jax.device_put(x, NamedSharding(mesh, P("a"))),
            "grid": jax.device_put(x, NamedSharding(mesh, P("a", "b"))),
            "part": jax.device_put(x, NamedSharding(mesh, P(None, "b"))), "empty": x[:0]}


@pytest.mark.parametrize("max_chunk", [256 << 20, 2048], ids=["chunk-per-shard", "split-chunks"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_same_files_as_tensorstore(tmp_path, monkeypatch, dtype, max_chunk):
    """Sharded (rows, a 4x2 grid, replicated over one axis), replicated, NumPy, an odd row count (split chunks are then
    column blocks, not contiguous), an empty array: the same files, the same bytes; both read paths return the tree."""
    monkeypatch.setattr(ser, "MAX_CHUNK_BYTES", max_chunk)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    tree = _tree(dtype, mesh)
    ours, theirs, wrote = _ours_and_theirs(tmp_path, monkeypatch, tree)
    chunks = sorted(k for k in theirs if not k.endswith("zarr.json"))
    one_per_shard = 1 + 1 + 1 + 4 + 8 + 2 + 0
    assert len(chunks) == one_per_shard if max_chunk > 2048 else len(chunks) > one_per_shard, chunks
    assert len(wrote) == len(chunks)  # every chunk file was the local writer's: the comparison is not vacuous
    assert sorted(ours) == sorted(theirs)
    assert [k for k in theirs if ours[k] != theirs[k]] == []
    for fast in (True, False):
        monkeypatch.setattr(ser, "LOCAL_FAST_READ", fast)
        back = tree_deserialize_leaves(tmp_path / "ours", template=tree)
        for k, v in tree.items():
            np.testing.assert_array_equal(np.asarray(back[k]).view(np.uint8), np.asarray(v).view(np.uint8), err_msg=k)


def test_what_tensorstore_still_writes(tmp_path, monkeypatch):
    "Compressed trees, big-endian NumPy arrays and sub-byte dtypes go through TensorStore; each saves and restores."
    tree = {"be": np.arange(2048, dtype=">f4"), "i4": jnp.asarray(np.arange(4096) % 16 - 8, jnp.int4),
            "f32": np.arange(2048, dtype=np.float32)}
    ours, theirs, wrote = _ours_and_theirs(tmp_path, monkeypatch, tree)
    assert ours == theirs
    assert [os.path.relpath(p, tmp_path / "ours").split(os.sep, 1)[1] for p in wrote] == ["f32/c/0"]
    back = tree_deserialize_leaves(tmp_path / "ours")
    assert back["be"].tolist() == tree["be"].tolist() and back["i4"].tolist() == np.asarray(tree["i4"]).tolist()
    wrote.clear()
    tree_serialize_leaves(tmp_path / "zstd", tree, compression="zstd")
    assert wrote == [] and tree_deserialize_leaves(tmp_path / "zstd")["f32"].tolist() == tree["f32"].tolist()


def test_short_writes(tmp_path, monkeypatch):
    "A `writev` that writes 1000 bytes at a time (a short write each call) still writes every byte once."
    tree = {"w": np.random.default_rng(1).standard_normal((300, 70)).astype(np.float32)}
    real = os.writev
    calls = []

    def short_writev(fd, buffers):
        calls.append(1)
        return real(fd, [memoryview(bytes(b"".join(bytes(b) for b in buffers)[:1000]))])

    monkeypatch.setattr(os, "writev", short_writev)
    tree_serialize_leaves(tmp_path / "ours", tree)
    monkeypatch.setattr(os, "writev", real)
    ours = _files(tmp_path / "ours")
    monkeypatch.setattr(ser, "LOCAL_FAST_WRITE", False)
    tree_serialize_leaves(tmp_path / "theirs", tree)
    assert len(calls) == -(-(300 * 70 * 4 + 4) // 1000) and ours == _files(tmp_path / "theirs")


@pytest.mark.parametrize("where", ["absolute", "relative"])
def test_durable_before_the_commit(tmp_path, monkeypatch, where):
    """Before `index.json` is written, every chunk file was fsync'd after its last write, and so was every directory
    the save created below the tree (the commit's own fsync covers the tree directory); a relative path too."""
    synced, events = set(), []
    real_fsync, real_write_json = os.fsync, durable.write_json_if_generation

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        synced.add(path)
        events.append(("fsync", path))
        return real_fsync(fd)

    def write_json(f, obj, generation):  # the commit: commit_json's write (locally: no generation)
        events.append(("commit", str(f)))
        return real_write_json(f, obj, generation)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(durable, "write_json_if_generation", write_json)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    root = tmp_path / "t"
    monkeypatch.chdir(tmp_path)
    tree_serialize_leaves(root if where == "absolute" else "t",
                          {"w": jax.device_put(np.ones((64, 64), np.float32), NamedSharding(mesh, P("a", "b"))),
                           "v": {"x": np.ones((40, 40))}})
    commit = next(i for i, (kind, p) in enumerate(events) if kind == "commit" and p.endswith("index.json"))
    before = {p for kind, p in events[:commit] if kind == "fsync"}
    arrays = next(p for p in root.iterdir() if p.name.startswith("arrays."))
    chunk_files = {str(p) for p in arrays.rglob("*") if p.is_file() and "/c/" in str(p)}
    assert len(chunk_files) == 9 and chunk_files <= before, chunk_files - before  # w: 8 shards; v/x: 1
    dirs = {str(d) for f in chunk_files for d in Path(f).parents if d != root and root in d.parents}
    assert str(arrays / "v" / "x" / "c" / "0") in dirs and str(arrays) in dirs
    assert dirs <= before, dirs - before


@pytest.mark.parametrize("at", [0, 3, 8])
def test_failure_half_way_keeps_the_previous_tree(tmp_path, monkeypatch, at):
    """The chunk write number `at` fails (disk full): the save raises it, the writes not yet started never start, the
    previous tree restores bit-exactly, and the next save removes what the failed one left."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    root = tmp_path / "t"
    old = {"w": np.arange(64 * 64, dtype=np.float32).reshape(64, 64)}
    tree_serialize_leaves(root, old)
    started, real = [], ser._chunk_file
    monkeypatch.setattr(ser, "_WRITE_THREADS", 1)  # one at a time: "not yet started" is then well defined

    def chunk_file(path, block, chunks):
        started.append(path)
        if len(started) == at + 1:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, block, chunks)

    monkeypatch.setattr(ser, "_chunk_file", chunk_file)
    new = {"w": jax.device_put(-np.ones((64, 64), np.float32), NamedSharding(mesh, P("a", "b"))),
           "v": np.ones((40, 40))}
    with pytest.raises(OSError, match="No space left on device"):
        tree_serialize_leaves(root, new)
    # 9 chunks planned; the one thread may have taken the next before the failure was seen, none after that
    assert at + 1 <= len(started) <= min(at + 2, 9), started
    back = tree_deserialize_leaves(root)
    assert back["w"].tobytes() == old["w"].tobytes() and set(back) == {"w"}
    monkeypatch.setattr(ser, "_chunk_file", real)
    tree_serialize_leaves(root, new)
    assert len([p for p in root.iterdir() if p.name.startswith("arrays.")]) == 1
    np.testing.assert_array_equal(tree_deserialize_leaves(root)["w"], -np.ones((64, 64), np.float32))
