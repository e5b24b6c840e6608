"""Every real model shape through the quantized matmul kernels, on CPU: NF4 and INT8, the forward product and the
transposed one (QLoRA's backward), M in {1, 3, 16, 64, 200}, against the float32 product of the dequantized weight.

* XLA path: the full weights of SmolLM2-135M, TinyLlama-1.1B, Llama-3-8B and Llama-2-7B.
* Pallas GPU schedule in interpret mode: with the tiles the heuristic picks for the *full* shape (split-K count,
  chunk, output tile), run on a slice of the weight that keeps the whole contraction and two output tiles. Output
  tiles are independent programs, so the slice runs exactly the programs of the full call that differ (every
  split-K range, the last one cut at the edge); interpret mode on the full 4096 x 14336 weights would take minutes.
* INT8's GEMV schedule (the model's decode product, up to 8 rows) on every real shape: one launch, no split-K
  partial sums added after it; and in interpret mode on TinyLlama's 11-step down_proj at M = 1, 3 and 8. The same
  for INT8's transposed product g @ Wᵀ (its own GEMV schedule), in interpret mode on TinyLlama's up_proj, whose
  5632 columns are 11 steps of 512. NF4's two products with Wᵀ stored, x @ W and g @ Wᵀ (QLoRA's backward), up to
  16 rows (2..16 through tl.dot on 16 padded rows): one launch, no reduction after it, memory-bound by the occupancy
  model on every real shape; in interpret mode on TinyLlama's down_proj (x @ W: 11 steps of 8 blocks) and up_proj
  (g @ Wᵀ: 11 steps of 512 rows, 32-column programs) at M = 1, 2 and 16, in float32 and bf16.
* The XLA path's streamed products (2..64 rows, W in K-chunks) at M = 8 and 64 on a TinyLlama weight of 11 chunks:
  the one place rows and chunks could be mixed up without M = 1 or the materializing M = 200 noticing.
* The TPU (Mosaic) schedule with its default tiles on the shapes whose axes are not multiples of 512 / 256
  (SmolLM2-135M's 576 and 1536, Llama-2-7B's 11008), M in {1, 3, 16}: lowered for the TPU at full size (Mosaic's
  block rule) and run in interpret mode on a slice, as the GPU schedule above.
* Gradients of `x @ W` through the implicit arrays as the model holds them (their `custom_vjp` calls the transposed
  kernel) against the dense ones, on the XLA path.

The whole matrix (every shape x M x product x path: 30 tests, 10 min at load ~7 on the 2-core box) runs with
EFORMER_NB_QUANT_FULL=1. By default (for `make test`) it keeps what differs between shapes and rows at a fraction
of the cost: every shape's GEMV (M = 1) through the GPU schedule's forward kernels; every M through all four
kernels on the shapes whose split-K ranges end short of the edge; the XLA path on those two and on the two largest
shapes, at M = 1 (streamed) and, on the first two, M = 200 (materialized); M = 64 is the same 64-row tile as 200.
Every shape's GEMV on the XLA path, with the rest, runs with EFORMER_NB_QUANT_FULL=1 (the XLA path depends on the
shape only through its chunking).
The notebook `06k_ops.quantization.kernels` runs the small shapes end to end; this file is the wide matrix.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eformer_nb.jaximus import implicit
from eformer_nb.ops.quantization import Array8B, ArrayNF4
from eformer_nb.ops.quantization import kernels as K
from eformer_nb.ops.quantization.config import jaxpr_equations

SHAPES = {  # (in, out) of each distinct projection
    "SmolLM2-135M": [(576, 576), (576, 192), (576, 1536), (1536, 576)],
    "TinyLlama-1.1B": [(2048, 2048), (2048, 256), (2048, 5632), (5632, 2048)],
    "Llama-3-8B": [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)],
    "Llama-2-7B": [(4096, 11008), (11008, 4096)],
}
CASES = [(name, s) for name, v in SHAPES.items() for s in v]
MS = (1, 3, 16, 64, 200)
FULL = os.environ.get("EFORMER_NB_QUANT_FULL") == "1"
EDGE = {(576, 1536), (5632, 2048)}  # contractions of 9 and 11 chunks: the last split-K program covers fewer
XLA_DEFAULT = EDGE | {(4096, 14336), (11008, 4096)}  # the XLA path does not depend on the shape beyond its chunking


def _nf4_operands(rows: int, cols: int, seed: int):
    "Random NF4 leaves of a stored (rows, cols) weight (codes and scales: the products do not care how they came)."
    rng = np.random.default_rng(seed)
    packed = jnp.asarray(rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8))
    absmax = jnp.asarray(rng.uniform(0.01, 0.05, (rows, cols // 64)).astype(np.float32))
    return packed, absmax


def _int8_operands(rows: int, cols: int, seed: int):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.integers(-127, 128, (rows, cols), dtype=np.int8)),
            jnp.asarray(rng.uniform(1e-4, 4e-4, (cols,)).astype(np.float32)))


def _close(got, lhs, w):
    "got == lhs @ w to float32 summation accuracy: |error| <= 1e-5 * (|lhs| @ |w|) (a wrong chunk is O(1) off)."
    lhs, w = np.asarray(lhs, np.float32), np.asarray(w, np.float32)
    ref = lhs @ w
    bound = np.abs(lhs).sum(axis=1, keepdims=True) * np.abs(w).max()  # >= |lhs| @ |w|, and O(MK) to compute
    err = np.abs(np.asarray(got, np.float32) - ref)
    assert got.shape == ref.shape and np.all(err <= 1e-5 * bound + 1e-6), float((err / (bound + 1e-30)).max())


def _x(m: int, k: int, seed: int = 0):
    return jax.random.normal(jax.random.key(seed), (m, k), jnp.float32)


@pytest.mark.parametrize("name,shape", CASES, ids=[f"{n}-{a}x{b}" for n, (a, b) in CASES])
def test_xla_path_every_shape(name, shape):
    if not (FULL or shape in XLA_DEFAULT):
        pytest.skip("EFORMER_NB_QUANT_FULL=1 runs every shape on the XLA path")
    k_in, n_out = shape
    p, a = _nf4_operands(n_out, k_in, 1)  # NF4 as the model stores it: Wᵀ (out, in), blocks of input features
    wt = np.asarray(K.nf4_dequantize(p, a, n=k_in))  # (out, in)
    q, s = _int8_operands(k_in, n_out, 2)  # INT8: W (in, out), a scale per output feature
    w8 = np.asarray(q, np.float32) * np.asarray(s)
    for m in MS if FULL else (1, 200) if shape in EDGE else (1,):
        x, g = _x(m, k_in), _x(m, n_out, 1)
        _close(K.nf4_matmul_t(x, p, a, n=k_in, backend="xla"), x, wt.T)  # forward: x @ W
        _close(K.nf4_matmul(g, p, a, n=k_in, backend="xla"), g, wt)  # backward: g @ Wᵀ
        _close(K.int8_matmul(x, q, s, backend="xla"), x, w8)
        _close(K.int8_matmul_t(g, q, s, backend="xla"), g, w8.T)


@pytest.mark.parametrize("m", (8, K.GEMV_MAX_ROWS))
def test_xla_streamed_products_keep_rows_and_chunks_apart(m):
    # The XLA path streams W in K-chunks for 2..GEMV_MAX_ROWS rows: (M, K) is cut into (steps, M, chunk) and the
    # per-chunk results put back together. M = 1 cannot tell chunk order from row order and M = 200 takes the
    # materializing path, so the default run above would pass with either mixed up: a TinyLlama weight stored
    # 5632 x 2048 (11 chunks of 512 rows; the up-projection as the NF4 model stores it) at M = 8 and 64 pins it.
    rows, cols = 5632, 2048
    assert K._k_chunk(rows, cols) == 512 and 1 < m <= K.GEMV_MAX_ROWS  # streamed, in 11 chunks
    p, a = _nf4_operands(rows, cols, 10)
    w = np.asarray(K.nf4_dequantize(p, a, n=cols))
    q, s = _int8_operands(rows, cols, 11)
    w8 = np.asarray(q, np.float32) * np.asarray(s)
    x, g = _x(m, rows, 12), _x(m, cols, 13)
    _close(K.nf4_matmul(x, p, a, n=cols, backend="xla"), x, w)  # _nf4_matmul_xla
    _close(K.nf4_matmul_t(g, p, a, n=cols, backend="xla"), g, w.T)  # _nf4_matmul_t_xla
    _close(K.int8_matmul(x, q, s, backend="xla"), x, w8)
    _close(K.int8_matmul_t(g, q, s, backend="xla"), g, w8.T)


def _slice(rows: int, tile: int) -> int:
    return min(rows, 2 * tile)


@pytest.mark.parametrize("name,shape", CASES, ids=[f"{n}-{a}x{b}" for n, (a, b) in CASES])
def test_gpu_schedule_interpret_every_shape(name, shape):
    k_in, n_out = shape
    wide = FULL or shape in EDGE
    for m in (MS if FULL else (1, 3, 16, 200)) if wide else (1,):
        x, g = _x(m, k_in), _x(m, n_out, 1)
        # NF4 forward, x @ W = nf4_matmul_t of the stored Wᵀ (n_out, k_in): output rows sliced
        t = K.default_tiles("gpu", m, "nf4", 64, n_out, k_in, transposed=True)
        assert K._fits("gpu", t, n_out, k_in, 64, True)
        r = _slice(n_out, t.bk)
        p, a = _nf4_operands(r, k_in, 3)
        wt = np.asarray(K.nf4_dequantize(p, a, n=k_in))
        _close(K.nf4_matmul_t_pallas(x, p, a, n=k_in, variant="gpu", tiles=t, interpret=True), x, wt.T)
        if not wide:
            t = K.default_tiles("gpu", m, "int8", K=k_in, cols=n_out)
            q, s = _int8_operands(k_in, _slice(n_out, t.bn), 5)
            y = K.int8_matmul_pallas(x, q, s, variant="gpu", tiles=t, interpret=True)
            _close(y, x, np.asarray(q, np.float32) * s)
            continue
        # NF4 backward, g @ Wᵀ = nf4_matmul of the stored Wᵀ: contraction over its n_out rows, columns sliced
        t = K.default_tiles("gpu", m, "nf4", 64, n_out, k_in)
        assert K._fits("gpu", t, n_out, k_in, 64, False)
        c = _slice(k_in, t.bn)
        p, a = _nf4_operands(n_out, c, 4)
        w = np.asarray(K.nf4_dequantize(p, a, n=c))
        _close(K.nf4_matmul_pallas(g, p, a, n=c, variant="gpu", tiles=t, interpret=True), g, w)
        # INT8 forward x @ W (k_in, n_out): columns sliced; backward g @ Wᵀ: output rows sliced
        t = K.default_tiles("gpu", m, "int8", K=k_in, cols=n_out)
        q, s = _int8_operands(k_in, _slice(n_out, t.bn), 5)
        _close(K.int8_matmul_pallas(x, q, s, variant="gpu", tiles=t, interpret=True), x, np.asarray(q, np.float32) * s)
        t = K.default_tiles("gpu", m, "int8", K=k_in, cols=n_out, transposed=True)
        q, s = _int8_operands(_slice(k_in, t.bk), n_out, 6)
        w8 = np.asarray(q, np.float32) * np.asarray(s)
        _close(K.int8_matmul_t_pallas(g, q, s, variant="gpu", tiles=t, interpret=True), g, w8.T)


def _outside_kernels(closed):
    "Primitive names of a program, nested jaxprs included, outside the bodies of its Pallas kernels."
    eqns = jaxpr_equations(closed)
    inside = {id(e) for c in eqns if c.primitive.name == "pallas_call" for e in jaxpr_equations(c.params["jaxpr"])}
    return [e.primitive.name for e in eqns if id(e) not in inside]


@pytest.mark.parametrize("m", (1, 3, 8))
def test_int8_gemv_one_launch_no_partial_sums(m):
    # The model's INT8 decode product (x @ W, W stored (in, out), a scale per output column) up to GEMV_ROWS rows
    # takes the GEMV schedule on every real shape: never split, one pallas_call and no reduction after it (split-K
    # partial sums would be added there). Then TinyLlama's down_proj (5632 = 11 x 512 rows: 11 steps a program) in
    # interpret mode with the full shape's tiles on two of its column tiles, against the dense product; M = 3 pads
    # to 4 rows (multiply-adds on the ALUs), M = 8 to 16 (tl.dot).
    for name, (k_in, n_out) in CASES:
        t = K.default_tiles("gpu", m, "int8", K=k_in, cols=n_out)
        assert t.gemv and t.split == 1 and K._fits("gpu", t, k_in, n_out, None, False), (name, k_in, n_out, t)
        avals = (jax.ShapeDtypeStruct((m, k_in), jnp.bfloat16), jax.ShapeDtypeStruct((k_in, n_out), jnp.int8),
                 jax.ShapeDtypeStruct((n_out,), jnp.float32))
        f = lambda x, q, s: K.int8_matmul_pallas(x, q, s, variant="gpu", interpret=True)
        prims = _outside_kernels(jax.make_jaxpr(f)(*avals))
        assert prims.count("pallas_call") == 1 and not [p for p in prims if p.startswith("reduce")], (name, prims)
    k_in, n_out = 5632, 2048
    t = K.default_tiles("gpu", m, "int8", K=k_in, cols=n_out)
    assert (k_in // t.bk, t.bm) == (11, 16 if m > K.GEMV_ALU_ROWS else 1 << (m - 1).bit_length()), t
    q, s = _int8_operands(k_in, 2 * t.bn, 30)
    x = _x(m, k_in, 31)
    _close(K.int8_matmul_pallas(x, q, s, variant="gpu", tiles=t, interpret=True), x, np.asarray(q, np.float32) * s)


@pytest.mark.parametrize("m", (1, 2, 8))
def test_int8_gemv_t_one_launch_no_partial_sums(m):
    # INT8's g @ Wᵀ (QLoRA's backward through an INT8 weight) up to GEMV_ROWS rows takes its GEMV schedule on every
    # real shape: one program per bk rows of q walking all N columns, never split, one pallas_call and no reduction
    # after it. Then TinyLlama's up_proj (2048, 5632) in interpret mode with the full shape's tiles on two programs'
    # rows: 5632 columns = 11 steps of 512, against the dense product; M = 1 and 2 run on the ALUs, M = 8 on tl.dot.
    for name, (k_in, n_out) in CASES:
        t = K.default_tiles("gpu", m, "int8", K=k_in, cols=n_out, transposed=True)
        assert t.gemv and t.split == 1 and K._fits("gpu", t, k_in, n_out, None, True), (name, k_in, n_out, t)
        avals = (jax.ShapeDtypeStruct((m, n_out), jnp.bfloat16), jax.ShapeDtypeStruct((k_in, n_out), jnp.int8),
                 jax.ShapeDtypeStruct((n_out,), jnp.float32))
        f = lambda g, q, s: K.int8_matmul_t_pallas(g, q, s, variant="gpu", interpret=True)
        prims = _outside_kernels(jax.make_jaxpr(f)(*avals))
        assert prims.count("pallas_call") == 1 and not [p for p in prims if p.startswith("reduce")], (name, prims)
    k_in, n_out = 2048, 5632
    t = K.default_tiles("gpu", m, "int8", K=k_in, cols=n_out, transposed=True)
    assert (n_out // t.bn, t.bm) == (11, 16 if m > K.GEMV_ALU_ROWS_T else m), t
    q, s = _int8_operands(2 * t.bk, n_out, 32)
    g = _x(m, n_out, 33)
    w8 = np.asarray(q, np.float32) * np.asarray(s)
    _close(K.int8_matmul_t_pallas(g, q, s, variant="gpu", tiles=t, interpret=True), g, w8.T)


@pytest.mark.parametrize("product", ("fwd", "bwd"))
@pytest.mark.parametrize("m", (1, 2, 16))
def test_nf4_gemv_one_launch_no_partial_sums(m, product):
    # NF4's two products up to GEMV_ROWS_NF4 rows, as the model stores the weight (Wᵀ, (out, in)), take their GEMV
    # schedules on every real shape: fwd, x @ W (nf4_matmul_t_pallas), and bwd, g @ Wᵀ (nf4_matmul_pallas, QLoRA's
    # backward). One row on the ALUs, 2..16 through tl.dot on 16 padded rows; never split, one pallas_call and no
    # reduction after it, and memory-bound by the occupancy model's count (padded rows). Then in interpret mode with
    # the full shape's tiles, float32 against the dense product and bf16 within (2^-8 + K 2^-24) |x| |W| (the codebook
    # and the output in bf16, float32 summation; bwd's tl.dot form adds 2^-9 + 2^-16: x times the scale rounded to
    # bf16): fwd on TinyLlama's down_proj (Wᵀ (2048, 5632): 11 steps of 8 blocks) on two programs' rows, bwd on its
    # up_proj (Wᵀ (5632, 2048): 11 steps of 512 rows, 32 columns a program) on four programs' columns, two blocks
    # each shared by two programs.
    fwd = product == "fwd"
    f = K.nf4_matmul_t_pallas if fwd else K.nf4_matmul_pallas
    for name, (k_in, n_out) in CASES:
        t = K.default_tiles("gpu", m, "nf4", 64, n_out, k_in, transposed=fwd)
        assert t.gemv and t.split == 1 and K._fits("gpu", t, n_out, k_in, 64, fwd), (name, k_in, n_out, t)
        assert K.occupancy("nf4", m, n_out, k_in, fwd)["memory_bound"], (name, k_in, n_out, t)
        avals = (jax.ShapeDtypeStruct((m, k_in if fwd else n_out), jnp.bfloat16),
                 jax.ShapeDtypeStruct((n_out, k_in // 2), jnp.uint8),
                 jax.ShapeDtypeStruct((n_out, k_in // 64), jnp.float32))
        call = lambda x, p, a: f(x, p, a, n=k_in, variant="gpu", interpret=True)
        prims = _outside_kernels(jax.make_jaxpr(call)(*avals))
        assert prims.count("pallas_call") == 1 and not [p for p in prims if p.startswith("reduce")], (name, prims)
    rows, cols = (2048, 5632) if fwd else (5632, 2048)  # the stored Wᵀ
    t = K.default_tiles("gpu", m, "nf4", 64, rows, cols, transposed=fwd)
    if fwd:
        assert (cols // t.bn, t.bm) == (11, 1 if m == 1 else 16), t
        p, a = _nf4_operands(2 * t.bk, cols, 34)
    else:
        assert (rows // t.bk, t.bn, t.bm) == (11, 32, 1 if m == 1 else 16), t
        p, a = _nf4_operands(rows, 4 * t.bn, 34)
    w = np.asarray(K.nf4_dequantize(p, a, n=p.shape[1] * 2), np.float64)  # the stored (rows, cols) matrix
    w = w.T if fwd else w  # what x multiplies
    n = p.shape[1] * 2
    x = _x(m, w.shape[0], 35)
    _close(f(x, p, a, n=n, variant="gpu", tiles=t, interpret=True), x, w)
    if m == 2:
        return  # bf16: 2 rows run the kernel of 16 (padded rows), checked at 16; 1 row the ALU kernel
    xb = x.astype(jnp.bfloat16)
    yb = f(xb, p, a, n=n, variant="gpu", tiles=t, interpret=True)
    x64 = np.asarray(xb, np.float64)
    extra = 0.0 if fwd or t.bm == 1 else 2.0 ** -9 + 2.0 ** -16
    bound = (2.0 ** -8 + extra + w.shape[0] * 2.0 ** -24) * (np.abs(x64) @ np.abs(w))
    assert (np.abs(np.asarray(yb, np.float64) - x64 @ w) <= bound).all()


# axes that are not multiples of 512 / 256 (SmolLM2's 576 x 192 runs in the notebook, both ways round)
TPU_SHAPES = [(576, 1536), (1536, 576), (4096, 11008), (11008, 4096)]


def _tpu_lowers(f, *args):
    "Lowering for the TPU on this CPU checks Mosaic's block rule ((8, 128)-aligned or whole): interpret mode does not."
    assert "tpu_custom_call" in jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("shape", TPU_SHAPES, ids=[f"{a}x{b}" for a, b in TPU_SHAPES])
def test_tpu_schedule_every_real_shape(shape):
    # The TPU (Mosaic) schedule with its default tiles for the full stored (rows, cols) weight, as both formats would
    # store it: lowered for the TPU at full size, and run in interpret mode on a slice that keeps the whole contraction
    # and two output tiles (output tiles are independent programs), for M in {1, 3, 16}, against the dense product.
    rows, cols = shape
    tpu, tn, t8 = dict(variant="tpu", interpret=True), {}, {}
    for m in (1, 3, 16):
        tn[m] = K.default_tiles("tpu", m, "nf4", 64, rows, cols)
        t8[m] = K.default_tiles("tpu", m, "int8", K=rows, cols=cols)
        assert K._tpu_reason("nf4", rows, cols, 64) is None and K._fits("tpu", tn[m], rows, cols, 64, False), tn[m]
        assert K._tpu_reason("int8", rows, cols, None) is None and K._fits("tpu", t8[m], rows, cols, None, False), t8[m]
    assert len(set(tn.values())) == len(set(t8.values())) == 1  # bm = 16 for all three: one slice serves them
    p, a = _nf4_operands(rows, cols, 22)
    q, s = _int8_operands(rows, cols, 23)
    cn, rn, c8, r8 = _slice(cols, tn[1].bn), _slice(rows, tn[1].bk), _slice(cols, t8[1].bn), _slice(rows, t8[1].bk)
    w_cols = np.asarray(K.nf4_dequantize(p[:, :cn // 2], a[:, :cn // 64], n=cn))  # x @ W: output columns sliced
    w_rows = np.asarray(K.nf4_dequantize(p[:rn], a[:rn], n=cols))  # g @ Wᵀ: output rows sliced
    w8 = np.asarray(q, np.float32) * np.asarray(s)
    for m in (1, 3, 16):
        x, g = _x(m, rows, 20), _x(m, cols, 21)
        _tpu_lowers(lambda x, p, a: K.nf4_matmul_pallas(x, p, a, n=cols, variant="tpu", interpret=False), x, p, a)
        _tpu_lowers(lambda g, p, a: K.nf4_matmul_t_pallas(g, p, a, n=cols, variant="tpu", interpret=False), g, p, a)
        _tpu_lowers(lambda x, q, s: K.int8_matmul_pallas(x, q, s, variant="tpu", interpret=False), x, q, s)
        _tpu_lowers(lambda g, q, s: K.int8_matmul_t_pallas(g, q, s, variant="tpu", interpret=False), g, q, s)
        _close(K.nf4_matmul_pallas(x, p[:, :cn // 2], a[:, :cn // 64], n=cn, tiles=tn[m], **tpu), x, w_cols)
        _close(K.nf4_matmul_t_pallas(g, p[:rn], a[:rn], n=cols, tiles=tn[m], **tpu), g, w_rows.T)
        _close(K.int8_matmul_pallas(x, q[:, :c8], s[:c8], tiles=t8[m], **tpu), x, w8[:, :c8])
        _close(K.int8_matmul_t_pallas(g, q[:r8], s, tiles=t8[m], **tpu), g, w8[:r8].T)


@pytest.mark.parametrize("shape", sorted(EDGE))
def test_gradients_through_the_transposed_kernels(shape):
    k_in, n_out = shape
    p, a = _nf4_operands(n_out, k_in, 7)
    w_nf4 = ArrayNF4(p, a, 64, n=k_in, dtype=jnp.float32, transposed=True)  # the model's layout: Wᵀ stored
    q, s = _int8_operands(k_in, n_out, 8)
    w_int8 = Array8B(q, s, block_size=None, dtype=jnp.float32)
    c = _x(3, n_out, 9)
    for w in (w_nf4, w_int8):
        dense = np.asarray(w.materialize())
        dx = jax.jit(jax.grad(implicit(lambda x, w: jnp.sum((x @ w) * c))))(_x(3, k_in), w)
        _close(dx, c, dense.T)  # d/dx sum((x @ W) * c) = c @ Wᵀ
