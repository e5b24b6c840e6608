"""The local read path of `tree_deserialize_leaves` (issue 22): it returns the same bits as TensorStore's read, every
damage it meets is the same clear error, and every layout it does not handle still goes through TensorStore.

`LOCAL_FAST_READ = False` sends every leaf through TensorStore: each test compares the two on one saved tree."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eformer_nb.serialization import serialization as ser
from eformer_nb.serialization.serialization import (
    CorruptCheckpointError,
    TornCheckpointError,
    tree_deserialize_leaves,
    tree_serialize_leaves,
)

pytestmark = pytest.mark.timeout(600)


def _bits(tree):
    return jax.tree.map(lambda x: (type(x).__name__, str(x.dtype), np.shape(x), np.asarray(x).tobytes(),
                                   str(getattr(x, "sharding", None))), tree)


def _both(monkeypatch, *args, **kwargs):
    "The restore through the local path, then through TensorStore."
    fast = tree_deserialize_leaves(*args, **kwargs)
    monkeypatch.setattr(ser, "LOCAL_FAST_READ", False)
    try:
        slow = tree_deserialize_leaves(*args, **kwargs)
    finally:
        monkeypatch.setattr(ser, "LOCAL_FAST_READ", True)
    return fast, slow


def _count_local(monkeypatch) -> list[str]:
    seen, real = [], ser._read_local
    monkeypatch.setattr(ser, "_read_local", lambda *a: seen.append(a[1]) or real(*a))
    return seen


DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.int32, np.uint16, np.uint64, np.bool_,
          np.complex64, np.complex128, ml_dtypes.float8_e5m2]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_same_bits_as_tensorstore(tmp_path, monkeypatch, dtype):
    rng = np.random.default_rng(0)
    raw = rng.standard_normal((37, 129)) * 100
    x = (raw > 0) if dtype is np.bool_ else raw.astype(dtype)
    tree = {"np": x, "jax": jnp.asarray(x)}
    tree_serialize_leaves(tmp_path / "t", tree)
    seen = _count_local(monkeypatch)
    fast, slow = _both(monkeypatch, tmp_path / "t")
    assert _bits(fast) == _bits(slow) == _bits(tree)
    assert sorted(seen) == ["jax", "np"]  # both leaves went the local way (the TensorStore pass does not count)


def test_sharded_onto_other_meshes(tmp_path, monkeypatch):
    devs = jax.devices()
    assert len(devs) >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    mesh = jax.make_mesh((2, 4), ("a", "b"), devices=devs[:8])
    x = jnp.asarray(np.random.default_rng(1).standard_normal((64, 96)), jnp.bfloat16)
    tree_serialize_leaves(tmp_path / "t", {"x": jax.device_put(x, NamedSharding(mesh, P("a", "b")))})
    assert len(list((tmp_path / "t").glob("arrays.*/x/c/*/*"))) == 8  # one chunk per shard
    seen = _count_local(monkeypatch)
    for spec in [P("a", "b"), P("b", None), P(None, ("a", "b")), P()]:
        want = NamedSharding(mesh, spec)
        template = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=want)}
        fast, slow = _both(monkeypatch, tmp_path / "t", template=template)
        assert _bits(fast) == _bits(slow)
        assert fast["x"].sharding == want and np.asarray(fast["x"]).tobytes() == np.asarray(x).tobytes()
    assert seen == ["x"] * 4


def test_edge_chunks_and_partial_boxes(tmp_path, monkeypatch):
    "A chunk grid that does not divide the shape (edge chunks padded on disk), read whole and in every 2-row box."
    x = np.arange(45 * 31, dtype=np.float32).reshape(45, 31)
    plan = ser.plan_save({"x": x})
    ser.commit_tree(ser.ePath(tmp_path / "t"), plan._replace(writes=[(k, [7, 10], o) for k, _, o in plan.writes]),
                     None)
    rec = ser.read_index(tmp_path / "t")["leaves"]["x"]
    assert ser._local_layout(ser.ePath(tmp_path / "t"), "x", rec) == [7, 10]
    fast, slow = _both(monkeypatch, tmp_path / "t")
    assert _bits(fast) == _bits(slow) and np.array_equal(fast["x"], x)
    for a in range(0, 45, 4):
        for b in (0, 9, 10, 30):
            box = (slice(a, min(45, a + 5)), slice(b, 31))
            np.testing.assert_array_equal(ser._read_local(ser.ePath(tmp_path / "t"), "x", rec, [7, 10], box), x[box])


def _one_chunk(tmp_path) -> tuple[Path, Path]:
    d = tmp_path / "t"
    tree_serialize_leaves(d, {"w": np.arange(5000, dtype=np.float32)})
    return d, next(d.glob("arrays.*/w/c/0"))


@pytest.mark.parametrize("damage", ["flip-data", "flip-crc", "truncate", "extend", "delete", "empty"])
def test_damage_is_the_same_error_on_both_paths(tmp_path, monkeypatch, damage):
    d, f = _one_chunk(tmp_path)
    blob = bytearray(f.read_bytes())
    if damage == "delete":
        f.unlink()
    else:
        if damage == "flip-data":
            blob[1234] ^= 0x10
        elif damage == "flip-crc":
            blob[-3] ^= 0x01
        blob = {"truncate": blob[:-7], "extend": blob + b"\0", "empty": b""}.get(damage, blob)
        f.write_bytes(bytes(blob))
    errors = []
    for fast in (True, False):
        monkeypatch.setattr(ser, "LOCAL_FAST_READ", fast)
        if damage == "extend" and not fast:  # TensorStore ignores a byte appended after the crc32c: the data is right
            np.testing.assert_array_equal(tree_deserialize_leaves(d)["w"], np.arange(5000, dtype=np.float32))
            continue
        with pytest.raises(CorruptCheckpointError) as e:
            tree_deserialize_leaves(d)
        errors.append(str(e.value))
    for msg in errors:  # each names the leaf and its array; the local one names the chunk file too
        assert msg.startswith(f"leaf 'w': reading {str(f.parent.parent)!r} failed: "), msg
    assert str(f) in errors[0], errors[0]
    if damage.startswith("flip"):
        assert "Digest mismatch" in errors[0] and "Digest mismatch" in errors[1]
    if damage == "delete":
        assert "is missing" in errors[0] and "is missing" in errors[1]


def test_zarr_json_edits(tmp_path, monkeypatch):
    d, f = _one_chunk(tmp_path)
    zj = f.parent.parent / "zarr.json"
    meta = json.loads(zj.read_text())
    zj.write_text(json.dumps(dict(meta, shape=[4000])))  # the index says 5000: cross-checked on both paths
    for fast in (True, False):
        monkeypatch.setattr(ser, "LOCAL_FAST_READ", fast)
        with pytest.raises(CorruptCheckpointError, match=r"\(zarr.json\) holds float32\[4000\]"):
            tree_deserialize_leaves(d)
    monkeypatch.setattr(ser, "LOCAL_FAST_READ", True)
    # without the crc32c codec the local path does not read it; TensorStore then finds 4 bytes too many
    zj.write_text(json.dumps(dict(meta, codecs=meta["codecs"][:1])))
    seen = _count_local(monkeypatch)
    with pytest.raises((CorruptCheckpointError, TornCheckpointError), match="leaf 'w'"):
        tree_deserialize_leaves(d)
    assert seen == []
    zj.unlink()  # no zarr.json: TensorStore's open tells, as before
    with pytest.raises(TornCheckpointError, match="leaf 'w': its array .* cannot be opened"):
        tree_deserialize_leaves(d)


def test_other_layouts_fall_back(tmp_path, monkeypatch):
    tree = {"w": np.arange(5000, dtype=np.float32), "q": jnp.asarray(np.arange(6000) % 16 - 8, jnp.int4)}
    tree_serialize_leaves(tmp_path / "z", tree, compression="zstd")
    tree_serialize_leaves(tmp_path / "raw", tree)
    seen = _count_local(monkeypatch)
    assert _bits(tree_deserialize_leaves(tmp_path / "z")) == _bits(tree)
    assert seen == []  # compressed: TensorStore read both
    assert _bits(tree_deserialize_leaves(tmp_path / "raw")) == _bits(tree)
    assert seen == ["w"]  # int4 (sub-byte) is TensorStore's


def test_many_leaves_read_at_once_report_the_first_damage(tmp_path, monkeypatch):
    tree = {k: np.full(3000, i, np.float32) for i, k in enumerate("abcdefgh")}
    tree_serialize_leaves(tmp_path / "t", tree)
    seen = _count_local(monkeypatch)
    fast, slow = _both(monkeypatch, tmp_path / "t")
    assert _bits(fast) == _bits(slow) == _bits(tree) and sorted(seen) == sorted(tree)
    for k in "fc":
        f = next((tmp_path / "t").glob(f"arrays.*/{k}/c/0"))
        blob = bytearray(f.read_bytes())
        blob[-1] ^= 0xFF  # the stored crc32c
        f.write_bytes(bytes(blob))
    with pytest.raises(CorruptCheckpointError, match="^leaf 'c': reading .* Digest mismatch"):
        tree_deserialize_leaves(tmp_path / "t")
