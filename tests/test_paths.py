"""eformer_nb.paths against the real thing: every `any_root` test body runs on a local directory and on gs://
(fake-gcs-server started by the `gcs_emulator` fixture in conftest.py)."""
from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from eformer_nb.paths import (FsspecPath, GCSPath, LocalPath, PathStat, ePath, is_remote_path, load_dict,
                              load_jax_array, make_gcs_filesystem, path_protocol, save_dict, save_jax_array)
from gcs_emulator import GCSEmulator

pytestmark = pytest.mark.timeout(300)


def rel(paths, root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in paths)


def make_tree(root) -> None:
    "root/{a.txt, .hidden, b.npy, ckpt_1/{meta.json, sub/x.txt}, ckpt_10/meta.json, ckpt_2/, empty/}"
    root.mkdir(parents=True)
    (root / "a.txt").write_text("a")
    (root / ".hidden").write_text("h")
    (root / "b.npy").write_bytes(b"\x93NUMPY")
    (root / "ckpt_1" / "sub").mkdir(parents=True)
    (root / "ckpt_1" / "meta.json").write_text("{}")
    (root / "ckpt_1" / "sub" / "x.txt").write_text("x")
    (root / "ckpt_10").mkdir()
    (root / "ckpt_10" / "meta.json").write_text("{}")
    (root / "ckpt_2").mkdir()
    (root / "empty").mkdir()


def test_kinds(any_root, request):
    local = request.node.callspec.params["any_root"] == "local"  # the fixture's own parameter, not the class's answer
    assert isinstance(any_root, ePath)
    assert type(any_root) is (LocalPath if local else GCSPath)
    assert is_remote_path(any_root) is (not local)
    assert path_protocol(any_root) == ("file" if local else "gs")
    assert str(any_root).startswith("/" if local else "gs://")
    assert ePath(str(any_root)) == any_root
    assert hash(ePath(str(any_root))) == hash(any_root)


def test_mkdir_exists(any_root):
    assert not any_root.exists() and not any_root.is_dir() and not any_root.is_file()
    with pytest.raises(FileNotFoundError):
        (any_root / "a" / "b").mkdir()
    assert any_root.mkdir(parents=True) == any_root
    assert any_root.exists() and any_root.is_dir() and not any_root.is_file()
    with pytest.raises(FileExistsError):
        any_root.mkdir()
    any_root.mkdir(exist_ok=True)
    (any_root / "a" / "b").mkdir(parents=True)
    assert (any_root / "a").is_dir() and (any_root / "a" / "b").is_dir()
    assert [p.name for p in any_root.iterdir()] == ["a"]
    (any_root / "f").write_text("x")
    with pytest.raises(FileExistsError):
        (any_root / "f").mkdir(exist_ok=True)
    (any_root / "a" / "b").rmdir()
    assert not (any_root / "a" / "b").exists() and (any_root / "a").is_dir()
    with pytest.raises(OSError):
        any_root.rmdir()  # not empty


def test_text_bytes_open_stat(any_root):
    any_root.mkdir(parents=True)
    f = any_root / "notes.txt"
    assert f.write_text("héllo\nworld") == 11
    assert f.read_text() == "héllo\nworld"
    assert f.read_bytes() == "héllo\nworld".encode()
    assert f.is_file() and not f.is_dir() and f.exists()
    st = f.stat()
    assert isinstance(st, PathStat) and st.st_size == 12 and f.size() == 12
    assert abs(st.st_mtime - time.time()) < 3600  # the time of the write above (a None mtime fails here too)
    with f.open("w") as fh:
        fh.write("line1\nline2\n")
    with f.open("r") as fh:
        assert fh.readlines() == ["line1\n", "line2\n"]
    with (any_root / "blob.bin").open("wb") as fh:
        fh.write(bytes(range(256)) * 1000)
    with (any_root / "blob.bin").open("rb") as fh:
        assert fh.read(3) == b"\x00\x01\x02"
        fh.seek(256 * 999)
        assert len(fh.read()) == 256
    assert (any_root / "blob.bin").size() == 256_000
    with pytest.raises(FileNotFoundError):
        (any_root / "missing.txt").read_text()
    with pytest.raises(FileNotFoundError):
        (any_root / "missing.txt").stat()
    f.unlink()
    assert not f.exists()
    with pytest.raises(FileNotFoundError):
        f.unlink()
    f.unlink(missing_ok=True)
    (any_root / "d").mkdir()
    with pytest.raises(IsADirectoryError):
        (any_root / "d").unlink()
    with pytest.raises(IsADirectoryError):
        (any_root / "d").read_bytes()


def test_iterdir_glob(any_root):
    make_tree(any_root)
    assert [p.name for p in any_root.iterdir()] == [".hidden", "a.txt", "b.npy", "ckpt_1", "ckpt_10", "ckpt_2", "empty"]
    assert all(p.parent == any_root for p in any_root.iterdir())
    assert [p.name for p in (any_root / "empty").iterdir()] == []
    assert rel(any_root.glob("ckpt_*"), any_root) == ["ckpt_1", "ckpt_10", "ckpt_2"]
    assert rel(any_root.glob("ckpt_?"), any_root) == ["ckpt_1", "ckpt_2"]
    assert rel(any_root.glob("ckpt_1"), any_root) == ["ckpt_1"]
    assert rel(any_root.glob("*.txt"), any_root) == ["a.txt"]
    assert rel(any_root.glob("[ab].*"), any_root) == ["a.txt", "b.npy"]
    assert rel(any_root.glob("*/meta.json"), any_root) == ["ckpt_1/meta.json", "ckpt_10/meta.json"]
    assert rel(any_root.glob("**/*.txt"), any_root) == ["a.txt", "ckpt_1/sub/x.txt"]
    assert rel(any_root.rglob("*.txt"), any_root) == ["a.txt", "ckpt_1/sub/x.txt"]
    assert rel(any_root.rglob("meta.json"), any_root) == ["ckpt_1/meta.json", "ckpt_10/meta.json"]
    assert rel(any_root.glob("**"), any_root) == [".", "ckpt_1", "ckpt_1/sub", "ckpt_10", "ckpt_2", "empty"]
    everything = [".hidden", "a.txt", "b.npy", "ckpt_1", "ckpt_1/meta.json", "ckpt_1/sub", "ckpt_1/sub/x.txt",
                  "ckpt_10", "ckpt_10/meta.json", "ckpt_2", "empty"]
    assert rel(any_root.rglob("*"), any_root) == everything
    assert rel((any_root / "nope").glob("*"), any_root) == []
    assert rel((any_root / "ckpt_1").glob("*"), any_root / "ckpt_1") == ["meta.json", "sub"]
    with pytest.raises(ValueError, match="non-empty relative pattern"):
        list(any_root.glob(""))
    with pytest.raises(FileNotFoundError):
        list((any_root / "nope").iterdir())
    with pytest.raises(NotADirectoryError):
        list((any_root / "a.txt").iterdir())


def test_rmtree_is_prefix_safe(any_root):
    make_tree(any_root)
    (any_root / "ckpt_1.tmp").write_text("not a directory of ckpt_1")
    (any_root / "ckpt_1").rmtree()
    assert not (any_root / "ckpt_1").exists()
    assert (any_root / "ckpt_10" / "meta.json").read_text() == "{}"
    assert (any_root / "ckpt_1.tmp").is_file()
    with pytest.raises(FileNotFoundError):
        (any_root / "ckpt_1").rmtree()
    (any_root / "ckpt_1").rmtree(missing_ok=True)
    with pytest.raises(NotADirectoryError):
        (any_root / "a.txt").rmtree()
    (any_root / "empty").rmtree()
    assert not (any_root / "empty").exists()
    any_root.rmtree()
    assert not any_root.exists()
    assert list(any_root.parent.glob(any_root.name + "*")) == []


def test_checkpoint_retention(any_root):
    "What a checkpoint manager does: write step dirs, list them, keep the newest three."
    any_root.mkdir(parents=True)
    for step in (1, 2, 3, 9, 10, 11, 100):
        d = (any_root / f"ckpt_{step}").mkdir()
        save_dict(d / "meta.json", {"step": step})
    steps = sorted(int(p.name.split("_")[1]) for p in any_root.glob("ckpt_*") if p.is_dir())
    assert steps == [1, 2, 3, 9, 10, 11, 100]
    for step in steps[:-3]:
        (any_root / f"ckpt_{step}").rmtree()
    left = sorted((p for p in any_root.iterdir()), key=lambda p: int(p.name.split("_")[1]))
    assert [load_dict(p / "meta.json")["step"] for p in left] == [10, 11, 100]


def test_copy_copytree_same_fs(any_root):
    make_tree(any_root / "src")
    copied = (any_root / "src").copytree(any_root / "dst")
    assert copied == any_root / "dst"
    assert rel(copied.rglob("*"), copied) == rel((any_root / "src").rglob("*"), any_root / "src")
    assert (copied / "ckpt_1" / "sub" / "x.txt").read_text() == "x"
    assert (copied / "empty").is_dir()
    with pytest.raises(FileExistsError):
        (any_root / "src").copytree(any_root / "dst")
    (any_root / "src").copytree(any_root / "dst", dirs_exist_ok=True)
    with pytest.raises(ValueError, match="inside the source"):
        (any_root / "src").copytree(any_root / "src" / "inner")
    out = (any_root / "src" / "a.txt").copy(any_root / "dst" / "ckpt_2")
    assert out == any_root / "dst" / "ckpt_2" / "a.txt" and out.read_text() == "a"
    out = (any_root / "src" / "a.txt").copy(any_root / "new" / "deep" / "a2.txt")
    assert out.read_text() == "a"
    with pytest.raises(FileNotFoundError):
        (any_root / "src" / "zzz").copy(any_root / "x")


def test_copy_across_filesystems(tmp_path, gcs_root):
    local = ePath(tmp_path) / "local"
    make_tree(local)
    up = local.copytree(gcs_root / "up")
    assert isinstance(up, GCSPath)
    assert rel(up.rglob("*"), up) == rel(local.rglob("*"), local)
    down = up.copytree(ePath(tmp_path) / "down")
    assert isinstance(down, LocalPath)
    assert rel(down.rglob("*"), down) == rel(local.rglob("*"), local)
    for f in local.rglob("*"):
        if f.is_file():
            assert (down / str(f.relative_to(local))).read_bytes() == f.read_bytes()
    assert (local / "a.txt").copy(gcs_root / "single.txt").read_text() == "a"
    assert (gcs_root / "single.txt").copy(local / "back.txt").read_text() == "a"


DTYPES = [np.float32, np.int64, np.bool_, np.complex64, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
          ml_dtypes.float8_e5m2, ml_dtypes.int4, ml_dtypes.uint4]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_arrays_roundtrip(any_root, dtype):
    import jax
    import jax.numpy as jnp

    any_root.mkdir(parents=True)
    a = np.asarray(jnp.asarray(np.arange(-6, 6).reshape(3, 4).astype(dtype)))  # int64 is int32 unless jax_enable_x64
    p = save_jax_array(any_root / "a.npy", jnp.asarray(a))
    b = load_jax_array(p)
    assert isinstance(b, jax.Array) and b.dtype == a.dtype and b.shape == a.shape
    assert np.asarray(b).tobytes() == a.tobytes()
    # no pickle anywhere: a plain reader opens it with allow_pickle=False
    import io

    raw = np.load(io.BytesIO(p.read_bytes()), allow_pickle=False)
    assert raw.shape == a.shape


def test_arrays_identical_bytes_local_and_gcs(tmp_path, gcs_root):
    a = (np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7).astype(ml_dtypes.bfloat16)
    local = save_jax_array(ePath(tmp_path) / "a.npy", a)
    remote = (gcs_root / "a.npy").save_jax_array(a)
    assert local.read_bytes() == remote.read_bytes()
    np.testing.assert_array_equal(np.asarray(remote.load_jax_array()).astype(np.float32), a.astype(np.float32))
    with pytest.raises(TypeError, match="without pickle"):
        save_jax_array(gcs_root / "o.npy", np.array([object()], dtype=object))


def test_dicts(any_root):
    any_root.mkdir(parents=True)
    data = {"step": 7, "lr": 3e-4, "names": ["a", "b"], "nested": {"ok": True, "none": None}}
    assert load_dict(save_dict(any_root / "m.json", data)) == data
    assert json.loads((any_root / "m.json").read_text()) == data
    assert (any_root / "m.msgpack").save_dict({**data, "raw": b"\x00\xff"}).load_dict()["raw"] == b"\x00\xff"
    assert load_dict(save_dict(any_root / "m.bin", data, format="msgpack"), format="msgpack") == data
    with pytest.raises(ValueError, match="cannot tell the format"):
        save_dict(any_root / "m.yaml", data)
    (any_root / "list.json").write_text("[1, 2]")
    with pytest.raises(TypeError, match="not a dict"):
        load_dict(any_root / "list.json")


NAMES = ["a", "b.txt", "ab", ".h", "c1"]
SEGMENTS = ["*", "?", "a*", "*.txt", "[ab]*", "b.txt", "**", "a", ".h*", "*1"]


def test_glob_matches_pathlib(tmp_path):
    "Property: on random trees and patterns, local and memory:// glob equal pathlib's answer (pathlib-stable patterns)."
    import shutil
    import uuid

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    paths = st.lists(st.sampled_from(NAMES), min_size=1, max_size=3).map("/".join)
    patterns = st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=3).filter(  # trailing ** changed in 3.13
        lambda segs: segs[-1] != "**" and segs.count("**") <= 1).map("/".join)

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(files=st.lists(paths, min_size=1, max_size=8), empty_dirs=st.lists(paths, max_size=2),
           pats=st.lists(patterns, min_size=1, max_size=4))
    def check(files, empty_dirs, pats):
        tag = uuid.uuid4().hex[:8]
        local, mem = ePath(tmp_path) / tag, ePath(f"memory://glob-prop/{tag}")
        for root in (local, mem):
            root.mkdir(parents=True)
            for f in files:
                target = root / f
                if any(target.is_relative_to(root / d) and target != root / d for d in files):
                    continue  # a path cannot be a file and hold files below it
                target.parent.mkdir(parents=True, exist_ok=True)
                if not target.is_dir():
                    target.write_text("x")
            for d in empty_dirs:
                if not (root / d).exists() and not any((root / d).is_relative_to(root / f) for f in files):
                    (root / d).mkdir(parents=True, exist_ok=True)
        for pat in pats:
            want = sorted({str(Path(p).relative_to(local.path)) for p in local.path.glob(pat)})
            got_local = [str(p.relative_to(local)) for p in local.glob(pat)]
            got_mem = [str(p.relative_to(mem)) for p in mem.glob(pat)]
            assert sorted(got_local) == want, (pat, files, empty_dirs)
            assert got_mem == got_local, (pat, files, empty_dirs)
        shutil.rmtree(local.path)
        mem.rmtree()

    check()


# --- a writer SIGKILLed in the middle of atomic_write_local ---

# Deterministic: before buffer `k` of the second write the child says "ready" and sleeps, so the SIGKILL always lands
# after the writer opened its file and wrote buffers [:k]. An in-place writer has truncated the old file by then.
KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from eformer_nb.paths import atomic_write_local
    path, ready, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
    atomic_write_local(path, [b"old contents\\n"])

    def parts():
        for i in range(8):
            if i == k:
                open(ready, "w").write(str(i))
                time.sleep(600)  # SIGKILLed here
            yield bytes([65 + i]) * 100_000

    atomic_write_local(path, parts())
    sys.exit("the second write was not killed")
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("k", [0, 4])
def test_sigkill_mid_write_leaves_the_old_file_and_one_swept_temporary(tmp_path, k):
    path, ready = tmp_path / "f.bin", tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path), str(ready), str(k)])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() or not ready.read_text():
            assert proc.poll() is None, f"the writer exited ({proc.returncode}) before it was ready"
            assert time.monotonic() < deadline, "the writer was not ready in 30 s"
            time.sleep(0.01)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert path.read_bytes() == b"old contents\n"
    left = [p.name for p in tmp_path.iterdir() if p.name not in ("f.bin", "ready")]
    assert len(left) == 1 and re.fullmatch(rf"\.f\.bin\.[A-Za-z0-9-]+\.{proc.pid}\.\w+\.enb-tmp", left[0]), left
    assert os.path.getsize(tmp_path / left[0]) <= k * 100_000  # the killed writer's partial new content
    save_dict(tmp_path / "next.json", {"ok": True})  # the next save into the directory removes the dead one's temporary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin", "next.json", "ready"]


# --- GCS specifics ---

def test_gcs_bucket_rules(gcs_fs, gcs_emulator):
    bucket = ePath("gs://fresh-bucket-for-test")
    with pytest.raises(FileNotFoundError, match="create it with"):
        (bucket / "dir").mkdir(parents=True)
    assert not bucket.exists()
    bucket.mkdir()
    assert bucket.is_dir() and bucket.exists()
    with pytest.raises(FileExistsError):
        bucket.mkdir()
    (bucket / "d" / "x.txt").write_text("x")  # parents of an object are implied
    assert (bucket / "d").is_dir()
    with pytest.raises(ValueError, match="it is the whole bucket 'fresh-bucket-for-test'.*allow_protected=True"):
        bucket.rmtree()
    assert (bucket / "d" / "x.txt").read_text() == "x"
    (bucket / "d").rmtree()
    assert [p for p in bucket.iterdir()] == []
    (bucket / "e" / "y.txt").write_text("y")
    bucket.rmtree(allow_protected=True)  # the opt-in empties the bucket; the bucket itself stays
    assert bucket.is_dir() and [p for p in bucket.iterdir()] == []
    with pytest.raises(ValueError, match="the bucket name is empty"):
        ePath("gs:///fresh-bucket-for-test/d")
    bucket.rmdir()
    assert not bucket.exists()


def test_gcs_no_stale_listings(gcs_root, gcs_emulator):
    "A second client (another host) writes and deletes; our listings see it at once."
    gcs_root.mkdir(parents=True)
    (gcs_root / "ckpt_1").mkdir()
    assert [p.name for p in gcs_root.iterdir()] == ["ckpt_1"]
    other = make_gcs_filesystem(endpoint_url=gcs_emulator.url)
    other.pipe_file(f"{gcs_root.path}/ckpt_2/meta.json", b"{}")
    assert [p.name for p in gcs_root.iterdir()] == ["ckpt_1", "ckpt_2"]
    assert (gcs_root / "ckpt_2").is_dir() and (gcs_root / "ckpt_2" / "meta.json").exists()
    other.rm(f"{gcs_root.path}/ckpt_2", recursive=True)
    assert [p.name for p in gcs_root.glob("ckpt_*")] == ["ckpt_1"]
    assert not (gcs_root / "ckpt_2").exists()


def test_gcs_own_filesystem_and_pickle(gcs_root, gcs_emulator):
    gcs_root.mkdir(parents=True)
    (gcs_root / "x.txt").write_text("via default fs")
    own = ePath(str(gcs_root / "x.txt"), endpoint_url=gcs_emulator.url)  # storage options -> its own filesystem
    assert own.read_text() == "via default fs" and own.fs is not gcs_root.fs
    clone = pickle.loads(pickle.dumps(own))
    assert clone == own and clone.read_text() == "via default fs"
    assert pickle.loads(pickle.dumps(gcs_root)) == gcs_root


def test_gcs_default_filesystem_from_env(gcs_root, gcs_emulator, monkeypatch):
    "Without set_gcs_filesystem, gs:// paths follow $STORAGE_EMULATOR_HOST (the Google client libraries' convention)."
    from eformer_nb.paths import get_gcs_filesystem, set_gcs_filesystem

    gcs_root.mkdir(parents=True)
    (gcs_root / "env.txt").write_text("found via env")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.url)
    previous = set_gcs_filesystem(None)
    try:
        fresh = ePath(str(gcs_root / "env.txt"))
        assert fresh.read_text() == "found via env"
        assert get_gcs_filesystem() is not previous
    finally:
        set_gcs_filesystem(previous)


def test_other_protocols():
    import importlib.util

    mem = ePath("memory://test-other-protocols/x")
    assert isinstance(mem, FsspecPath) and not isinstance(mem, GCSPath) and is_remote_path(mem)
    (mem / "a.txt").write_text("m")
    assert [p.name for p in mem.iterdir()] == ["a.txt"]
    mem.parent.rmtree()
    if importlib.util.find_spec("s3fs") is None:
        with pytest.raises(ImportError, match="protocol 's3' needs an fsspec backend"):
            ePath("s3://bucket/key")
    with pytest.raises(ValueError, match="unknown protocol 'nope'"):
        ePath("nope://bucket/key")
    web = ePath("https://example.com/data/file.npy")  # construction does no I/O
    assert isinstance(web, FsspecPath) and web.name == "file.npy" and str(web.parent) == "https://example.com/data"
    assert web.parent.parent.parent == web.parent.parent  # the host is the root
    assert not isinstance(ePath("file:///tmp/x"), FsspecPath)


# --- the emulator's own lifecycle ---

def test_emulator_readiness_timeout(tmp_path):
    hang = tmp_path / "hang.sh"
    hang.write_text("#!/bin/sh\nexec sleep 60\n")
    hang.chmod(0o755)
    emu = GCSEmulator(binary=str(hang), startup_timeout=1.0)
    with pytest.raises(RuntimeError, match="did not answer GET .* within 1.0s"):
        emu.start()
    assert emu.process is None  # killed and reaped


def test_emulator_exits_early(tmp_path):
    boom = tmp_path / "boom.sh"
    boom.write_text("#!/bin/sh\necho 'bad flag' >&2\nexit 3\n")
    boom.chmod(0o755)
    with pytest.raises(RuntimeError, match="(?s)exited with code 3 .*bad flag"):
        GCSEmulator(binary=str(boom), startup_timeout=10.0).start()


def test_emulator_retries_a_taken_port(monkeypatch):
    "Another process grabs the port between our pick and the server's bind: the emulator moves to a new one."
    import socket

    import gcs_emulator

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    picks = iter([taken])
    real_free_port = gcs_emulator.free_port
    monkeypatch.setattr(gcs_emulator, "free_port", lambda host="127.0.0.1": next(picks, None) or real_free_port(host))
    try:
        with GCSEmulator() as emu:
            assert emu.port != taken
            assert make_gcs_filesystem(endpoint_url=emu.url).ls("") == []
            pid = emu.pid
        assert emu.process is None and not Path(f"/proc/{pid}").exists()
    finally:
        squatter.close()


def test_emulator_stopped_when_a_test_fails(tmp_path):
    "A failing test in a separate pytest run still leaves no fake-gcs-server behind."
    here = Path(__file__).parent
    for name in ("conftest.py", "gcs_emulator.py"):
        (tmp_path / name).write_text((here / name).read_text())
    pidfile = tmp_path / "pid"
    (tmp_path / "test_fails.py").write_text(textwrap.dedent(f"""
        from eformer_nb.paths import ePath

        def test_fails(gcs_root, gcs_emulator):
            open({str(pidfile)!r}, "w").write(str(gcs_emulator.pid))
            (gcs_root / "x.txt").write_text("x")
            assert (gcs_root / "x.txt").read_text() == "y", "deliberate failure"
        """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1 and "1 failed" in proc.stdout and "deliberate failure" in proc.stdout, \
        proc.stdout[-3000:]
    pid = int(pidfile.read_text())
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower(), \
        f"fake-gcs-server (pid {pid}) outlived the failing test run"


def test_gcs_unlink_missing_ok_survives_a_concurrent_removal(gcs_root, monkeypatch):
    """`unlink(missing_ok=True)` of an object that another process removes between our existence check and our delete
    (two processes of one save cleaning the same replaced files) returns; without `missing_ok` it names the path."""
    f = gcs_root / "gone.bin"
    f.write_bytes(b"x")
    fs = f.fs
    real = fs.rm_file

    def other_process_first(path, *a, **k):
        real(path)  # the other process's delete lands first
        return real(path, *a, **k)

    monkeypatch.setattr(fs, "rm_file", other_process_first)
    f.unlink(missing_ok=True)
    assert not f.exists()
    f.write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="gone.bin"):
        f.unlink()


# --- save_jax_array SIGKILLed with its temporary written in full, before the rename ---

# The child blocks in place of `os.replace` (the rename that would publish the file): the SIGKILL lands when the whole
# new array sits in the temporary, the largest leftover a kill can make. The parent process has saved into the
# directory (and so swept it) before: its next save must still find and remove the dead writer's temporary.
KILLED_SAVE = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from eformer_nb.paths import save_jax_array
    path, ready = sys.argv[1], sys.argv[2]

    def blocked(src, dst):
        open(ready, "w").write(src)
        time.sleep(600)  # SIGKILLed here

    os.replace = blocked
    save_jax_array(path, np.arange(4 << 20, dtype=np.float32))  # 16 MiB
    sys.exit("the save was not killed")
""")


@pytest.mark.timeout(60)
def test_sigkilled_save_jax_array_temporary_is_removed_by_the_next_save(tmp_path):
    path, ready = tmp_path / "w.npy", tmp_path / "ready"
    save_jax_array(path, np.arange(4, dtype=np.float32))  # this process sweeps the directory now, before the kill
    bystander = tmp_path / ".w.npy.someone-else.tmp"  # not our pattern: never touched
    bystander.write_bytes(b"x")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(path), str(ready)])
    try:
        deadline = time.monotonic() + 45
        while not ready.exists() or not ready.read_text():
            assert proc.poll() is None, f"the writer exited ({proc.returncode}) before it was ready"
            assert time.monotonic() < deadline, "the writer was not ready in 45 s"
            time.sleep(0.01)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    tmp = ready.read_text()
    assert os.path.basename(tmp).endswith(".enb-tmp") and os.path.getsize(tmp) > 16 << 20  # the whole new array
    np.testing.assert_array_equal(np.asarray(load_jax_array(path)), np.arange(4, dtype=np.float32))  # old one intact
    save_jax_array(path, np.ones(2, dtype=np.float32))  # the next save removes the dead writer's temporary
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, bystander.name, "ready"])
