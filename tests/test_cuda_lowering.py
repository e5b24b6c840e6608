"""The CPU gate for GPU code: every GPU kernel lowered for CUDA on this CPU machine, against an abstract H200.

Lowering is what `jax.jit(f).lower` does before XLA compiles: Pallas turns each kernel into Triton IR (the schedule's
block shapes, its grid, `num_warps`/`num_stages`) inside a `__gpu$xla.gpu.triton` custom call of the StableHLO
program. A kernel that cannot lower (a block shape Triton refuses, an op with no Triton lowering, a new JAX
rejecting an old API) fails here, with no GPU; only Triton's own compilation to PTX and the run itself need one.

* The quantized products (`ops.quantization.kernels`): NF4 and INT8, `x @ W` and `g @ Wᵀ`, M in {1, 8, 16, 64},
  on the real projection shapes both ways round (the NF4 model layout stores Wᵀ), with `variant="gpu"`,
  `interpret=False` and the default tiles. Each program holds the Triton kernel, launches as many programs as
  `occupancy` says with the tiles' warps and stages, and holds no float tensor of the weight's shape (the fused
  kernel dequantizes tile by tile; the XLA path at M > 64 does materialize it, the control that the check bites).
  A shape the GPU schedule refuses raises the documented ValueError, and `backend="auto"` sends it to XLA.
* The GEMV schedules (INT8 `x @ W` and `g @ Wᵀ` up to `GEMV_ROWS` rows; NF4 `x @ W` and `g @ Wᵀ` with Wᵀ stored up
  to `GEMV_ROWS_NF4` = 16, 2..16 rows through `tl.dot`): one Triton call, no reduction after it and no float tensor
  of the weight's shape in the program (the split-K tile schedule one row past the GEMV's last, the control, has one).
* `attention(mechanism="flash_attn2")` (our Pallas flash kernel, `ops.attention`), forward and backward: causal, GQA
  32/4 heads, d 64, t 2048; no tensor of the (b, h, t, t) scores appears, and none of K or V repeated to the 32 query
  heads (the kernel reads KV head h // 8 through its index map); also 28/4 heads (a group of 7, not a power of two),
  d 80 (padded to 128) with padding segments.
* `mechanism="cudnn"` lowers only where cuDNN is installed (JAX asks the cuDNN library for its version while
  lowering: "cuDNN is not detected" on a machine without it); there it is checked, here it is skipped, not faked.

`make gpu-lower` runs this file on JAX 0.11 (Python 3.12, .venv-jax011); `make pytest` runs it on .venv's JAX.
"""
from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from eformer_nb.ops import attention as A
from eformer_nb.ops.quantization import kernels as K

TRITON = "__gpu$xla.gpu.triton"
H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                                                 platform="cuda"))
SHAPES = {  # (rows, cols) of distinct projections; each is lowered as stored both ways round
    "SmolLM2-135M": [(576, 1536), (576, 192)],
    "TinyLlama-1.1B": [(2048, 5632), (2048, 256)],
    "Llama-3-8B": [(4096, 14336), (4096, 1024)],
    "Llama-2-7B": [(4096, 11008)],
    "square": [(4096, 4096)],
}
STORED = sorted({s for v in SHAPES.values() for a, b in v for s in ((a, b), (b, a))})
MS = (1, 8, 16, 64)
OFF_GRID = (1000, 1024)  # 1000 rows: not a multiple of 16, so the GPU schedule refuses every product on it
FLOAT = re.compile(r"tensor<((?:\d+x)*)(f16|bf16|f32|f64|f8E\w+)>")


def _lower(f, *args) -> str:
    "StableHLO text of `f` lowered for CUDA (an abstract H200: no GPU, no CUDA library needed) at these avals."
    with jax.sharding.use_abstract_mesh(H200):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _float_shapes(txt: str) -> set[tuple[int, ...]]:
    return {tuple(int(d) for d in m.group(1).split("x") if d) for m in FLOAT.finditer(txt)}


def _triton_calls(txt: str) -> list[dict]:
    "grid, name, warps and stages of each Triton custom call (the IR itself is MLIR bytecode)."
    calls = []
    for line in txt.splitlines():
        if TRITON in line:
            cfg = dict(re.findall(r"\b(grid_[xyz]|num_warps|num_stages) = (\d+)", line))
            name = re.search(r'\bname = "([^"]*)"', line)
            calls.append(dict(name=name and name.group(1), **{k: int(v) for k, v in cfg.items()}))
    return calls


@pytest.fixture
def on_gpu(monkeypatch):
    """Both modules ask `jax.default_backend()` which platform they run on (`kernels._platform`,
    `attention._platform`); here it is "cpu", and the program is lowered for CUDA, so they are told "gpu": for
    `backend="auto"`'s routing and for `resolve_attention_mechanism`, which refuses the GPU mechanisms on a CPU."""
    monkeypatch.setattr(K, "_platform", lambda: "gpu")
    monkeypatch.setattr(A, "_platform", lambda platform=None: "gpu" if platform is None else platform)


def _avals(kind: str, m: int, rows: int, cols: int, transposed: bool, dtype=jnp.bfloat16):
    "(lhs, *weight leaves) as ShapeDtypeStructs: lhs (m, rows) for x @ W, (m, cols) for g @ Wᵀ."
    lhs = jax.ShapeDtypeStruct((m, cols if transposed else rows), dtype)
    if kind == "nf4":
        return lhs, jax.ShapeDtypeStruct((rows, cols // 2), jnp.uint8), jax.ShapeDtypeStruct((rows, cols // 64),
                                                                                             jnp.float32)
    return lhs, jax.ShapeDtypeStruct((rows, cols), jnp.int8), jax.ShapeDtypeStruct((cols,), jnp.float32)


def _kernel(kind: str, transposed: bool, cols: int):
    "The public Pallas function of one product, on the GPU schedule, compiled (not interpreted), default tiles."
    gpu = dict(variant="gpu", interpret=False)
    if kind == "nf4":
        f = K.nf4_matmul_t_pallas if transposed else K.nf4_matmul_pallas
        return lambda lhs, p, a: f(lhs, p, a, n=cols, **gpu)
    f = K.int8_matmul_t_pallas if transposed else K.int8_matmul_pallas
    return lambda lhs, q, s: f(lhs, q, s, **gpu)


def _public(kind: str, transposed: bool, cols: int, backend: str):
    "`nf4_matmul` & co. with `backend`: what a model calls."
    if kind == "nf4":
        f = K.nf4_matmul_t if transposed else K.nf4_matmul
        return lambda lhs, p, a: f(lhs, p, a, n=cols, backend=backend)
    f = K.int8_matmul_t if transposed else K.int8_matmul
    return lambda lhs, q, s: f(lhs, q, s, backend=backend)


def _weight_shapes(rows: int, cols: int) -> set[tuple[int, ...]]:
    "The dense weight in any orientation, and the NF4 paths' even/odd halves of it."
    return {(rows, cols), (cols, rows), (rows, cols // 2), (cols // 2, rows)}


PRODUCTS = [(kind, tr) for kind in ("nf4", "int8") for tr in (False, True)]


@pytest.mark.parametrize("rows,cols", STORED, ids=[f"{a}x{b}" for a, b in STORED])
def test_quantized_kernels_lower_for_cuda(on_gpu, rows, cols):
    for kind, transposed in PRODUCTS:
        block = 64 if kind == "nf4" else None
        assert K._gpu_reason(kind, rows, cols, block, transposed) is None, (kind, transposed, rows, cols)
        for m in MS:
            what = f"{kind} {'g @ Wt' if transposed else 'x @ W'} M={m} stored ({rows}, {cols})"
            txt = _lower(_kernel(kind, transposed, cols), *_avals(kind, m, rows, cols, transposed))
            calls = _triton_calls(txt)
            t = K.default_tiles("gpu", m, kind, 64, rows, cols, transposed=transposed)
            occ = K.occupancy(kind, m, rows, cols, transposed)
            assert len(calls) == 1, (what, calls)
            c = calls[0]
            assert c["grid_x"] * c["grid_y"] * c["grid_z"] == occ["programs"], (what, c, occ)
            assert (c["num_warps"], c["num_stages"]) == (t.warps, t.stages), (what, c, t)
            dense = _float_shapes(txt) & _weight_shapes(rows, cols)
            assert not dense, f"{what}: a dequantized weight {dense} in the lowered program"
        # what a model calls: backend="auto" on a GPU takes the kernel for these shapes
        txt = _lower(_public(kind, transposed, cols, "auto"), *_avals(kind, 8, rows, cols, transposed))
        assert len(_triton_calls(txt)) == 1 and not _float_shapes(txt) & _weight_shapes(rows, cols)


# x @ W and g @ Wᵀ as each format stores W (NF4: Wᵀ), with the most rows each GEMV schedule serves
GEMV = [("nf4", True, K.GEMV_ROWS_NF4), ("nf4", False, K.GEMV_ROWS_NF4), ("int8", False, K.GEMV_ROWS),
        ("int8", True, K.GEMV_ROWS)]


@pytest.mark.parametrize("rows,cols", [(4096, 4096), (4096, 14336), (14336, 4096), (11008, 4096), (576, 1536)])
def test_gemv_products_are_one_launch_with_no_reduction_after_it(on_gpu, rows, cols):
    # Up to GEMV_ROWS rows (NF4: GEMV_ROWS_NF4) the four products take their GEMV schedules: one Triton call that
    # writes the result in the activations' dtype, and no reduction in the XLA program around it (split-K's partial
    # sums are added there). M = 3 runs INT8's g @ Wᵀ on tl.dot (16 padded rows), its x @ W on the ALUs (4 padded
    # rows), NF4's x @ W and g @ Wᵀ on tl.dot (16 padded rows, the decoded tile in bf16)
    for kind, transposed, most in GEMV:
        for m in sorted({1, 3, K.GEMV_ROWS, most}):
            t = K.default_tiles("gpu", m, kind, 64, rows, cols, transposed=transposed)
            assert t.gemv and t.split == 1, (kind, m, rows, cols, t)
            txt = _lower(_kernel(kind, transposed, cols), *_avals(kind, m, rows, cols, transposed))
            assert len(_triton_calls(txt)) == 1 and "stablehlo.reduce" not in txt, (kind, m, rows, cols)
            assert not _float_shapes(txt) & _weight_shapes(rows, cols), (kind, m, rows, cols)
        # the control: one row more takes the tile schedule, which sums its split-K slabs after the kernel
        txt = _lower(_kernel(kind, transposed, cols), *_avals(kind, most + 1, rows, cols, transposed))
        assert not K.default_tiles("gpu", most + 1, kind, 64, rows, cols, transposed=transposed).gemv
        assert len(_triton_calls(txt)) == 1 and "stablehlo.reduce" in txt, (kind, rows, cols)


def test_the_dense_weight_check_bites(on_gpu):
    # the XLA path above GEMV_MAX_ROWS rows dequantizes the whole weight: the check above sees it there
    rows, cols, m = 2048, 5632, K.GEMV_MAX_ROWS + 1
    for kind, transposed in PRODUCTS:
        txt = _lower(_public(kind, transposed, cols, "xla"), *_avals(kind, m, rows, cols, transposed))
        assert not _triton_calls(txt) and _float_shapes(txt) & _weight_shapes(rows, cols), (kind, transposed)


def test_a_refused_shape_gets_the_documented_error(on_gpu):
    # `_gpu_reason` speaks for every M (16-row `tl.dot` tiles); below 16 rows the multiply-and-reduce tiles may
    # still fit an off-grid shape (1000 = 8 x 125 contracted in chunks of 8): then it lowers, else it is refused
    rows, cols = OFF_GRID
    for kind, transposed in PRODUCTS:
        block = 64 if kind == "nf4" else None
        reason = K._gpu_reason(kind, rows, cols, block, transposed)
        assert reason is not None and "not a multiple of 16" in reason, reason
        refused = []
        for m in MS:
            t = K.default_tiles("gpu", m, kind, 64, rows, cols, transposed=transposed)
            f, avals = _kernel(kind, transposed, cols), _avals(kind, m, rows, cols, transposed)
            if K._fits("gpu", t, rows, cols, block, transposed):
                assert len(_triton_calls(_lower(f, *avals))) == 1
                continue
            refused.append(m)
            with pytest.raises(ValueError, match=rf"tiles Tiles\(.*\) do not fit weight shape \({rows}, {cols}\)"):
                _lower(f, *avals)
        assert refused and min(refused) <= 16, (kind, transposed, refused)
        txt = _lower(_public(kind, transposed, cols, "auto"), *_avals(kind, 8, rows, cols, transposed))
        assert not _triton_calls(txt), "backend='auto' must send a refused shape to the XLA path"


B, T, H, KVH, D = 1, 2048, 32, 4, 64
Q = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
KV = jax.ShapeDtypeStruct((B, T, KVH, D), jnp.bfloat16)


def _attn(mechanism: str):
    slots = dict(q_slots=jnp.arange(T), k_slots=jnp.arange(T))
    return lambda q, k, v: A.attention(q, k, v, mechanism=mechanism, causal=True, **slots)


def _no_scores(txt: str):
    "No tensor near the size of the (b, h, t, t) scores: the largest is q's size (the scores are t/d = 32x that)."
    biggest = max(math.prod(s) for s in _float_shapes(txt))
    assert biggest <= B * T * H * D < B * H * T * T, biggest


def _no_kv_repeat(txt: str, b=B, t=T, h=H, kvh=KVH, d=D):
    "No K/V broadcast to the query heads: `jnp.repeat` makes a (b, t, kvh, h // kvh, d) tensor (JAX's mha needed it)."
    assert (b, t, kvh, h // kvh, d) not in _float_shapes(txt)


def test_flash_attn2_forward_lowers_for_cuda(on_gpu):
    txt = _lower(_attn("flash_attn2"), Q, KV, KV)
    assert [c["name"] for c in _triton_calls(txt)] == ["flash_fwd"]
    _no_scores(txt)
    _no_kv_repeat(txt)


def test_flash_attn2_backward_lowers_for_cuda(on_gpu):
    def loss(q, k, v):
        return jnp.sum(_attn("flash_attn2")(q, k, v).astype(jnp.float32))

    txt = _lower(jax.grad(loss, argnums=(0, 1, 2)), Q, KV, KV)
    names = sorted(c["name"] for c in _triton_calls(txt))
    assert names == ["flash_bwd_dkdv", "flash_bwd_dq", "flash_fwd"], names
    _no_scores(txt)
    _no_kv_repeat(txt)


def test_flash_attn2_odd_group_and_head_dim_lower_for_cuda(on_gpu):
    # 28 query heads over 4 KV heads (a group of 7: the dK/dV program's block of 7 heads), d 80 (padded to 128 for
    # Triton's power-of-two tiles), left padding (the kernel's segment ids), bf16, forward and backward
    t, h, kvh, d = 256, 28, 4, 80
    q, kv = jax.ShapeDtypeStruct((2, t, h, d), jnp.bfloat16), jax.ShapeDtypeStruct((2, t, kvh, d), jnp.bfloat16)
    valid = jnp.arange(t)[None, :] >= jnp.array([0, 5])[:, None]

    def loss(q, k, v):
        out = A.attention(q, k, v, mechanism="flash_attn2", q_slots=jnp.arange(t), k_slots=jnp.arange(t),
                          key_valid=valid)
        return jnp.sum(out.astype(jnp.float32))

    txt = _lower(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
    calls = {c["name"]: c for c in _triton_calls(txt)}
    assert sorted(calls) == ["flash_bwd_dkdv", "flash_bwd_dq", "flash_fwd"], calls
    assert calls["flash_bwd_dkdv"]["grid_z"] == kvh and calls["flash_bwd_dq"]["grid_z"] == h, calls
    _no_kv_repeat(txt, b=2, t=t, h=h, kvh=kvh, d=d)


def test_cudnn_lowers_where_cudnn_is_installed(on_gpu):
    try:
        txt = _lower(_attn("cudnn"), Q, KV, KV)
    except RuntimeError as e:
        if "cuDNN is not detected" not in str(e):
            raise
        pytest.skip("cuDNN attention lowers only where the cuDNN library is installed (JAX reads its version while "
                    f"lowering): {e}")
    assert "cudnn" in txt.lower()
    _no_scores(txt)
