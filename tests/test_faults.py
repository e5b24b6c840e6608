"""Deterministic fault injection for every "never leaves half a file" promise of eformer_nb.paths and
eformer_nb.pytree.save_to_file: the write is made to fail part-way on purpose, and the old file must be byte-identical
afterwards with no temporary left behind.

- EFBIG: a child process sets `RLIMIT_FSIZE` below the new file's size (SIGXFSZ ignored, so write() fails with
  EFBIG instead of killing the process); the call must raise, the old file must be untouched.
- An injected failure in the writer: the buffers being written raise half-way through.

A writer that writes in place (`open(path, "wb")`) truncates the old file first, so each of these fails against it
every time (tests/mutations/faults.yaml runs them against such writers via .ci/mutate.py). The SIGKILL versions are in
tests/test_pytree_files.py and tests/test_paths.py."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from eformer_nb.paths import LocalPath, atomic_write_local, ePath, load_dict, load_jax_array, save_dict, save_jax_array
from eformer_nb.pytree import load_from_file, save_to_file

pytestmark = pytest.mark.timeout(120)

LIMIT = 64 * 1024  # bytes a child may write to one file: above every old file, below every new one

CHILD = textwrap.dedent("""
    import resource, signal, sys
    import numpy as np
    from eformer_nb.paths import LocalPath, atomic_write_local, ePath, save_dict, save_jax_array
    path, kind = sys.argv[1], sys.argv[2]
    big = np.arange(256 * 1024, dtype=np.float32)  # 1 MiB of data, 16x the limit
    if kind == "save_to_file":
        from eformer_nb.pytree import save_to_file  # imports jax: only where needed
    calls = {{
        "atomic_write_local": lambda: atomic_write_local(path, [big.tobytes()[:100_000], big.tobytes()[100_000:]]),
        "save_dict_json": lambda: save_dict(path, {{"values": big[:100_000].tolist()}}),
        "save_dict_msgpack": lambda: save_dict(path, {{"blob": big.tobytes()}}, format="msgpack"),
        "save_jax_array": lambda: save_jax_array(path, big),
        "save_to_file": lambda: save_to_file({{"w": big, "step": 2}}, path),
        "write_bytes": lambda: LocalPath(path).write_bytes(big.tobytes()),
        "write_text": lambda: ePath(path).write_text("y" * 1_000_000),
    }}
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
    try:
        calls[kind]()
    except OSError as e:
        print(f"RAISED {{type(e).__name__}} errno={{e.errno}}: {{e}}")
        sys.exit(3)
    print("NO ERROR")
""").format(limit=LIMIT)


def old_file(kind: str, path) -> bytes:
    "Write the old (small, whole) file with the same API; returns its bytes."
    small = np.arange(16, dtype=np.float32)
    if kind == "atomic_write_local":
        atomic_write_local(path, [b"old contents\n"])
    elif kind.startswith("save_dict"):
        save_dict(path, {"step": 1}, format=kind.removeprefix("save_dict_"))
    elif kind == "save_jax_array":
        save_jax_array(path, small)
    elif kind == "save_to_file":
        save_to_file({"w": small, "step": 1}, path)
    elif kind == "write_bytes":
        LocalPath(path).write_bytes(b"old contents\n")
    elif kind == "write_text":
        ePath(path).write_text("old contents\n")
    blob = path.read_bytes()
    assert 0 < len(blob) < LIMIT
    return blob


def check_old_file_loads(kind: str, path) -> None:
    "The old file is not only byte-identical but still loads as what was saved."
    if kind.startswith("save_dict"):
        assert load_dict(path, format=kind.removeprefix("save_dict_")) == {"step": 1}
    elif kind == "save_jax_array":
        np.testing.assert_array_equal(np.asarray(load_jax_array(path)), np.arange(16, dtype=np.float32))
    elif kind == "save_to_file":
        assert load_from_file(path)["step"] == 1


NOT_ATOMIC = pytest.mark.xfail(strict=True, reason="LocalPath.write_bytes/write_text write in place (ePath.open('wb'));"
                               " only save_dict/save_jax_array/atomic_write_local/save_to_file are atomic (issue 17)")
KINDS = ["atomic_write_local", "save_dict_json", "save_dict_msgpack", "save_jax_array", "save_to_file",
         pytest.param("write_bytes", marks=NOT_ATOMIC), pytest.param("write_text", marks=NOT_ATOMIC)]
SUFFIX = {"save_dict_json": ".json", "save_dict_msgpack": ".msgpack", "save_jax_array": ".npy",
          "save_to_file": ".msgpack"}


@pytest.mark.parametrize("kind", KINDS)
def test_efbig_leaves_old_file(tmp_path, kind):
    "RLIMIT_FSIZE stops the new file at 64 KiB (of 1 MiB): the call raises EFBIG, the old file is untouched."
    path = tmp_path / f"target{SUFFIX.get(kind, '.bin')}"
    before = old_file(kind, path)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), kind], capture_output=True, text=True, timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, f"the write past RLIMIT_FSIZE did not raise OSError (exit {proc.returncode}):\n{out}"
    assert f"errno={errno.EFBIG}" in proc.stdout, out
    assert path.read_bytes() == before, f"{kind}: a failed write changed the old file ({path.stat().st_size} bytes now)"
    check_old_file_loads(kind, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name], "a temporary was left behind"


class Injected(RuntimeError):
    pass


def failing_parts(n_good: int, size: int = 100_000):
    "Buffers that raise after `n_good` of them were handed out: the writer fails half-way through the file."
    for i in range(n_good):
        yield bytes([65 + i]) * size
    raise Injected(f"injected failure after {n_good} parts")


@pytest.mark.parametrize("n_good", [0, 1, 3])
def test_atomic_write_local_failure_in_parts(tmp_path, n_good):
    path = tmp_path / "f.bin"
    atomic_write_local(path, [b"old", b" contents"])
    os.chmod(path, 0o640)
    with pytest.raises(Injected, match=f"after {n_good} parts"):
        atomic_write_local(path, failing_parts(n_good))
    assert path.read_bytes() == b"old contents"
    assert os.stat(path).st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"], "a temporary was left behind"
    assert atomic_write_local(path, [b"new"]) == 3  # the next write works and keeps the mode
    assert path.read_bytes() == b"new" and os.stat(path).st_mode & 0o777 == 0o640


def test_atomic_write_local_through_a_symlink_failure(tmp_path):
    "A failed write through a symlink leaves both the link and its target as they were."
    real = tmp_path / "real.bin"
    atomic_write_local(real, [b"old"])
    (tmp_path / "link.bin").symlink_to(real)
    with pytest.raises(Injected):
        atomic_write_local(tmp_path / "link.bin", failing_parts(2))
    assert (tmp_path / "link.bin").is_symlink() and real.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.bin", "real.bin"]


@pytest.mark.parametrize("n_good", [1, 4])
def test_save_to_file_failure_in_writer(tmp_path, monkeypatch, n_good):
    "save_to_file's buffers raise half-way (the serializer's output is wrapped): the old file still loads."
    import eformer_nb.pytree.serialization as ser

    path = tmp_path / "state.msgpack"
    old = {"w": np.zeros((64, 64), np.float32), "step": 1}
    save_to_file(old, path)
    before = path.read_bytes()
    real = ser._serialize_parts

    def broken(*args, **kwargs):
        parts = real(*args, **kwargs)
        assert len(parts) > n_good, f"only {len(parts)} parts: the failure would not be half-way"
        yield from parts[:n_good]
        raise Injected(f"injected failure after {n_good} of {len(parts)} parts")

    monkeypatch.setattr(ser, "_serialize_parts", broken)
    with pytest.raises(Injected):
        save_to_file({"w": np.ones((256, 256), np.float32), "step": 2}, path)
    assert path.read_bytes() == before
    assert load_from_file(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["state.msgpack"], "a temporary was left behind"
