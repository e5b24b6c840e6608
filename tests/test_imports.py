"""Import hygiene: importing eformer_nb (and every submodule) is cheap and never starts an XLA backend."""
import pkgutil
import statistics
import subprocess
import sys
import time

import pytest

import eformer_nb

SUBMODULES = sorted(m.name for m in pkgutil.walk_packages(eformer_nb.__path__, "eformer_nb."))
NO_BACKEND = (
    "import importlib, sys; importlib.import_module(sys.argv[1]); "
    "import jax._src.xla_bridge as xb; "
    "assert not xb._backends, f'{sys.argv[1]} initialised XLA backends on import: {list(xb._backends)}'; "
    "heavy = sorted(m for m in ('ray', 'tensorstore', 'gcsfs', 'torch', 'transformers', 'safetensors', 'huggingface_hub') if m in sys.modules); "
    "assert not heavy, f'{sys.argv[1]} imported heavy dependencies on import: {heavy}'"
)


def test_submodules_found():
    assert "eformer_nb.common_types" in SUBMODULES


@pytest.mark.parametrize("module", ["eformer_nb"] + SUBMODULES)
def test_import_starts_no_backend(module):
    proc = subprocess.run([sys.executable, "-c", NO_BACKEND, module], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


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
    print(f"import eformer_nb / import jax = {ratio:.3f} (medians {statistics.median(ours):.3f}s / {statistics.median(theirs):.3f}s)")
    assert ratio <= 1.2, f"import eformer_nb costs {ratio:.2f}x import jax; the budget is 1.2x"
