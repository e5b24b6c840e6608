"""Real, current outputs on every page, without committing outputs: the notebooks are executed for the docs the way
`nbdev-test` executes them, and each run is cached under a key made of the notebook's bytes, the package's source
and the flags; a page never shows results from other code.

    python .ci/docs_outputs.py nbtest [NBDEV-TEST ARGS]  `make nbtest`: nbdev-test itself, each passing run kept
    python .ci/docs_outputs.py execute [GLOB ...]   run the notebooks whose cached run is missing or stale
    python .ci/docs_outputs.py run SRC DST          run one notebook (a fresh process each, as nbdev-test's workers)
    python .ci/docs_outputs.py silent [GLOB ...]    from the cached runs: which pages show their reader no output

`make nbtest` runs every notebook anyway: through `nbtest` it is nbdev-test unchanged (same arguments, workers,
flags, failures), except that each notebook's successful run is also written to the cache, under the key of the
flags it ran with, so `make docs` after `make nbtest` shows every page's current outputs without running anything.

`CachedOutputs` is an nbdev doc processor (`doc_procs` in pyproject's `[tool.nbdev]`, with `.ci` on `PYTHONPATH`):
nbdev's own processing pipeline -- `proc_nbs`, so `nbdev-docs` / Quarto and `.ci/docs.py site` alike -- puts the
cached outputs back into each code cell by cell id, trimmed: warnings dropped, a long text output cut to its
first lines. A notebook with no current cached run keeps what it has (the benchmarks keep their saved runs).
"""
import hashlib, json, os, re, subprocess, sys, time
from pathlib import Path

import docs_links  # noqa: F401  (nbdev's docs pipeline imports this module in every build: the same links)

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".docs-cache"
# `make nbtest` runs the multidevice cells on 8 host devices, and the `hf` cells where torch and transformers import;
# the other flagged cells (slow, gpu, tpu, bench, notest) are skipped, so a page shows their code only. A run is kept
# under the flags it ran with; the docs take the run with the most flags that is current.
FLAG_SETS = (["hf", "multidevice"], ["multidevice"])
FORCE_FLAGS = FLAG_SETS[-1]
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
DEFAULT = ["nbs/*.ipynb", "nbs/tutorials/*.ipynb"]  # the benchmarks keep their saved runs (`make bench`)
MAX_LINES = 40


def _sources() -> list:
    "every package source file as `(path relative to the root, bytes)`, in a fixed order"
    return [(str(p.relative_to(ROOT)).encode(), p.read_bytes()) for p in sorted((ROOT / "eformer_nb").rglob("*.py"))]


def key(nb: Path, flags=None, sources=None) -> str:
    "sha256 of the notebook, every package source file (`sources`: `_sources()`, read once) and the flags"
    h, nb = hashlib.sha256(), Path(nb).resolve()
    for rel, data in [(str(nb.relative_to(ROOT)).encode(), nb.read_bytes()), *(sources or _sources())]:
        h.update(rel); h.update(data)
    h.update(json.dumps([sorted(FORCE_FLAGS if flags is None else flags), ENV]).encode())
    return h.hexdigest()


def cached(nb: Path, flags=None) -> Path:
    "the cached run of `nb` with `flags`; without flags, the current run with the most flags (else `FORCE_FLAGS`')"
    if flags is not None: return CACHE / f"{key(nb, flags)}.ipynb"
    paths = [CACHE / f"{key(nb, f)}.ipynb" for f in FLAG_SETS]
    return next((p for p in paths if p.exists()), paths[-1])


def documented(nb: Path) -> bool:
    "is `nb` one of the notebooks whose pages show a cached run (not a benchmark: those keep their saved runs)?"
    nb = Path(nb).resolve()
    return any(nb in {p.resolve() for p in ROOT.glob(g)} for g in DEFAULT)


def _test_nb_kept(fn, *args, force_flags=None, save=False, **kwargs):
    """nbdev's `test_nb` (in its worker), whose save-on-success writes the run to the cache instead of the notebook;
    a documented page whose passing run shows the reader no output (`silent`) fails, unless `SILENT` names it"""
    import nbdev.test as nt
    fn = Path(fn)
    keep = documented(fn) and os.environ.get("XLA_FLAGS") == ENV["XLA_FLAGS"]
    dst = cached(fn, force_flags or []) if keep else None  # keyed before the run, on the bytes that ran
    ran = []

    def write_nb(nb, path):
        ran.append(nb)
        if keep:
            tmp = dst.with_suffix(f".{os.getpid()}.tmp")
            nt._write_nb_orig(nb, tmp)
            tmp.replace(dst)
        elif save: nt._write_nb_orig(nb, path)
    if keep: CACHE.mkdir(exist_ok=True)
    nt.write_nb = write_nb  # a worker runs many notebooks: set for each
    ok, took = nt._test_nb_orig(fn, *args, force_flags=force_flags, save=True, **kwargs)
    if ok and ran and documented(fn) and silent(ran[0]) and _rel(fn) not in SILENT:
        sys.__stderr__.write(f"{_rel(fn)}: the page shows its reader no output: end an example with the value it "
                             f"checks, or print it (a page that truly has nothing to show goes in SILENT, with why)\n")
        return False, took
    return ok, took


# Pages with examples whose run may show no output, each with why. A page outside this list whose examples (code
# cells on the page other than show_doc) show its reader no result fails `make nbtest`: the example is the test, and
# its value is on the page.
SILENT: dict = {}  # none today: every page with examples shows a result
# The chapters issue 38 rewrites (what -> use -> how) while they are being rewritten: `make nbtest` checks a page
# again once it leaves this list. Empty since every rewritten page was run and shows results (issue 38, helper F).
SILENT_PENDING: dict = {}
SILENT.update(SILENT_PENDING)


def _rel(nb) -> str:
    "`nb`'s path relative to the root, as `SILENT` names it"
    nb = Path(nb).resolve()
    return str(nb.relative_to(ROOT)) if nb.is_relative_to(ROOT) else str(nb)


_re_unseen = re.compile(r"^\s*#\|\s*(?:hide\b|exporti?\b|include:\s*false\b|output:\s*false\b)", re.M)
_re_show_doc = re.compile(r"^\s*show_doc\(", re.M)


def example(cell) -> bool:
    """is `cell` code a reader sees on the page as an example: not dropped from the page (`#| hide`, `#| export`,
    `include: false`, `output: false`) and not a `show_doc` (an entry, not a result)?"""
    if cell.get("cell_type") != "code": return False
    src = "".join(cell.get("source", ""))
    return not (_re_unseen.search(src) or _re_show_doc.search(src))


def shown(cell) -> list:
    "the outputs a reader sees under example `cell` on its page, trimmed (none for a cell that is no `example`)"
    if not example(cell): return []
    return [o for o in trim(cell.get("outputs", [])) if o.get("output_type") != "error"]


def silent(nb) -> bool:
    "does the run `nb` (a notebook dict) show examples on its page and none of them an output?"
    cells = nb["cells"] if isinstance(nb, dict) else nb.cells
    return any(example(c) for c in cells) and not any(shown(c) for c in cells)


def report(globs=None) -> int:
    """for each documented notebook with a current cached run: how many of its cells show output; lists the silent
    pages (`SILENT`'s own marked) and the notebooks with no current run. Returns the number of silent pages that
    `SILENT` does not name"""
    nbs = sorted({p for g in (globs or DEFAULT) for p in ROOT.glob(g) if p.is_file()})
    quiet, missing = [], []
    for nb in nbs:
        run = cached(nb)
        if not run.exists(): missing.append(_rel(nb)); continue
        run = json.loads(run.read_text(encoding="utf-8"))
        n = sum(1 for c in run["cells"] if shown(c))
        if silent(run): quiet.append(_rel(nb))
        why = f"  (SILENT: {SILENT[_rel(nb)]})" if _rel(nb) in SILENT else ""
        print(f"{n:4d} cells show output  {_rel(nb)}{why}")
    print(f"silent pages: {len(quiet)} of {len(nbs) - len(missing)} run"
          f" ({len([q for q in quiet if q not in SILENT])} outside SILENT); no current run: {len(missing)}")
    for q in quiet: print(f"  silent: {q}{'' if q not in SILENT else '  (allowed)'}")
    for m in missing: print(f"  no current run: {m}")
    return len([q for q in quiet if q not in SILENT])


# The notebooks that take longest in `make nbtest` (seconds on the 2-core CI machine, from its `--timing` list): they
# start first. nbdev-test hands notebooks to its workers in name order, so a slow one late in the order (14d) kept one
# worker busy while the other sat idle; longest first, the two workers finish close together. A notebook missing here
# only starts in name order after these.
SLOW_FIRST = {
    # `make test`'s nbtest on a fresh clone at 2c5352d (2 workers, every notebook of 20 s or more); 12i (no longer
    # first: its page passes in a worker that imported eformer_nb.modules.qwen3 before) from c4b90d7's fresh run
    "12i_modules.qwen3.ipynb": 63,
    "14d_executor.ray.executor.ipynb": 162, "11f_infra.mixins.gguf.ipynb": 139, "12l_modules.qwen3_moe.ipynb": 135,
    "12b_modules.llama.modeling.ipynb": 118, "09h_ops.attention.ipynb": 108, "08e_optimizers.factory.ipynb": 79,
    "06b_ops.quantization.nf4.ipynb": 77, "90_demo.ipynb": 74, "06k_ops.quantization.kernels.ipynb": 63,
    "14b_executor.ray.resource_manager.ipynb": 61, "14f_executor.cluster_util.ipynb": 53,
    "11g_infra.mixins.generation.ipynb": 52, "07_real_model.ipynb": 51, "91a_serve.engine.ipynb": 50,
    "11m_infra.moe.ipynb": 49, "12k_modules.gemma2.ipynb": 46, "14c_executor.ray.pool_manager.ipynb": 45,
    "08d_optimizers.kron.ipynb": 44, "06d_ops.quantization.binary_ternary.ipynb": 43, "05_ray_cluster.ipynb": 42,
    "02_qlora_finetuning.ipynb": 41, "11j_infra.base_state.ipynb": 38, "11h_infra.mixins.adapters.ipynb": 31,
    "12j_modules.mistral.ipynb": 30, "13_plan.ipynb": 28, "06l_ops.quantization.ipynb": 25,
    "06c_ops.quantization.int8.ipynb": 25, "12m_modules.mixtral.ipynb": 25, "99b_benchmarking.ipynb": 22,
    "14a_executor.ray.types.ipynb": 21,
}


def _parallel_longest_first(f, items, *args, n_workers=0, **kwargs):
    """nbdev-test's `parallel`, the notebooks started by `SLOW_FIRST`'s time, longest first (the rest in the order
    given), each in its own process forked from this one; the results come back in the order of `items`, as nbdev
    expects. `n_workers=0` runs them here, one after the other."""
    order = sorted(range(len(items)), key=lambda i: -SLOW_FIRST.get(Path(items[i]).name, 0))
    out = [None] * len(items)
    kwargs = {k: v for k, v in kwargs.items() if k not in _POOL_ARGS}  # fastcore's pool options: nothing to do here
    if not n_workers:
        for i in order: out[i] = f(items[i], *args, **kwargs)
        return out
    queue, running = list(order), {}  # pid -> (index, read end of the pipe its result comes back on)
    while queue or running:
        while queue and len(running) < n_workers:
            i = queue.pop(0)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the notebook's own process: its memory goes back when it ends
                os.close(r)
                try: res = f(items[i], *args, **kwargs)
                except BaseException as e:
                    sys.__stderr__.write(f"{items[i]}: {type(e).__name__}: {e}\n")
                    res = (False, 0.0)
                with os.fdopen(w, "wb") as pipe: pipe.write(json.dumps(list(res)).encode())
                sys.stdout.flush(); sys.stderr.flush()
                os._exit(0)  # no atexit: IPython's would collect every shell's namespace first
            os.close(w)
            running[pid] = (i, r)
        pid, status = os.wait()
        if pid not in running: continue  # a grandchild a notebook left behind
        i, r = running.pop(pid)
        with os.fdopen(r, "rb") as pipe: data = pipe.read()
        if not data:  # killed (the OOM killer, an LLVM abort): this notebook fails, the others run on
            sys.__stderr__.write(f"{items[i]}: its process ended without a result ({_exit_reason(status)})\n")
        out[i] = tuple(json.loads(data)) if data else (False, 0.0)
    return out


_POOL_ARGS = ("pause", "method", "threadpool", "timeout", "chunksize", "progress", "total", "max_tasks_per_child")


def _exit_reason(status: int) -> str:
    "`os.wait`'s status in words"
    if os.WIFSIGNALED(status): return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit status {os.WEXITSTATUS(status)}"


def preload():
    """import in nbtest's parent what nearly every notebook imports, so each notebook's forked process starts with it
    (importing them starts no JAX backend: tests/test_imports.py checks it)"""
    import flax.nnx, jax, jax.numpy, numpy, optax  # noqa: F401, E401
    import eformer_nb.modules.llama  # noqa: F401


def patch_nbdev_test():
    """make nbdev-test keep each documented notebook's passing run in the cache, run each notebook in a process of
    its own forked from here (a worker that ran many kept them all in memory: two reached 21 GB of this machine's 23,
    and one died in LLVM's allocator), and start the slowest notebooks first"""
    import nbdev.test as nt
    if getattr(nt, "_test_nb_orig", None) is None:
        nt._test_nb_orig, nt._write_nb_orig = nt.test_nb, nt.write_nb
        nt.test_nb = _test_nb_kept
        nt.parallel = _parallel_longest_first


def run(src: Path, dst: Path) -> int:
    "execute `src` as nbdev-test does (its skip/force flags, its working directory); outputs to `dst` on success"
    from execnb.shell import CaptureShell
    from fastcore.nbio import write_nb
    from nbdev.config import get_config
    from nbdev.process import NBProcessor
    from nbdev.test import _skip_cell
    from fastcore.xtras import working_directory
    cfg = get_config()
    flags = cfg.tst_flags.split() if isinstance(cfg.tst_flags, str) else list(cfg.tst_flags)
    nb = NBProcessor(src, rm_directives=False, process=True).nb
    os.environ["IN_TEST"] = "1"
    shell = CaptureShell(src)
    with working_directory(src.parent):
        shell.run_all(nb, exc_stop=True, preproc=_skip_cell(nb, flags, FORCE_FLAGS), cell_timeout=cfg.cell_timeout)
    if shell.exc: return 1
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".tmp")
    write_nb(nb, tmp)
    tmp.replace(dst)
    return 0


def execute(globs=None) -> int:
    "run every notebook matching `globs` whose cached run is missing; returns the number that failed"
    nbs = sorted({p for g in (globs or DEFAULT) for p in ROOT.glob(g) if p.is_file()})
    todo = [nb for nb in nbs if not cached(nb).exists()]
    print(f"docs outputs: {len(nbs) - len(todo)} of {len(nbs)} notebooks cached, running {len(todo)}")
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    failed = 0
    for nb in todo:
        t0 = time.time()
        r = subprocess.run([sys.executable, __file__, "run", str(nb), str(cached(nb))], cwd=ROOT, env=env,
                           capture_output=True, text=True)
        ok = r.returncode == 0 and cached(nb).exists()
        print(f"  {nb.relative_to(ROOT)}: {'ok' if ok else 'FAILED'} in {time.time() - t0:.0f}s")
        if not ok:
            failed += 1
            print(f"{r.stdout[-1500:]}\n{r.stderr[-3000:]}")
    prune_and_report()
    return failed


_re_entry = re.compile(r"^[0-9a-f]{64}\.ipynb$")  # a kept run: `<key>.ipynb`
_re_temp = re.compile(r"^[0-9a-f]{64}(?:\.[0-9]+)?\.tmp$")  # a run being written (`run`, `_test_nb_kept`)


def prune(temp_age_s: float = 3600.0) -> list:
    """remove the kept runs no page can show any more (their notebook is gone or changed, the package changed, or
    flags the docs never read) and temporaries older than `temp_age_s`; only plain files inside `CACHE` named as
    this script names them. Returns the names removed."""
    if not CACHE.is_dir() or CACHE.is_symlink(): return []
    sources = _sources()
    nbs = {p for g in DEFAULT for p in ROOT.glob(g) if p.is_file()}
    current = {f"{key(nb, f, sources)}.ipynb" for nb in nbs for f in FLAG_SETS}
    removed, now = [], time.time()
    for p in sorted(CACHE.iterdir()):
        if p.is_symlink() or not p.is_file(): continue
        if (_re_entry.match(p.name) and p.name not in current) or \
                (_re_temp.match(p.name) and now - p.stat().st_mtime > temp_age_s):
            try: p.unlink()
            except FileNotFoundError: continue  # another run removed or renamed it first
            removed.append(p.name)
    return removed


def prune_and_report():
    "`prune`, with one line of what it did (the end of `nbtest` and `execute`)"
    removed = prune()
    kept = len([p for p in CACHE.glob("*.ipynb")]) if CACHE.is_dir() else 0
    print(f"docs outputs: pruned {len(removed)} stale cache entries, {kept} kept in {CACHE.name}")


_re_warning = re.compile(r"^.*(?:Warning|warnings\.warn)\b.*$")


def trim(outputs: list) -> list:
    "warnings dropped from stderr; a text output longer than MAX_LINES cut, saying how much was left out"
    res = []
    for o in outputs:
        o = dict(o)
        if o.get("output_type") == "stream":
            lines, keep, skip_next = "".join(o.get("text", "")).splitlines(), [], False
            for line in lines:
                if skip_next and line.startswith((" ", "\t")): skip_next = False; continue
                skip_next = False
                if o.get("name") == "stderr" and _re_warning.match(line): skip_next = True; continue
                keep.append(line.rsplit("\r", 1)[-1])  # a progress bar: its last state
            if not keep: continue
            if len(keep) > MAX_LINES: keep = keep[:MAX_LINES] + [f"... ({len(keep) - MAX_LINES} more lines)"]
            o["text"] = "\n".join(keep) + "\n"
        elif "text/plain" in o.get("data", {}) and len(o["data"]) == 1:
            text = "".join(o["data"]["text/plain"]).splitlines()
            if len(text) > MAX_LINES:
                o["data"] = {"text/plain": "\n".join(text[:MAX_LINES] + [f"... ({len(text) - MAX_LINES} more lines)"])}
        res.append(o)
    return res


class CachedOutputs:
    "nbdev doc processor: each code cell gets the outputs of the notebook's current cached run (by cell id)"
    def __init__(self, nb):
        self.outs = {}
        if os.environ.get("DOCS_OUTPUTS") == "0": return  # README.md: the same text whatever is cached
        src = Path(getattr(nb, "path_", "") or "")
        if src.suffix != ".ipynb" or not src.exists(): return
        run = cached(src)
        if not run.exists(): return
        for c in json.loads(run.read_text(encoding="utf-8"))["cells"]:
            if c["cell_type"] == "code" and c.get("outputs"): self.outs[c.get("id")] = c["outputs"]

    def __call__(self, cell):
        if cell.cell_type != "code" or cell.get("outputs") or cell.get("id") not in self.outs: return
        from fastcore.basics import AttrDict
        cell.outputs = [AttrDict(o) for o in trim(self.outs[cell.id])]


if __name__ == "__main__" and sys.argv[1:2] == ["nbtest"]:  # top level: fastcore's CLI reads nbdev-test's arguments
    sys.argv.pop(1)
    # the patch on the module by its own name, as the tests import it; every notebook then runs in a process forked
    # from here (`_parallel_longest_first`), which a notebook's IPython shell may change as it likes
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import docs_outputs
    docs_outputs.patch_nbdev_test()
    docs_outputs.preload()
    from nbdev.test import nbdev_test
    try:
        nbdev_test()
    finally:  # also after failures (nbdev-test exits): what no page can show is dropped either way
        docs_outputs.prune_and_report()
elif __name__ == "__main__":
    if sys.argv[1:2] == ["run"]: sys.exit(run(Path(sys.argv[2]).resolve(), Path(sys.argv[3]).resolve()))
    if sys.argv[1:2] == ["execute"]: sys.exit(1 if execute(sys.argv[2:] or None) else 0)
    if sys.argv[1:2] == ["silent"]: sys.exit(1 if report(sys.argv[2:] or None) else 0)
    sys.exit(__doc__)
