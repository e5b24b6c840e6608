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


def test_loops_over_implicit_operands():
    """Implicit arrays as a loop's constants, carry and scanned inputs, under `implicit` and `jit`: the scan rule reads
    its operand groups from the params of the installed JAX (0.10 counts them; 0.11 packs them in `ft_in`), and a
    quantized weight closed over by the body stays packed (the GPU page's GEMV harness relies on it)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from eformer_nb.jaximus import implicit
    from eformer_nb.ops.quantization import quantize

    w = quantize(jax.random.normal(jax.random.key(0), (64, 32)), "nf4")
    dense = w.materialize()
    x = jax.random.normal(jax.random.key(1), (2, 64))

    def fori(x, w):  # w is a constant of the loop's body
        return lax.fori_loop(0, 3, lambda i, acc: acc + jnp.sum(x @ w) * (i + 1), jnp.float32(0))

    def scan(x, w):  # w a constant, x's rows the scanned inputs, a float carry, ys that are computed
        return lax.scan(lambda c, row: (c + jnp.sum(row @ w), (row @ w)[:2]), jnp.float32(0), x)

    for fn in (fori, scan):
        got = jax.jit(implicit(fn))(x, w)
        want = fn(x, dense)
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert jnp.allclose(g, r, rtol=1e-5, atol=1e-4), (fn.__name__, g, r)
    loop = [e for e in jax.make_jaxpr(implicit(fori))(x, w).jaxpr.eqns if e.primitive.name in ("while", "scan")]
    operands = [(v.aval.dtype, v.aval.shape) for e in loop for v in e.invars]
    assert (jnp.uint8, w.packed.shape) in operands, operands  # the packed codes enter the loop
    assert not [o for o in operands if o[1] in ((64, 32), (32, 64)) and o[0] != jnp.uint8], operands  # no dense weight
