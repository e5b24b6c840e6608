""".ci/mutate.py on a throwaway nbdev repo (one notebook, one test): a killed, a survived, a stale and a
baseline-failing mutation are reported as such, and bad mutation files are refused."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[1] / ".ci" / "mutate.py"
BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not (BIN / "nbdev-export").exists(), reason=f"nbdev-export not in {BIN}")]


def _cell(src: str) -> dict:
    return {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": src}


def make_repo(root: Path) -> Path:
    "A minimal nbdev 3 project: nbs/00_core.ipynb exports mini/core.py; tests/test_core.py tests it."
    (root / "nbs").mkdir(parents=True)
    (root / "tests" / "mutations").mkdir(parents=True)
    (root / "pyproject.toml").write_text(textwrap.dedent("""\
        [project]
        name = "mini"
        version = "0.0.1"

        [tool.nbdev]
        lib_path = "mini"
        nbs_path = "nbs"
        tst_flags = "multidevice"
        jupyter_hooks = false
        """))
    nb = {"cells": [_cell("#| default_exp core"),
                    _cell("#| export\ndef add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b"),
                    _cell("assert add(2, 3) == 5"),
                    _cell("def not_exported(a):\n    return a * b  # the same text outside an exported cell")],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    (root / "nbs" / "00_core.ipynb").write_text(json.dumps(nb, indent=1))
    (root / "tests" / "test_core.py").write_text(textwrap.dedent("""\
        from mini.core import add, mul

        def test_mul():
            assert mul(2, 3) == 6

        def test_add():
            assert add(2, 2) == 4

        def test_add_is_broken_on_purpose():
            assert add(1, 1) == 3
        """))
    subprocess.run(["git", "init", "-q", str(root)], check=True, timeout=30)
    subprocess.run([str(BIN / "nbdev-export")], cwd=root, check=True, timeout=60, capture_output=True)
    return root


def write_yaml(path: Path, mutations: list[dict]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(mutations, sort_keys=False))
    return path


def mutate(repo: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(HARNESS), "--repo", str(repo), "--bin", str(BIN), "--flags", "multidevice",
           "--report", str(repo / "_mutate" / "report.md"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=200)


NB = "nbs/00_core.ipynb"


def m(name: str, find: str, replace: str, *run: str) -> dict:
    return {"name": name, "notebook": NB, "find": find, "replace": replace, "run": list(run), "why": f"{name} example"}


def table_row(out: str, name: str) -> list[str]:
    rows = [line.split() for line in out.splitlines() if line.startswith(name + " ")]
    assert len(rows) == 1, out
    return rows[0]


def test_killed_survived_stale(tmp_path):
    repo = make_repo(tmp_path / "mini")
    write_yaml(repo / "tests" / "mutations" / "mini.yaml", [
        m("add-subtracts", "return a + b", "return a - b", NB),  # the notebook's assert kills it
        m("mul-adds", "return a * b", "return a + b", "tests/test_core.py::test_add", "tests/test_core.py::test_mul"),
        m("mul-commutes", "return a * b", "return b * a", "tests/test_core.py::test_mul"),  # equivalent: survives
        m("find-is-gone", "return a ** b", "return 0", NB),  # stale: not in the notebook
        m("find-is-ambiguous", "return a", "return 0", NB),  # stale: twice in the exported cell
    ])
    proc = mutate(repo, "-j", "2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert table_row(out, "add-subtracts")[2] == "KILLED" and table_row(out, "add-subtracts")[-1] == NB
    killer = table_row(out, "mul-adds")
    assert killer[2] == "KILLED" and killer[-1] == "tests/test_core.py::test_mul", out
    assert table_row(out, "mul-commutes")[2] == "SURVIVED", out
    assert table_row(out, "find-is-gone")[2] == "STALE" and "occurs 0 times" in out
    assert table_row(out, "find-is-ambiguous")[2] == "STALE" and "occurs 2 times" in out
    report = (repo / "_mutate" / "report.md").read_text()
    assert "| mul-commutes | tests/mutations/mini.yaml | SURVIVED |" in report, report
    assert "| add-subtracts | tests/mutations/mini.yaml | KILLED | nbs/00_core.ipynb |" in report, report
    assert "5 mutation(s): 2 KILLED, 1 SURVIVED, 2 STALE" in report, report
    # the repository itself is untouched: the mutations ran in scratch copies
    assert "return a + b" in (repo / "mini" / "core.py").read_text()
    assert "return a + b" in (repo / NB).read_text()

    only = mutate(repo, "--only", "mul-adds", "--all-targets")  # both pytest targets in one pytest run, each judged
    assert only.returncode == 0 and "1 mutation(s)" in only.stdout and "add-subtracts" not in only.stdout, only.stdout
    assert "| mul-adds | tests/mutations/mini.yaml | KILLED | tests/test_core.py::test_mul (passed: " \
           "tests/test_core.py::test_add) |" in (repo / "_mutate" / "report.md").read_text()


def test_baseline_failure_is_not_judged(tmp_path):
    repo = make_repo(tmp_path / "mini")
    f = write_yaml(tmp_path / "b.yaml", [
        m("add-negated", "return a + b", "return -(a + b)", "tests/test_core.py::test_add_is_broken_on_purpose")])
    proc = mutate(repo, "--file", str(f))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert table_row(out, "add-negated")[2] == "BASELINE-FAIL", out
    assert "fails unmutated: tests/test_core.py::test_add_is_broken_on_purpose" in out


def test_bad_files_are_refused(tmp_path):
    repo = make_repo(tmp_path / "mini")
    a = write_yaml(tmp_path / "a.yaml", [m("same-name", "return a + b", "return a - b", NB)])
    b = write_yaml(tmp_path / "b.yaml", [m("same-name", "return a * b", "return a + b", NB)])
    proc = mutate(repo, "--file", str(a), "--file", str(b))
    assert proc.returncode == 2 and "duplicate mutation name 'same-name'" in proc.stderr, proc.stderr
    no_why = m("no-why", "return a + b", "return a - b", NB)
    del no_why["why"]
    c = write_yaml(tmp_path / "c.yaml", [no_why])
    proc = mutate(repo, "--file", str(c))
    assert proc.returncode == 2 and "missing keys ['why']" in proc.stderr, proc.stderr
    d = write_yaml(tmp_path / "d.yaml", [m("Bad_Name", "return a + b", "return a - b", NB)])
    assert "not kebab-case" in mutate(repo, "--file", str(d)).stderr
    e = write_yaml(tmp_path / "e.yaml", [m("no-target", "return a + b", "return a - b", "tests/nope.py::test_x")])
    assert "'tests/nope.py' does not exist" in mutate(repo, "--file", str(e)).stderr
    listing = mutate(repo, "--file", str(a), "--list")
    assert listing.returncode == 0 and "same-name" in listing.stdout and "find x1" in listing.stdout, listing.stdout
