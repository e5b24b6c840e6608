"""Two JAX processes and one checkpoint (issue 47): a process SIGKILLed while a checkpoint is being written leaves the
previous one restorable by both processes of the restarted job; the processes are `tests/hosts_worker.py`, started
as a pair by `serialization_worker.run_pair` (a free loopback port for the coordinator), no Ray."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serialization_worker import run_pair  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def _pair(mode: str, root: str, timeout: float) -> list[tuple[int, str]]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    return run_pair(mode, lambda pid: [root], env, timeout=timeout, script=str(HERE / "hosts_worker.py"))


def test_a_process_killed_mid_write_leaves_the_previous_checkpoint_restorable(tmp_path):
    root = str(tmp_path / "checkpoints")
    (rc0, out0), (rc1, out1) = _pair("save_then_die", root, timeout=120)
    assert rc1 == -9, (rc1, out1[-3000:])  # process 1 SIGKILLed itself once checkpoint 4 had begun
    assert "saved 4" not in out0 + out1, (out0[-2000:], out1[-2000:])
    assert rc0 == 1 and "gave up on 4" in out0, (rc0, out0[-2000:])  # it cannot finish a save its peer died in
    saved = {re.search(r"saved 2 (\w+)", o).group(1) for o in (out0, out1)}
    assert len(saved) == 1, (out0[-2000:], out1[-2000:])
    new = [n for n in os.listdir(root) if n != "step-2"]
    assert new, os.listdir(root)  # the killed write left something behind, which the restore must not take

    outs = _pair("restore", root, timeout=180)
    assert [rc for rc, _ in outs] == [0, 0], [o[-3000:] for _, o in outs]
    restored = [re.search(r"restored (\d+) (\d+) (\w+)", o).groups() for _, o in outs]
    assert restored == [("2", "2", saved.pop())] * 2, restored
