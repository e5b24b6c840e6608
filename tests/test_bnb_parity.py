"""Live parity with bitsandbytes on CPU: NF4 quantization (and its 8-bit blockwise double quantization) gives the
same bytes as `bitsandbytes.functional`, and dequantizes to the same float32 values.

The NF4 notebook checks the same against golden bytes recorded from bitsandbytes 0.50; this test runs the library
itself, so a change on either side shows. Skipped only when bitsandbytes cannot be imported (it is in the `hf` extra).
"""
import numpy as np
import pytest

bnb_f = pytest.importorskip("bitsandbytes.functional",
                            reason="bitsandbytes cannot be imported: pip install 'bitsandbytes>=0.50,<0.51' (hf extra)")
torch = pytest.importorskip("torch", reason="torch cannot be imported (bitsandbytes needs it)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from eformer_nb.ops.quantization.nf4 import (NF4_CODEBOOK, ArrayNF4, dequantize_absmax, nf4_decode,  # noqa: E402
                                             quantize_absmax)


SHAPE = (64, 512)  # one shape for every case: each jitted function compiles once


def _weights() -> dict[str, np.ndarray]:
    "Float32 weights of SHAPE: Gaussian at several scales, uniform, and rows of edge-case blocks (repeated)."
    rng = np.random.default_rng(0)
    g = rng.standard_normal(64)
    mid = (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2
    edge = np.stack([np.zeros(64), np.full(64, 3.0), np.r_[-2.0, 2.0 * mid, np.zeros(48)],
                     np.r_[-5.0, np.linspace(-5.0, 4.9, 63)], np.r_[1e-30, -1e-30, np.full(62, 1e-38)],
                     *[g * 10.0 ** e for e in range(-30, 31, 6)]])
    return {"gaussian": rng.standard_normal(SHAPE), "gaussian x 1e-3": rng.standard_normal(SHAPE) * 1e-3,
            "uniform [-7, 7]": rng.uniform(-7, 7, SHAPE), "edge-case blocks": np.resize(edge, SHAPE)}


WEIGHTS = {k: v.astype(np.float32) for k, v in _weights().items()}
quantize = jax.jit(lambda w: ArrayNF4.quantize(w, block_size=64))
quantize_dq = jax.jit(lambda w: ArrayNF4.quantize(w, block_size=64, double_quant=True))
materialize = jax.jit(lambda a: a.materialize())
decode = jax.jit(lambda p, a: nf4_decode(p, a, 64, SHAPE[1]))
quantize_8bit, dequantize_8bit = jax.jit(quantize_absmax), jax.jit(dequantize_absmax)


@pytest.mark.parametrize("name", list(WEIGHTS))
def test_nf4_quantize_and_dequantize_match_bitsandbytes(name):
    w = WEIGHTS[name]
    k, n = w.shape
    packed, state = bnb_f.quantize_4bit(torch.from_numpy(w.copy()), quant_type="nf4", blocksize=64)
    ours = quantize(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(ours.packed), packed.numpy().reshape(k, n // 2))  # codes, byte for byte
    np.testing.assert_array_equal(np.asarray(ours.absmax), state.absmax.numpy().reshape(k, n // 64))
    theirs = bnb_f.dequantize_4bit(packed, state).numpy()
    np.testing.assert_array_equal(np.asarray(materialize(ours)), theirs)
    # and our decoder reads bitsandbytes' own bytes to the same values
    dec = decode(jnp.asarray(packed.numpy().reshape(k, n // 2)), jnp.asarray(state.absmax.numpy().reshape(k, -1)))
    np.testing.assert_array_equal(np.asarray(dec), theirs)


def test_nf4_double_quant_matches_bitsandbytes():
    w = WEIGHTS["gaussian"]
    packed, st = bnb_f.quantize_4bit(torch.from_numpy(w.copy()), quant_type="nf4", blocksize=64,
                                     compress_statistics=True)
    ours = quantize_dq(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(ours.packed).reshape(-1), packed.numpy().reshape(-1))
    np.testing.assert_array_equal(np.asarray(ours.qabsmax).reshape(-1), st.absmax.numpy())  # 8-bit codes
    np.testing.assert_array_equal(np.asarray(ours.absmax_scale), st.state2.absmax.numpy())  # second-level absmax
    np.testing.assert_array_equal(np.asarray(ours.absmax_offset), st.offset.numpy())
    absmax_theirs = (bnb_f.dequantize_blockwise(st.absmax, st.state2) + st.offset).numpy()
    np.testing.assert_array_equal(np.asarray(ours.absmax_f32()).reshape(-1), absmax_theirs)
    np.testing.assert_array_equal(np.asarray(materialize(ours)), bnb_f.dequantize_4bit(packed, st).numpy())


@pytest.mark.parametrize("size", [4096 + 17])  # not a multiple of the block: the last block is partial
def test_8bit_blockwise_matches_bitsandbytes(size):
    "`quantize_absmax` is bitsandbytes' signed dynamic 8-bit blockwise code (block 256) of `x - mean(x)`."
    x = np.abs(np.random.default_rng(size).standard_normal(size)).astype(np.float32) * 3
    codes, scale, offset = quantize_8bit(jnp.asarray(x))
    q, st = bnb_f.quantize_blockwise(torch.from_numpy(x - np.float32(offset)), blocksize=256)
    np.testing.assert_array_equal(np.float32(offset), np.float32(torch.from_numpy(x).mean().item()))
    np.testing.assert_array_equal(np.asarray(codes), q.numpy())
    np.testing.assert_array_equal(np.asarray(scale), st.absmax.numpy())
    back = bnb_f.dequantize_blockwise(q, st).numpy() + np.float32(offset)
    np.testing.assert_array_equal(np.asarray(dequantize_8bit(codes, scale, offset)), back)


# --- the layout `modules.llama` quantizes kernels in: blocks of input features, on a real projection --------------

def _real_projection(name: str = "blk.0.ffn_down.weight") -> np.ndarray:
    "One projection of SmolLM2-135M-Instruct (the packaged GGUF), dequantized to float32, torch's `(out, in)` layout."
    gguf = pytest.importorskip("gguf", reason="gguf cannot be imported (hf extra)")
    from eformer_nb.infra.mixins.gguf import packaged_gguf
    reader = gguf.GGUFReader(packaged_gguf())
    t = next(t for t in reader.tensors if t.name == name)
    shape = [int(n) for n in t.shape[::-1]]
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)


def test_model_quantize_nf4_codes_are_bitsandbytes_codes_on_a_real_projection():
    """`quantize("nf4")` of a model stores each `(in, out)` kernel in blocks of input features: the codes and scales of
    bitsandbytes' `quantize_4bit` of the `(out, in)` weight, byte for byte; the matmul equals the dense one."""
    from flax import nnx

    from eformer_nb.jaximus import implicit
    from eformer_nb.infra.mixins.adapters import AdaptersMixin
    from eformer_nb.infra.layers import Linear

    w = _real_projection()  # (576, 1536): down_proj of layer 0
    out_f, in_f = w.shape

    class Block(AdaptersMixin, nnx.Module):  # any module of Linear layers gets quantize from the mixin
        def __init__(self):
            self.down_proj = Linear(in_f, out_f, rngs=nnx.Rngs(0))

    block = Block()
    block.down_proj.kernel.set_value(jnp.asarray(w.T))  # our (in, out) kernel
    block.quantize("nf4")
    ours = block.down_proj.kernel.get_value()
    assert isinstance(ours, ArrayNF4) and ours.transposed and ours.shape == (in_f, out_f)
    packed, state = bnb_f.quantize_4bit(torch.from_numpy(w.copy()), quant_type="nf4", blocksize=64)
    np.testing.assert_array_equal(np.asarray(ours.packed), packed.numpy().reshape(out_f, in_f // 2))
    np.testing.assert_array_equal(np.asarray(ours.absmax), state.absmax.numpy().reshape(out_f, in_f // 64))
    theirs = bnb_f.dequantize_4bit(packed, state).numpy()
    np.testing.assert_array_equal(np.asarray(materialize(ours)), theirs.T)
    # the fused matmul of the transposed layout equals dequantize-then-matmul, and torch's Linear on bnb's weight
    x = np.random.default_rng(0).standard_normal((3, in_f)).astype(np.float32)
    got = np.asarray(jax.jit(implicit(lambda x, k: x @ k))(jnp.asarray(x), ours))
    np.testing.assert_allclose(got, x @ theirs.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, torch.nn.functional.linear(torch.from_numpy(x), torch.from_numpy(theirs)).numpy(),
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(block.down_proj(jnp.asarray(x))), got, rtol=1e-5, atol=1e-5)


def test_nf4_double_quant_input_blocks_match_bitsandbytes_on_a_real_projection():
    "Double quantization in the input-feature layout: bitsandbytes' 8-bit absmax codes and values, on a real weight."
    w = _real_projection("blk.3.attn_v.weight")  # (192, 576)
    ours = jax.jit(lambda k: ArrayNF4.quantize(k, block_size=64, double_quant=True, block_axis=-2))(jnp.asarray(w.T))
    packed, st = bnb_f.quantize_4bit(torch.from_numpy(w.copy()), quant_type="nf4", blocksize=64,
                                     compress_statistics=True)
    np.testing.assert_array_equal(np.asarray(ours.packed).reshape(-1), packed.numpy().reshape(-1))
    np.testing.assert_array_equal(np.asarray(ours.qabsmax).reshape(-1), st.absmax.numpy())
    np.testing.assert_array_equal(np.asarray(materialize(ours)), bnb_f.dequantize_4bit(packed, st).numpy().T)
