#!/usr/bin/env python3
"""Mutation harness: does each named bug in `tests/mutations/*.yaml` make a notebook or test fail?

Each mutation (a YAML list entry) names a notebook, a `find` substring that occurs exactly once in that notebook's
exported cells (`#| export`, `#| exporti`, `#| exports`), its `replace`ment, the `run` targets that must fail (a
notebook path, run with `nbdev-test --flags multidevice[ hf]`, or a pytest node id / file, run with
`python -m pytest -q -x`), and `why` (the promise the bug breaks). For example:

    - name: nf4-handler-always-dequantizes          # unique across all files, kebab-case
      notebook: nbs/06b_ops.quantization.nf4.ipynb
      find: "if _can_fuse(lhs, rhs):"
      replace: "if False:"
      run: [nbs/06b_ops.quantization.nf4.ipynb]
      why: "x @ w under implicit must run the fused NF4 path"

What it does:
1. copies the repository (tracked and untracked-not-ignored files: `git ls-files -co --exclude-standard`) into a
   scratch directory and runs `nbdev-export` there: the *base* tree;
2. baseline: runs every distinct target of the selected mutations once, unmutated, in a copy of the base tree; a
   mutation whose target fails unmutated is not judged (BASELINE-FAIL);
3. for each mutation, in a fresh copy of the base tree: applies find -> replace to the notebook (STALE when `find`
   occurs 0 or more than 1 times in its exported cells), runs `nbdev-export`, checks that an exported module really
   changed (STALE otherwise), then runs the targets in order with PYTHONPATH=<copy> and
   XLA_FLAGS=--xla_force_host_platform_device_count=8. KILLED = a target failed (the first failing one is named);
   SURVIVED = all passed. Targets run in the listed order and the first failure stops the mutation; with
   `--all-targets` every target runs and the detail lists each that failed (and any that passed).

Timeouts: each mutation gets `--timeout` seconds (default 600) for all its targets together. A run that times out
is reported TIMEOUT and is NOT counted as killed (a mutation that only makes things hang or crawl has not been caught
by an assertion, and a loaded machine must not turn survivors into kills); pass `--timeout-kills` to count it as
killed. The whole process group of a timed-out target is killed.

Exit status: 0 when every selected mutation is KILLED; 1 when any is SURVIVED, STALE, TIMEOUT, BASELINE-FAIL or
ERROR (nbdev-export failed on the mutated notebook); 2 for a bad mutation file (duplicate names, missing keys, unknown
notebook). The table is printed and written as markdown to `_mutate/report.md` (`--report`).

Usage: python .ci/mutate.py [--only NAME ...] [--file PATH ...] [-j N] [--list] [--bin DIR] [--flags F]
       [--timeout S] [--timeout-kills] [--all-targets] [--keep] [--repo DIR] [--report PATH]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

KEYS = {"name", "notebook", "find", "replace", "run", "why"}
NAME_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
EXPORT_RE = re.compile(r"^\s*#\s*\|\s*export[is]?\b")
HOST_DEVICES = "--xla_force_host_platform_device_count=8"
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".hypothesis", ".ipynb_checkpoints", "_proc", "_docs", "_mutate"}


class MutationFileError(ValueError):
    "A mutation file that cannot be used as written (exit status 2)."


@dataclasses.dataclass
class Mutation:
    name: str  # unique, kebab-case
    file: str  # the yaml file it came from (relative to the repo)
    notebook: str  # the notebook whose exported cells are mutated (relative to the repo)
    find: str  # occurs exactly once in the notebook's exported cells
    replace: str  # its replacement
    run: list[str]  # targets: notebooks or pytest node ids, in order
    why: str  # the promise the mutation breaks


@dataclasses.dataclass
class Result:
    name: str
    file: str
    status: str  # KILLED, SURVIVED, STALE, TIMEOUT, BASELINE-FAIL, ERROR
    detail: str = ""  # the killing target, or why it was not judged
    seconds: float = 0.0
    log: str = ""  # tail of the killing / failing output


# --- loading -----------------------------------------------------------------------------------------------------

def load_mutations(repo: Path, files: list[Path]) -> list[Mutation]:
    "Read and validate every mutation in `files`; raises MutationFileError naming the file, entry and problem."
    out: list[Mutation] = []
    seen: dict[str, str] = {}
    for f in files:
        rel = os.path.relpath(f, repo)
        try:
            data = yaml.safe_load(Path(f).read_text())
        except yaml.YAMLError as e:
            raise MutationFileError(f"{rel}: not valid YAML: {e}") from e
        if data is None:
            continue
        if not isinstance(data, list):
            raise MutationFileError(f"{rel}: expected a YAML list of mutations, got {type(data).__name__}")
        for i, m in enumerate(data):
            where = f"{rel} entry {i}" + (f" ({m.get('name')!r})" if isinstance(m, dict) and "name" in m else "")
            if not isinstance(m, dict):
                raise MutationFileError(f"{where}: expected a mapping with keys {sorted(KEYS)}, got {m!r}")
            missing, unknown = KEYS - m.keys(), m.keys() - KEYS
            if missing or unknown:
                raise MutationFileError(f"{where}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}; "
                                        f"the keys are {sorted(KEYS)}")
            name = m["name"]
            if not isinstance(name, str) or not NAME_RE.match(name):
                raise MutationFileError(f"{where}: name {name!r} is not kebab-case (lowercase words joined by '-')")
            if name in seen:
                raise MutationFileError(f"{where}: duplicate mutation name {name!r} (also in {seen[name]}); "
                                        "names are unique across all mutation files")
            seen[name] = rel
            for key in ("notebook", "find", "replace", "why"):
                if not isinstance(m[key], str):
                    raise MutationFileError(f"{where}: {key} must be a string, got {m[key]!r}")
            if not m["find"]:
                raise MutationFileError(f"{where}: find is empty")
            if "\n" in m["replace"].rstrip("\n") and "\n" not in m["find"].rstrip("\n"):
                raise MutationFileError(f"{where}: replace is multi-line but find is one line")
            if not (repo / m["notebook"]).is_file() or not m["notebook"].endswith(".ipynb"):
                raise MutationFileError(f"{where}: notebook {m['notebook']!r} is not a notebook in {repo}")
            run = m["run"]
            if isinstance(run, str):
                run = [run]
            if not isinstance(run, list) or not run or not all(isinstance(t, str) and t for t in run):
                raise MutationFileError(f"{where}: run must be a non-empty list of notebook paths / pytest node ids")
            for t in run:
                if not (repo / t.split("::")[0]).exists():
                    raise MutationFileError(f"{where}: run target {t!r}: {t.split('::')[0]!r} does not exist in {repo}")
            out.append(Mutation(name, rel, m["notebook"], m["find"], m["replace"], run, m["why"]))
    return out


def export_cells(nb: dict) -> list[int]:
    "Indices of the code cells that nbdev exports."
    return [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
            and any(EXPORT_RE.match(line) for line in _source(c).splitlines())]


def _source(cell: dict) -> str:
    s = cell["source"]
    return s if isinstance(s, str) else "".join(s)


def count_in_exports(nb: dict, find: str) -> int:
    return sum(_source(nb["cells"][i]).count(find) for i in export_cells(nb))


def apply_mutation(nb_path: Path, find: str, replace: str) -> int:
    """Replace `find` by `replace` in the notebook's exported cells when it occurs there exactly once; returns the
    number of occurrences found (the notebook is written only when that is 1)."""
    nb = json.loads(nb_path.read_text())
    n = count_in_exports(nb, find)
    if n == 1:
        for i in export_cells(nb):
            src = _source(nb["cells"][i])
            if find in src:
                nb["cells"][i]["source"] = src.replace(find, replace, 1).splitlines(keepends=True)
        tmp = nb_path.with_suffix(".ipynb.mutating")
        tmp.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        os.replace(tmp, nb_path)
    return n


# --- scratch trees -------------------------------------------------------------------------------------------------

def repo_files(repo: Path) -> list[str]:
    "Tracked + untracked-not-ignored files (git), or every file outside caches and .git/.venv when not a git repo."
    try:
        out = subprocess.run(["git", "-C", str(repo), "ls-files", "-co", "--exclude-standard", "-z"],
                             capture_output=True, check=True, timeout=60).stdout.decode()
        return [f for f in out.split("\0") if f and (repo / f).is_file()]
    except (subprocess.CalledProcessError, FileNotFoundError):
        files = []
        for root, dirs, names in os.walk(repo):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS | {".git", ".venv"}]
            files += [os.path.relpath(os.path.join(root, n), repo) for n in names]
        return files


def copy_files(src: Path, dst: Path, files: list[str]) -> None:
    for f in files:
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / f, dst / f, follow_symlinks=False)


def copy_tree(src: Path, dst: Path) -> None:
    "Copy a scratch tree without caches (every run starts from the pristine base tree)."
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(*SKIP_DIRS))


def module_digests(tree: Path, lib: str) -> dict[str, str]:
    files = sorted(p for p in (tree / lib).rglob("*.py") if "__pycache__" not in p.parts)
    return {str(p.relative_to(tree)): hashlib.sha1(p.read_bytes()).hexdigest() for p in files}


def lib_path(repo: Path) -> str:
    "The package directory: [tool.nbdev] lib_path in pyproject.toml (nbdev 3), else settings.ini's lib_path."
    import configparser
    import tomllib

    if (repo / "pyproject.toml").is_file():
        nbdev = tomllib.loads((repo / "pyproject.toml").read_text()).get("tool", {}).get("nbdev", {})
        if "lib_path" in nbdev:
            return nbdev["lib_path"]
    cfg = configparser.ConfigParser()
    cfg.read(repo / "settings.ini")
    return cfg.get("DEFAULT", "lib_path", fallback=None) or cfg.get("DEFAULT", "lib_name").replace("-", "_")


# --- running targets -------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Runner:
    bin: Path  # the venv's bin directory (nbdev-export, nbdev-test, python)
    flags: str  # nbdev-test flags

    def env(self, tree: Path) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS", "VIRTUAL_ENV")}
        env.update(PYTHONPATH=str(tree), XLA_FLAGS=HOST_DEVICES, PYTHONDONTWRITEBYTECODE="1",
                   PATH=f"{self.bin}{os.pathsep}{env.get('PATH', '')}")
        return env

    def command(self, group: list[str], stop_first: bool) -> list[str]:
        if group[0].endswith(".ipynb"):
            return [str(self.bin / "nbdev-test"), group[0], "--flags", self.flags, "--n-workers", "0"]
        return [str(self.bin / "python"), "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
                *(["-x"] if stop_first else []), *group]

    def call(self, cmd: list[str], tree: Path, timeout: float) -> tuple[int | None, str]:
        "Run `cmd` in `tree` in its own process group; returns (exit code or None on timeout, output)."
        proc = subprocess.Popen(cmd, cwd=tree, env=self.env(tree), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=max(timeout, 1.0))
            return proc.returncode, out.decode(errors="replace")
        except subprocess.TimeoutExpired:
            _killpg(proc.pid)
            out, _ = proc.communicate()
            return None, out.decode(errors="replace")
        finally:
            _killpg(proc.pid)  # whatever the target left running (ray, emulators) goes with it

    def run_group(self, group: list[str], tree: Path, timeout: float,
                  stop_first: bool) -> tuple[list[str], int | None, str]:
        """Run one notebook, or consecutive pytest targets in one pytest process (one start-up instead of several).
        Returns (the targets that failed, exit code or None on timeout, output)."""
        code, out = self.call(self.command(group, stop_first), tree, timeout)
        if code == 0:
            return [], code, out
        if code == 1 and not group[0].endswith(".ipynb"):  # some tests failed: which targets do they belong to?
            ids = [m.group(2) for m in re.finditer(r"^(FAILED|ERROR) (\S+)", out, re.M)]
            hit = [t for t in group if any(i == t or i.startswith((t + "::", t + "[")) for i in ids)]
            if hit:
                return hit, code, out
        return list(group), code, out  # a timeout, a collection/usage error or a failing notebook: the whole group


def groups(targets: list[str]) -> list[list[str]]:
    "Each notebook alone; consecutive pytest targets together, in order."
    out: list[list[str]] = []
    for t in targets:
        if t.endswith(".ipynb") or not out or out[-1][0].endswith(".ipynb"):
            out.append([t])
        else:
            out[-1].append(t)
    return out


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def tail(text: str, n: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


# --- the harness ---------------------------------------------------------------------------------------------------

def build_base(repo: Path, scratch: Path, runner: Runner) -> Path:
    base = scratch / "base"
    base.mkdir()
    copy_files(repo, base, repo_files(repo))
    code, out = runner.call([str(runner.bin / "nbdev-export")], base, 300)
    if code != 0:
        raise RuntimeError(f"nbdev-export failed on the unmutated copy of {repo}:\n{tail(out)}")
    lib = lib_path(repo)
    code, out = runner.call([str(runner.bin / "python"), "-c", f"import {lib}, sys; sys.stdout.write({lib}.__file__)"],
                            base, 120)
    lines = out.strip().splitlines()
    if code != 0 or not lines or not Path(lines[-1]).resolve().is_relative_to(base.resolve()):
        raise RuntimeError(f"with PYTHONPATH={base}, `import {lib}` does not load the scratch copy: {tail(out, 5)}")
    return base


def run_baseline(base: Path, scratch: Path, runner: Runner, targets: list[str], timeout: float, jobs: int,
                 say) -> dict[str, tuple[bool, float, str]]:
    "Each target once, unmutated (the pytest targets in one pytest run): {target: (passed, seconds, output tail)}."
    def one(i_g):
        i, group = i_g
        tree = scratch / f"baseline-{i}"
        copy_tree(base, tree)
        t0 = time.monotonic()
        failed, code, out = runner.run_group(group, tree, timeout, stop_first=False)
        dt = time.monotonic() - t0
        shutil.rmtree(tree, ignore_errors=True)
        for t in group:
            late = "" if code is not None else " (timed out)"
            say(f"baseline {'FAIL' if t in failed else 'ok  '} {dt:7.1f}s {t}{late}")
        return [(t, (t not in failed, dt, tail(out) if t in failed else "")) for t in group]

    nbs = [[t] for t in targets if t.endswith(".ipynb")]
    tests = [t for t in targets if not t.endswith(".ipynb")]
    with cf.ThreadPoolExecutor(max(jobs, 1)) as ex:
        return dict(pair for pairs in ex.map(one, enumerate(nbs + ([tests] if tests else []))) for pair in pairs)


def run_mutation(m: Mutation, i: int, base: Path, scratch: Path, runner: Runner, lib: str, timeout: float,
                 timeout_kills: bool, keep: bool, all_targets: bool = False) -> Result:
    t0 = time.monotonic()
    tree = scratch / f"m{i:03d}-{m.name}"
    copy_tree(base, tree)
    try:
        before = module_digests(tree, lib)
        n = apply_mutation(tree / m.notebook, m.find, m.replace)
        if n != 1:
            return Result(m.name, m.file, "STALE", f"find occurs {n} times in the exported cells of {m.notebook} "
                          "(must be exactly once)", time.monotonic() - t0)
        code, out = runner.call([str(runner.bin / "nbdev-export")], tree, 300)
        if code != 0:
            return Result(m.name, m.file, "ERROR", "nbdev-export failed on the mutated notebook", time.monotonic() - t0,
                          tail(out))
        after = module_digests(tree, lib)
        changed = sorted(k for k in after if before.get(k) != after[k])
        want = m.replace.strip()
        if not changed or (want and not any(want in (tree / k).read_text() for k in changed)):
            return Result(m.name, m.file, "STALE", f"nbdev-export did not carry the replacement into {lib}/ "
                          f"(changed: {changed or 'nothing'})", time.monotonic() - t0)
        deadline = t0 + timeout
        killers, passed, logs = [], [], []
        for group in groups(m.run):
            failed, code, out = runner.run_group(group, tree, deadline - time.monotonic(), stop_first=not all_targets)
            if code is None:
                status = "KILLED" if timeout_kills or killers else "TIMEOUT"
                killers.append(f"{' '.join(group)} (timed out after {timeout:.0f}s)")
                logs.append(f"=== {' '.join(group)} (timed out) ===\n{tail(out)}")
                return Result(m.name, m.file, status, ", ".join(killers), time.monotonic() - t0, "\n".join(logs))
            killers += failed
            passed += [t for t in group if t not in failed and (all_targets or not failed)]
            if failed:
                logs.append(f"=== {' '.join(group)} (exit {code}) ===\n{tail(out)}")
                if not all_targets:
                    break
        if killers:
            detail = ", ".join(killers) + (f" (passed: {', '.join(passed)})" if passed else "")
            return Result(m.name, m.file, "KILLED", detail, time.monotonic() - t0, "\n".join(logs))
        return Result(m.name, m.file, "SURVIVED", f"{', '.join(m.run)} all passed ({', '.join(changed)} mutated)",
                      time.monotonic() - t0)
    finally:
        if not keep:
            shutil.rmtree(tree, ignore_errors=True)


def markdown(results: list[Result], header: str) -> str:
    lines = [header, "", "| mutation | file | result | killed by / detail | seconds |", "|---|---|---|---|---:|"]
    for r in results:
        detail = r.detail.replace("|", "\\|")
        lines.append(f"| {r.name} | {r.file} | {r.status} | {detail} | {r.seconds:.1f} |")
    for r in results:  # the failing output: what killed each mutation, or why it was not judged
        if r.log:
            lines += ["", f"<details><summary>{r.name}: {r.status} {r.detail}</summary>", "", "```", r.log, "```", "",
                      "</details>"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="The file format and the statuses: the docstring of .ci/mutate.py.")
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1], help="repository root")
    ap.add_argument("--file", action="append", type=Path, default=[],
                    help="a mutation file (repeatable; default: tests/mutations/*.yaml)")
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="run only this mutation (repeatable)")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="mutations run in parallel (default 1)")
    ap.add_argument("--list", action="store_true", help="list the mutations (with their find counts) and exit")
    ap.add_argument("--bin", type=Path, default=None, help="venv bin directory (default: <repo>/.venv/bin)")
    ap.add_argument("--flags", default=None,
                    help="nbdev-test flags (default: 'multidevice', plus 'hf' when torch and transformers import)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mutation, all its targets (default 600)")
    ap.add_argument("--timeout-kills", action="store_true", help="count a timed-out mutation as killed")
    ap.add_argument("--all-targets", action="store_true",
                    help="run every target of a mutation, not only up to the first that kills it (lists them all)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch trees (their path is printed)")
    ap.add_argument("--report", type=Path, default=None, help="markdown report (default: <repo>/_mutate/report.md)")
    args = ap.parse_args(argv)
    repo = args.repo.resolve()
    bin_dir = (args.bin or repo / ".venv" / "bin").resolve()
    files = [f if f.is_absolute() else (Path.cwd() / f) for f in args.file]
    files = files or sorted((repo / "tests" / "mutations").glob("*.yaml"))
    try:
        muts = load_mutations(repo, files)
    except MutationFileError as e:
        print(f"mutate: {e}", file=sys.stderr)
        return 2
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in muts})
        if unknown:
            print(f"mutate: --only {unknown}: no such mutation; known: {sorted(m.name for m in muts)}", file=sys.stderr)
            return 2
        muts = [m for m in muts if m.name in args.only]
    if args.list:
        for m in muts:
            n = count_in_exports(json.loads((repo / m.notebook).read_text()), m.find)
            stale = "" if n == 1 else "  STALE"
            print(f"{m.name:40s} {m.file:28s} {m.notebook}  find x{n}{stale}  run: {' '.join(m.run)}")
        return 0
    if not muts:
        print("mutate: no mutations selected", file=sys.stderr)
        return 2
    for tool in ("nbdev-export", "nbdev-test", "python"):
        if not (bin_dir / tool).exists():
            print(f"mutate: {bin_dir / tool} not found; pass --bin <venv>/bin (make install builds .venv)",
                  file=sys.stderr)
            return 2
    flags = args.flags
    if flags is None:  # as `make nbtest` does: the hf examples run where torch and transformers import
        hf = subprocess.run([str(bin_dir / "python"), "-c", "import torch, transformers"], capture_output=True,
                            timeout=300)
        flags = "multidevice" + (" hf" if hf.returncode == 0 else "")
    runner = Runner(bin_dir, flags)

    def say(msg: str) -> None:
        print(msg, flush=True)

    t_start = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="enb-mutate-"))
    try:
        say(f"mutate: {len(muts)} mutation(s) from {len(files)} file(s); scratch {scratch}; "
            f"nbdev-test flags {runner.flags!r}")
        base = build_base(repo, scratch, runner)
        lib = lib_path(repo)
        targets = list(dict.fromkeys(t for m in muts for t in m.run))
        baseline = run_baseline(base, scratch, runner, targets, args.timeout, args.jobs, say)
        results: dict[str, Result] = {}
        todo = []
        for i, m in enumerate(muts):
            bad = [t for t in m.run if not baseline[t][0]]
            if bad:
                results[m.name] = Result(m.name, m.file, "BASELINE-FAIL", f"fails unmutated: {', '.join(bad)}", 0.0,
                                         baseline[bad[0]][2])
            else:
                todo.append((i, m))

        def one(i_m):
            i, m = i_m
            r = run_mutation(m, i, base, scratch, runner, lib, args.timeout, args.timeout_kills, args.keep,
                             args.all_targets)
            say(f"{r.status:13s} {r.seconds:7.1f}s {r.name}: {r.detail}")
            return r

        with cf.ThreadPoolExecutor(max(args.jobs, 1)) as ex:
            for r in ex.map(one, todo):
                results[r.name] = r
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    ordered = [results[m.name] for m in muts]
    counts = {s: sum(r.status == s for r in ordered) for s in dict.fromkeys(r.status for r in ordered)}
    header = (f"# Mutation report\n\n{len(ordered)} mutation(s): "
              + ", ".join(f"{n} {s}" for s, n in counts.items())
              + f"; {time.monotonic() - t_start:.0f} s wall, -j {args.jobs}, timeout {args.timeout:.0f} s"
              + (" (timeouts count as killed)" if args.timeout_kills else "") + f", load {os.getloadavg()[0]:.2f}.\n\n"
              + "Baseline (unmutated): " + ", ".join(f"{t} {'ok' if ok else 'FAILS'} {dt:.1f}s"
                                                     for t, (ok, dt, _) in baseline.items()))
    width = max(len(r.name) for r in ordered)
    print()
    print(f"{'mutation':{width}s}  {'file':28s}  {'result':13s}  {'seconds':>7s}  killed by / detail")
    for r in ordered:
        print(f"{r.name:{width}s}  {r.file:28s}  {r.status:13s}  {r.seconds:7.1f}  {r.detail}")
    for r in ordered:
        if r.status != "KILLED" and r.log:
            print(f"\n--- {r.name} ({r.status}) ---\n{r.log}")
    report = args.report or repo / "_mutate" / "report.md"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(markdown(ordered, header))
    print(f"\nreport: {report}")
    return 0 if all(r.status == "KILLED" for r in ordered) else 1


if __name__ == "__main__":
    sys.exit(main())
