"""`python -m eformer_nb.demo` when a local Ray cannot start: exit status 1 and one line naming the cause.

The start failure is real, not mocked: TMPDIR is a directory whose path is so long that Ray's session socket
(`<temp dir>/eformer-ray-*/session_*/sockets/plasma_store`) passes the 107-byte AF_UNIX limit, so each of
`auto_ray_cluster`'s three start tries fails within seconds, and the demo turns its `RayStartError` into one line.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_exits_1_with_one_line_when_ray_cannot_start(tmp_path):
    from eformer_nb.executor.cluster_util import ray_processes

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # start a local Ray, never join one
    env.update(TMPDIR=str(deep), PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    argv = ["--model", "tiny", "--steps", "2", "--checkpoint-every", "1", "--crash-at-step", "0"]
    p = subprocess.run([sys.executable, "-m", "eformer_nb.demo", *argv], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 1, (p.returncode, p.stderr[-3000:])
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("eformer_nb.demo: auto_ray_cluster: local Ray did not start (3 tries"), p.stderr[-3000:]
    assert "AF_UNIX path length" in last and f"session logs: {deep}" in last, last  # the cause and where to look
    assert "Traceback" not in p.stderr and p.stdout == "", (p.stdout, p.stderr[-3000:])  # no trace, no report
    tries = sorted(deep.glob("eformer-ray-*"))
    assert len(tries) == 3 and all(ray_processes(str(d)) == [] for d in tries), tries  # every try's processes stopped
