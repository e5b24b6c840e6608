"""Faults for eformer_nb.pytree.serialization files: a writer killed with SIGKILL never leaves a
corrupt file under the final name, and a file cut or damaged on disk is rejected with a ValueError."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from eformer_nb.pytree import load_from_file, save_to_file, tree_equal

WRITER = textwrap.dedent("""
    import sys, numpy as np
    from eformer_nb.pytree import save_to_file
    path, ready = sys.argv[1], sys.argv[2]
    i = 0
    while True:  # rewrite the file forever, each time with different content, until killed
        tree = {"w": np.full((1024, 1024, 8), i % 7, np.float32), "step": i}
        save_to_file(tree, path)
        if i == 0:
            open(ready, "w").close()
        i += 1
""")


def _check_whole(path):
    tree = load_from_file(path)
    assert tree["w"].shape == (1024, 1024, 8)
    assert np.all(tree["w"] == tree["step"] % 7), "the file mixes two versions"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0.05, 0.2, 0.5])
def test_sigkill_during_save_leaves_a_whole_file(tmp_path, delay):
    path, ready = tmp_path / "state.msgpack", tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(ready)])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, "the writer died before its first save"
            assert time.monotonic() < deadline, "the writer did not finish a first save in 60 s"
            time.sleep(0.01)
        time.sleep(delay)  # somewhere in the middle of a later save
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    _check_whole(path)  # the last completed save, whole
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".state.msgpack.") and p.name.endswith(".enb-tmp")]
    assert len(leftovers) <= 1  # at most the one temporary the killed save was writing
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ready", "state.msgpack", *leftovers])
    save_to_file({"step": -1}, tmp_path / "other.msgpack")  # the next save into that directory removes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.msgpack", "ready", "state.msgpack"]


def test_damaged_files_are_rejected(tmp_path):
    path = tmp_path / "state.msgpack"
    tree = {"w": np.arange(1000, dtype=np.float32), "name": "x"}
    size = save_to_file(tree, path)
    assert tree_equal(load_from_file(path, tree), tree)
    blob = path.read_bytes()
    assert len(blob) == size
    path.write_bytes(blob[: size // 2])
    with pytest.raises(ValueError, match="truncated input"):
        load_from_file(path, tree)
    damaged = bytearray(blob)
    damaged[-100] ^= 0xFF
    path.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match="data checksum"):
        load_from_file(path, tree)
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="shorter than the 40-byte prefix"):
        load_from_file(path, tree)
