"""Issue 28: `import eformer_nb.pytree` and `import eformer_nb.optimizers` each cost at most 1.2x `import jax`."""
import statistics
import subprocess
import sys

import pytest

_PAIRED = ("import sys, time; t0 = time.perf_counter(); import jax; t1 = time.perf_counter(); "
           "__import__(sys.argv[1]); t2 = time.perf_counter(); print(t1 - t0, t2 - t1)")


def _paired_ratio(module: str) -> float:
    "In one fresh interpreter: (time of `import jax` + what importing `module` adds) / time of `import jax`."
    out = subprocess.run([sys.executable, "-c", _PAIRED, module], capture_output=True, text=True, check=True).stdout
    base, extra = map(float, out.split())
    return (base + extra) / base


@pytest.mark.parametrize("module", ["eformer_nb.pytree", "eformer_nb.optimizers"])
def test_import_cost_vs_import_jax(module):
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)  # warm the file cache
    ratio = statistics.median(_paired_ratio(module) for _ in range(5))
    print(f"import {module} / import jax = {ratio:.3f}")
    assert ratio <= 1.2, f"import {module} costs {ratio:.2f}x import jax; the budget is 1.2x"


def test_optimizers_import_optax_on_first_use():
    code = ("import sys, eformer_nb.optimizers as o, eformer_nb.pytree as p; assert 'optax' not in sys.modules; "
            "assert o.OptimizerFactory.create and 'optax' in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
