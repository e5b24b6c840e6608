"""eformer_nb.ops.attention beyond the notebook's examples: a traced KV-cache index, bfloat16, "auto"'s choice by
size; and cheap repeats of two notebook checks (blockwise with ragged tiles, ring on 8 devices) that the mutations in
tests/mutations/attention.yaml target. The notebook holds the equality checks per case and the memory growth."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eformer_nb.ops.attention import _case, _pick, _prepare, attention, blockwise_attention, decode_attention


@pytest.mark.parametrize("mechanism", ["vanilla", "blockwise", "sdpa"])
def test_traced_cache_index(mechanism):
    """q_slots = index + arange(t) with `index` traced under jit (the KV cache) equals the concrete slots."""
    q, k, v, kw = _case("cache", s=12)
    start = int(kw["q_slots"][0])
    fn = jax.jit(lambda i: attention(q, k, v, mechanism=mechanism, **{**kw, "q_slots": i + jnp.arange(8)}))
    np.testing.assert_allclose(fn(jnp.int32(start)), attention(q, k, v, mechanism="vanilla", **kw), atol=1e-5)
    assert not np.allclose(fn(jnp.int32(start + 1)), fn(jnp.int32(start)))  # the index is really used


def test_traced_decode_index():
    q, k, v, kw = _case("cache", t=1, s=12)
    kw["key_valid"] = jnp.ones((2, 12), bool)
    for mechanism in ("vanilla", "blockwise"):
        fn = jax.jit(lambda i, m=mechanism: decode_attention(q, k, v, mechanism=m, **{**kw, "q_slots": i[None]}))
        for i in (0, 5, 11):
            np.testing.assert_allclose(fn(jnp.int32(i)), attention(q, k, v, mechanism="vanilla",
                                                                    **{**kw, "q_slots": jnp.array([i])}), atol=1e-5)


def test_bfloat16_blockwise_close_to_vanilla():
    """In bfloat16 (probabilities and output in bf16, statistics in f32) blockwise stays within bf16 rounding."""
    q, k, v, kw = _case("padded", t=64, h=8, kvh=2, d=32)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    ref = attention(q, k, v, mechanism="vanilla", **kw)
    got = blockwise_attention(q, k, v, block_q=16, block_k=24, **kw)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)


def test_auto_leaves_vanilla_when_scores_are_large():
    small = _case("causal")
    assert _pick("auto", small[0], small[1], *_prepare(*small[:3], **_kw(small[3]))) == "vanilla"
    big_q = jax.ShapeDtypeStruct((1, 2048, 32, 64), jnp.float32)
    big_k = jax.ShapeDtypeStruct((1, 2048, 4, 64), jnp.float32)
    ing, spec = _prepare(big_q, big_k, big_k, **_kw(dict(q_slots=jnp.arange(2048), k_slots=jnp.arange(2048))))
    assert _pick("auto", big_q, big_k, ing, spec) == "blockwise"


def _kw(kw):
    names = ("q_slots", "k_slots", "key_valid", "q_segments", "k_segments", "dtype", "softmax_scale",
             "sliding_window", "logits_soft_cap")
    return {**{n: kw.get(n) for n in names}, "causal": True}


def _grads_match(fn, case, s=None, tol=1e-5):
    "`fn(q, k, v, **kw)` against vanilla on `_case(case)`: output and gradients wrt q, k, v."
    q, k, v, kw = _case(case, s=s)
    w = jax.random.normal(jax.random.key(1), (q.shape[0], q.shape[1], q.shape[2] * q.shape[3]))
    ref_fn = lambda q, k, v: attention(q, k, v, mechanism="vanilla", **kw)
    got = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(w * fn(*a, **kw)), (0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(w * ref_fn(*a)), (0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(jax.jit(lambda *a: fn(*a, **kw))(q, k, v), ref_fn(q, k, v), atol=tol, rtol=tol)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", ["cache", "window"])  # the notebook checks every case; these two are the cheap
def test_blockwise_ragged_tiles_equal_vanilla(case):  # targets of tests/mutations/attention.yaml
    """Tiles of 3 x 5 (the last ones padded, causal tiles skipped, statistics carried): outputs and gradients."""
    _grads_match(lambda q, k, v, **kw: blockwise_attention(q, k, v, block_q=3, block_k=5, **kw), case,
                 s=12 if case == "cache" else None)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
@pytest.mark.parametrize("case", ["padded"])
def test_ring_on_8_devices_equals_vanilla(case):
    from eformer_nb.escale import create_mesh
    with jax.set_mesh(create_mesh((1, 1, 1, 2, 4))):
        _grads_match(lambda q, k, v, **kw: attention(q, k, v, mechanism="ring", **kw), case,
                     s=16 if case == "cache" else None)
