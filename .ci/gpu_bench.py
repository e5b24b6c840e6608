"""Run one GPU page (nbs/benchmarks/gpu_<page>.ipynb) and leave everything it found in an output folder.

    python .ci/gpu_bench.py PAGE OUT [--tiny] [--budget S] [--site DIR] [--wheels DIR]

`make bench-gpu PAGE=<quantization|train> OUT=<dir> [TINY=1]` calls this. What it writes to OUT, whatever happens:
  gpu_<page>.ipynb   the executed notebook, rewritten after every cell (a run killed half-way keeps what ran)
  gpu_<page>.jsonl   one JSON row per measurement, flushed as measured (the page writes it)
  summary.md         one screen: every row with a target (measured, goal, met or not), failed sections, cell errors
Exit status: 0 when every cell ran; 1 when a cell raised (the files above are written first).

Why not `nbdev-test --save`: nbdev saves a notebook only when every cell passes, and the GPU host has no network and
no nbdev. This uses execnb's `CaptureShell` (what nbdev-test runs cells with), with `exc_stop=False`, and needs only
execnb, IPython and fastcore beside the host's own JAX/torch. `--wheels DIR` (the `make gpu-wheels` folder) unpacks
those wheels into `--site DIR` once and puts that folder at the END of sys.path: the host's own packages always win,
nothing is installed over them. Cells run when they carry no test flag, or only the flags gpu, bench, hf (nbdev's
rules: `#| eval: false` cells never run; tpu, slow, multidevice, notest cells are skipped here).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("quantization", "train")
RUN_FLAGS = {"gpu", "bench", "hf"}
# JAX's share of GPU memory when torch runs beside it in the same process (the train page times transformers)
MEM_FRACTION = {"train": "0.5", "quantization": "0.75"}


def unpack_wheels(wheels: Path, site: Path) -> int:
    "Unpack every wheel of `wheels` into `site` (a wheel is a zip laid out for site-packages); returns how many."
    site.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise SystemExit(f"--wheels {wheels}: no .whl files there (run `make gpu-wheels` on a machine with a network)")
    for w in found:
        with zipfile.ZipFile(w) as z:
            z.extractall(site)
    return len(found)


def test_flags() -> set[str]:
    "nbdev's test flags, from pyproject.toml's [tool.nbdev] tst_flags."
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(cfg["tool"]["nbdev"]["tst_flags"].split())


def directives(source: str) -> dict[str, str]:
    "The `#| name value` lines at the top of a cell."
    out = {}
    for line in source.splitlines():
        s = line.strip()
        if not s:
            continue
        if not s.startswith("#|"):
            break
        name, _, value = s[2:].strip().partition(" ")
        out[name.rstrip(":")] = value.strip()
    return out


def skip_cell(cell, skip: set[str]) -> bool:
    if cell.cell_type != "code":
        return True
    d = directives(cell.source)
    if d.get("eval", "").lower() == "false":
        return True
    return bool(skip & d.keys())


def summary(page: str, jsonl: Path, nb, wall_s: float, tiny: bool) -> tuple[str, int]:
    "The one-screen summary (`run_summary` of the page's rows, then every cell that raised) and the cells that raised."
    from eformer_nb.benchmarking import run_summary

    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()] if jsonl.exists() else []
    device = next((str(r["device"]) for r in rows if r.get("device")), "?")
    errs = [(i, o) for i, c in enumerate(nb.cells) for o in (c.get("outputs") or []) if o.get("output_type") == "error"]
    lines = [f"# gpu_{page}{' (tiny: the path only, numbers mean nothing)' if tiny else ''}", "",
             f"{len(rows)} rows in {wall_s:.0f} s on {device}", "", run_summary(rows), ""]
    lines += [f"- cell {i} raised {o.get('ename')}: {str(o.get('evalue'))[:300]}" for i, o in errs]
    return "\n".join(lines) + "\n", len(errs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("page", choices=PAGES)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, a CPU allowed: checks the path, measures nothing")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the page's sections (default: the page's)")
    ap.add_argument("--site", type=Path, default=None, help="folder appended to sys.path (wheels unpacked there)")
    ap.add_argument("--wheels", type=Path, default=None, help="wheels to unpack into --site first (make gpu-wheels)")
    ap.add_argument("--notebook", type=Path, default=None, help="run this notebook instead of the page's (tests)")
    a = ap.parse_args(argv)
    a.out = a.out.resolve()  # the page runs in its own folder: every path is made absolute first
    a.site = a.site.resolve() if a.site is not None else None
    a.wheels = a.wheels.resolve() if a.wheels is not None else None
    if a.wheels is not None and a.site is None:
        ap.error("--wheels needs --site (the folder they are unpacked into)")
    if a.wheels is not None and a.wheels.is_dir():
        print(f"unpacked {unpack_wheels(a.wheels, a.site)} wheels into {a.site} (searched after the host's packages)")
    elif a.wheels is not None:
        print(f"--wheels {a.wheels} is not a folder: using the packages this Python already has")
    if a.site is not None:
        sys.path.append(str(a.site))
    sys.path.insert(0, str(ROOT))
    a.out.mkdir(parents=True, exist_ok=True)
    src = a.notebook.resolve() if a.notebook else ROOT / "nbs" / "benchmarks" / f"gpu_{a.page}.ipynb"
    dest, jsonl = a.out / f"gpu_{a.page}.ipynb", a.out / f"gpu_{a.page}.jsonl"
    os.environ["EFORMER_GPU_PAGE_TINY"] = "1" if a.tiny else "0"
    os.environ["EFORMER_GPU_PAGE_JSONL"] = str(jsonl.resolve())
    if a.budget is not None:
        os.environ["EFORMER_GPU_PAGE_BUDGET_S"] = str(a.budget)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION[a.page])
    jsonl.write_text("")

    from fastcore.nbio import read_nb, write_nb
    from execnb.shell import CaptureShell

    nb = read_nb(src)
    skip = test_flags() - RUN_FLAGS
    shell = CaptureShell(src)
    shell.set_path(src.parent.resolve())
    t0 = time.perf_counter()

    def after(cell):
        write_nb(nb, dest)  # after every cell: a run cut short keeps what ran
        took = cell.metadata.get("execution", {}).get("total", 0)
        failed = any(o.get("output_type") == "error" for o in (cell.get("outputs") or []))
        print(f"cell {cell.idx_}: {took:.1f} s{' RAISED' if failed else ''}", flush=True)

    cwd = os.getcwd()
    os.chdir(src.parent)
    try:
        shell.run_all(nb, exc_stop=False, preproc=lambda c: skip_cell(c, skip), postproc=after)
    finally:
        os.chdir(cwd)
        write_nb(nb, dest)
        text, raised = summary(a.page, jsonl, nb, time.perf_counter() - t0, a.tiny)
        (a.out / "summary.md").write_text(text)
        print(text)
    return 1 if raised else 0


if __name__ == "__main__":
    sys.exit(main())
