"""The GPU page runner (.ci/gpu_bench.py, behind `make bench-gpu`): whatever happens to the page, the output folder gets
the executed page (rewritten after every cell), the page's JSON rows and the summary; a raised cell does not stop the
cells after it; a killed run keeps what ran; test flags are honoured as nbdev-test honours them."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / ".ci" / "gpu_bench.py"


def _page(path: Path, cells: list[str]) -> Path:
    nb = {"cells": [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": None, "outputs": [],
                     "source": src} for i, src in enumerate(cells)],
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
          "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))
    return path


SETUP = ("import os\nfrom eformer_nb.benchmarking import RunLog\n"
         "LOG = RunLog(os.environ['EFORMER_GPU_PAGE_JSONL'], budget_s=60, quiet=True)")


def _run(tmp_path, cells, **kw):
    page = _page(tmp_path / "page.ipynb", cells)
    out = tmp_path / "out"
    cmd = [sys.executable, str(RUNNER), "quantization", str(out), "--tiny", "--notebook", str(page)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw), out


def _outputs(nb_path: Path) -> list[str]:
    return ["".join(o.get("text", "")) + str(o.get("ename", "")) for c in json.loads(nb_path.read_text())["cells"]
            for o in c.get("outputs", [])]


@pytest.mark.timeout(120)
def test_a_raised_cell_is_recorded_and_the_page_goes_on(tmp_path):
    proc, out = _run(tmp_path, [
        SETUP,
        "LOG.target('gemv', 'speed-up', 0.5, 2.5)\nprint('first')",
        "raise ValueError('a broken section')",
        "#| gpu\nLOG.record('after', ok=True)\nprint('after the error')",
        "#| tpu\nprint('a tpu cell')",  # a test flag this runner does not run
        "#| eval: false\nprint('never')",
    ])
    log = proc.communicate(timeout=110)[0]
    assert proc.returncode == 1, log  # a cell raised: the exit status says so, after writing everything
    texts = "\n".join(_outputs(out / "gpu_quantization.ipynb"))
    assert "first" in texts and "ValueError" in texts and "after the error" in texts, texts
    assert "a tpu cell" not in texts and "never" not in texts, texts
    rows = [json.loads(line) for line in (out / "gpu_quantization.jsonl").read_text().splitlines()]
    assert [r["section"] for r in rows] == ["gemv", "after"], rows
    summary = (out / "summary.md").read_text()
    assert "| gemv | speed-up | 0.5 | - | >= 2.5 | **missed** |" in summary, summary
    assert "cell 2 raised ValueError: a broken section" in summary, summary


@pytest.mark.timeout(120)
def test_a_killed_run_keeps_the_cells_that_ran(tmp_path):
    marker = tmp_path / "reached"
    proc, out = _run(tmp_path, [
        SETUP,
        "LOG.record('first', value=1)\nprint('measured before the kill')",
        f"open({str(marker)!r}, 'w').close()\nimport time\ntime.sleep(600)",
    ], start_new_session=True)
    deadline = time.time() + 100
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.2)
    assert marker.exists(), proc.communicate(timeout=5)[0] if proc.poll() is not None else "the page never started"
    os.killpg(proc.pid, signal.SIGKILL)  # the host's time limit, as it ends a command
    proc.communicate(timeout=10)
    texts = "\n".join(_outputs(out / "gpu_quantization.ipynb"))
    assert "measured before the kill" in texts, texts  # the page was written after the cell that printed it
    assert json.loads((out / "gpu_quantization.jsonl").read_text().splitlines()[0])["value"] == 1
