"""jaximus relies on public JAX APIs only; a fresh interpreter can run an implicit matmul under jit."""
import pathlib
import subprocess
import sys

import pytest

import eformer_nb.jaximus as jaximus

QUANT_DIR = pathlib.Path(jaximus.__file__).parent / "ops" / "quantization"
OURS = [pathlib.Path(jaximus.__file__), *sorted(QUANT_DIR.glob("*.py"))]  # jaximus and every quantized format


def test_no_private_jax_imports():
    names = {p.stem for p in OURS}
    assert {"jaximus", "__init__", "config", "nf4", "int8", "binary_ternary"} <= names, names
    for path in OURS:
        text = path.read_text()
        assert "jax._src" not in text and "from jax.interpreters" not in text, f"{path} uses a private JAX module"


def test_higher_order_table_covers_installed_jax():
    import jax
    import jax.numpy as jnp
    from jax import lax

    names = set()
    for fn in (lambda a: jax.jit(jnp.sin)(a), lambda a: jax.checkpoint(jnp.sin)(a),
               lambda a: lax.scan(lambda c, x: (c, x), 0.0, a), lambda a: lax.cond(True, jnp.sin, jnp.cos, a),
               lambda a: lax.while_loop(lambda c: c < 1, lambda c: c + 1, 0.0)):
        names |= {e.primitive.name for e in jax.make_jaxpr(fn)(jnp.ones(2)).jaxpr.eqns}
    names -= {"sin", "cos", "add", "lt", "convert_element_type"}
    assert {"scan", "cond", "while"} <= names, names  # the probe really produced the higher-order primitives
    assert names <= set(jaximus.HIGHER_ORDER_PRIMITIVES), names - set(jaximus.HIGHER_ORDER_PRIMITIVES)


@pytest.mark.timeout(300)
def test_quantized_matmul_in_fresh_process():
    code = (
        "import jax, jax.numpy as jnp\n"
        "from eformer_nb.jaximus import implicit\n"
        "from eformer_nb.ops.quantization import quantize\n"
        "w = jax.random.normal(jax.random.key(0), (64, 128))\n"
        "x = jax.random.normal(jax.random.key(1), (3, 64))\n"
        "for t in ('nf4', 'int8', 'binary', 'ternary'):\n"
        "    q = quantize(w, t)\n"
        "    y = jax.jit(implicit(lambda x, w: x @ w))(x, q)\n"
        "    ref = x @ q.materialize()\n"
        "    assert float(jnp.max(jnp.abs(y - ref))) <= 1e-4 * float(jnp.max(jnp.abs(ref))), t\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
