"""Import hygiene: importing eformer_nb (and every submodule) is cheap and never starts an XLA backend."""
import pkgutil
import statistics
import subprocess
import sys
import time

import eformer_nb

SUBMODULES = sorted(m.name for m in pkgutil.walk_packages(eformer_nb.__path__, "eformer_nb."))
NO_BACKEND = (
    "import importlib, sys; importlib.import_module(sys.argv[1]); "
    "import jax._src.xla_bridge as xb; "
    "assert not xb._backends, f'{sys.argv[1]} initialised XLA backends on import: {list(xb._backends)}'; "
    "heavy = sorted(m for m in ('ray', 'tensorstore', 'gcsfs', 'torch', 'transformers', 'safetensors', "
    "'huggingface_hub') if m in sys.modules); "
    "assert not heavy, f'{sys.argv[1]} imported heavy dependencies on import: {heavy}'"
)


def test_submodules_found():
    assert "eformer_nb.common_types" in SUBMODULES


def _no_backend(module: str):
    proc = subprocess.run([sys.executable, "-c", NO_BACKEND, module], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_import_starts_no_backend():
    """No module starts an XLA backend or imports a heavy dependency when imported. Importing a module runs its
    whole import closure, so the modules no other closure contains (`MAXIMAL`, below) are checked, each in a fresh
    interpreter, and every module's own closure lies inside one of theirs
    (`test_every_public_module_is_bounded_by_a_timed_one`); the private modules, which no closure need contain, are
    checked on their own. A failure is then narrowed down by checking each module of the failing closure."""
    checked = MAXIMAL + [m for m in SUBMODULES if m not in PUBLIC]
    for m in checked:
        try:
            _no_backend(m)
        except AssertionError:  # name the culprit: the modules of this closure each alone, the smallest closure first
            inner_modules = [x for x in CLOSURES.get(m, {m}) if x.startswith("eformer_nb")]
            for inner in sorted(inner_modules, key=lambda x: (len(CLOSURES.get(x, ())), x)):
                _no_backend(inner)
            raise


def _import_time(stmt: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", stmt], check=True)
    return time.perf_counter() - t0


def test_import_cost_vs_jax():
    """`import eformer_nb` costs at most 1.2x `import jax` (fresh interpreters, alternating, median of 7)."""
    _import_time("import jax"); _import_time("import eformer_nb")  # warm the OS file cache for both
    ours, theirs = [], []
    for _ in range(7):
        theirs.append(_import_time("import jax"))
        ours.append(_import_time("import eformer_nb"))
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"import eformer_nb / import jax = {ratio:.3f} "
          f"(medians {statistics.median(ours):.3f}s / {statistics.median(theirs):.3f}s)")
    assert ratio <= 1.2, f"import eformer_nb costs {ratio:.2f}x import jax; the budget is 1.2x"


# --- per-submodule import cost -------------------------------------------------------------------------------
# Importing a module costs what its import closure costs: the modules it imports at module level, their imports,
# and its parent packages. When one module's closure (eformer_nb modules and outside packages alike) contains
# another's, it costs at least as much, so timing the modules no other closure contains bounds all of them.
import ast
from pathlib import Path

PKG_ROOT = Path(eformer_nb.__file__).parent
PUBLIC = [m for m in ["eformer_nb"] + SUBMODULES if not any(p.startswith("_") for p in m.split("."))]
BASELINE = "import jax; import optax"
IMPORT_COST_BUDGET = 1.3


def _source(module: str) -> Path:
    rel = Path(*module.split(".")[1:])
    pkg = PKG_ROOT / rel / "__init__.py"
    return pkg if pkg.exists() else PKG_ROOT / rel.with_suffix(".py")


def _direct_imports(module: str) -> set[str]:
    "Absolute names of the modules `module` imports at module level (outside packages by their top-level name)."
    tree = ast.parse(_source(module).read_text(encoding="utf-8"))
    is_pkg = _source(module).name == "__init__.py"
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    out = set()
    stmts = [n for n in tree.body]
    while stmts:  # module level, including inside top-level if/try blocks (not inside functions or classes)
        n = stmts.pop()
        if isinstance(n, (ast.If, ast.Try)):
            stmts += n.body + n.orelse + getattr(n, "finalbody", [])
            stmts += [s for h in getattr(n, "handlers", []) for s in h.body]
        elif isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            root = ".".join(base[: len(base) - n.level + 1]) if n.level else ""
            mod = ".".join(p for p in (root, n.module or "") if p)
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in n.names if f"{mod}.{a.name}" in PUBLIC + SUBMODULES}
    return {m if m.startswith("eformer_nb") else m.split(".")[0] for m in out if m != "__future__"}


def _closure(module: str, seen: set[str] | None = None) -> frozenset[str]:
    seen = set() if seen is None else seen
    parts = module.split(".")
    todo = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]  # importing a.b.c imports a and a.b first
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        if m.startswith("eformer_nb") and _source(m).exists():
            todo += list(_direct_imports(m))
    return frozenset(seen)


CLOSURES = {m: _closure(m) for m in PUBLIC}
# the modules whose closure no other module's closure strictly contains (ties: keep the first name)
MAXIMAL = [m for m in PUBLIC if not any(CLOSURES[m] < CLOSURES[o] or (CLOSURES[m] == CLOSURES[o] and o < m)
                                        for o in PUBLIC if o != m)]


def test_every_public_module_is_bounded_by_a_timed_one():
    assert "eformer_nb.escale.mesh" in PUBLIC and len(MAXIMAL) < len(PUBLIC)
    for m in PUBLIC:
        assert any(CLOSURES[m] <= CLOSURES[t] for t in MAXIMAL), m


def test_closure_sees_imports():
    assert "jax" in CLOSURES["eformer_nb.escale.mesh"] and "eformer_nb.escale" in CLOSURES["eformer_nb.escale.mesh"]
    assert "jax" not in CLOSURES["eformer_nb.loggings"]


_PAIRED = ("import sys, time; t0 = time.perf_counter(); exec(sys.argv[2]); t1 = time.perf_counter(); "
           "__import__(sys.argv[1]); t2 = time.perf_counter(); print(t1 - t0, t2 - t1)")
# Modules that define flax nnx models (the model packages and the training state) cannot avoid importing flax.nnx,
# which alone costs about half of `import jax`: their baseline includes it, so the budget bounds what *we* add.
NNX_PACKAGES = ("eformer_nb.modules", "eformer_nb.infra", "eformer_nb.serve")  # serve runs the nnx models


def _baseline(module: str) -> str:
    return "import jax, optax, flax.nnx" if module.startswith(NNX_PACKAGES) else "import jax, optax"


def _paired_ratio(module: str) -> float:
    "In one fresh interpreter: (time of the baseline + what importing `module` adds) / time of the baseline."
    out = subprocess.run([sys.executable, "-c", _PAIRED, module, _baseline(module)], capture_output=True, text=True,
                         check=True).stdout
    base, extra = map(float, out.split())
    return (base + extra) / base


RECHECK_ABOVE = 0.85 * IMPORT_COST_BUDGET  # a first ratio above this is re-timed twice, the median of 3 judged


def _judged_ratio(module: str, ratio=None) -> float:
    "the module's import-cost ratio: one interpreter's, or the median of 3 when the first is near or over the budget"
    ratio = ratio or _paired_ratio
    first = ratio(module)
    return first if first <= RECHECK_ABOVE else statistics.median([first, ratio(module), ratio(module)])


def test_a_ratio_near_the_budget_is_timed_three_times():
    calls = []
    def fake(m):  # noqa: E306
        calls.append(m)
        return {"a": 1.05, "b": 1.2}[m] if len(calls) == 1 or m == "a" else [9.0, 1.25][len(calls) % 2]
    assert _judged_ratio("a", fake) == 1.05 and calls == ["a"]
    calls.clear()
    assert _judged_ratio("b", fake) == 1.25 and calls == ["b", "b", "b"]


def test_import_cost_per_submodule():
    """`import eformer_nb.<m>` costs at most 1.3x `import jax; import optax` for every public module (plus `flax.nnx` in
    the baseline of the nnx model packages, `NNX_PACKAGES`). The modules no
    other closure contains are timed in a fresh interpreter; one whose first ratio comes within `RECHECK_ABOVE` of the
    budget is timed in 2 more and judged by the median of the 3 (a module far under the budget needs no second look:
    the 75 interpreters of always-3 cost ~80 s). Each interpreter times the baseline and then what the module adds,
    so the two are measured side by side under the same load (on these shared machines, separate runs drift by more
    than the budget). A module that does not import JAX is charged the baseline anyway, an upper bound."""
    subprocess.run([sys.executable, "-c", "; ".join(f"import {m}" for m in MAXIMAL)], check=True)  # warm the file cache
    ratios = {m: _judged_ratio(m) for m in MAXIMAL}
    print(", ".join(f"{m}: {r:.2f}x" for m, r in sorted(ratios.items(), key=lambda kv: -kv[1])))
    over = {m: round(r, 2) for m, r in ratios.items() if r > IMPORT_COST_BUDGET}
    assert not over, f"modules over {IMPORT_COST_BUDGET}x `{BASELINE}`: {over}"


def test_subpackages_as_attributes():
    "As in eformer, `import eformer_nb` then `eformer_nb.pytree...` works, each package imported on first use."
    code = ("import sys, eformer_nb; assert 'eformer_nb.pytree' not in sys.modules; "
            "assert eformer_nb.pytree.tree_add is sys.modules['eformer_nb.pytree'].tree_add; "
            "assert eformer_nb.escale.create_mesh and eformer_nb.mpric.Policy; "
            "import pytest\ntry:\n    eformer_nb.nonexistent\n"
            "except AttributeError as e:\n    assert 'nonexistent' in str(e)\n"
            "else:\n    raise AssertionError('no error')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
