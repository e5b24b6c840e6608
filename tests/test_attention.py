"""eformer_nb.ops.attention beyond the notebook's examples: a traced KV-cache index, bfloat16, "auto"'s choice by
size; and cheap repeats of notebook checks (blockwise with ragged tiles, ring on 8 devices, the flash kernel's GQA in
interpret mode and its reading K/V in place) that the mutations in tests/mutations/attention.yaml target. The notebook
holds the equality checks per case and the memory growth."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eformer_nb.ops.attention import (_Spec, _case, _computed_from, _pick, _prepare, _rows, attention,
                                     blockwise_attention, decode_attention, pallas_attention, visible_mask)


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


def _grads_match(fn, case, s=None, tol=1e-5, shape=None, **extra):
    "`fn(q, k, v, **kw)` against vanilla on `_case(case, **shape)` (options `extra`): output and gradients wrt q, k, v."
    q, k, v, kw = _case(case, s=s, **(shape or {}))
    kw.update(extra)
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


def _flash(q, k, v, **kw):
    return pallas_attention(q, k, v, mechanism="flash_attn2", interpret=True, **kw)


@pytest.mark.parametrize("case,causal", [("padded", True), ("segments", False)])
def test_flash_gqa_equals_vanilla(case, causal):
    """flash_attn2 (our Pallas kernel, interpret mode) with 8 query heads over 2 KV heads: each query head reads the KV
    head of its group through the BlockSpec index map, dK/dV are summed over the group in the kernel."""
    _grads_match(_flash, case, shape=dict(t=24, h=8, kvh=2), causal=causal)


def test_flash_reads_kv_in_place():
    """Nothing computed from K or V outside the Pallas kernels (forward and backward, traced) is bigger than K padded
    to the tile: no K/V repeated to the query heads; the old jnp.repeat path is the control that the check bites."""
    q, k, v, kw = _case("padded", t=12, h=8, kvh=2, d=16)

    def sizes(f):
        jaxpr = jax.make_jaxpr(jax.grad(lambda q, k, v: f(q, k, v).sum(), (0, 1, 2)))(q, k, v)
        return [math.prod(s) for _, s in _computed_from(jaxpr, (1, 2))]

    padded_k = 2 * 16 * 2 * 16
    assert 0 < max(sizes(lambda q, k, v: _flash(q, k, v, **kw))) <= padded_k
    repeated = sizes(lambda q, k, v: _flash(q, jnp.repeat(k, 4, 2), jnp.repeat(v, 4, 2), **kw))
    assert max(repeated) == 4 * padded_k


# Bad inputs (issue 48): each used to go through and silently zero, flatten or NaN the output (or die in a modulo by
# zero in blockwise); now one check at the entry (`_prepare`: `_check` and `_spec`) refuses it, whatever the mechanism.
def _entries():
    """Every way in on a CPU: each mechanism `attention` runs here (ring refuses later: no mesh), the Pallas kernels in
    interpret mode, `blockwise_attention` and the decode step."""
    yield from ((f"attention/{m}", lambda q, k, v, m=m, **kw: attention(q, k, v, mechanism=m, **kw))
                for m in ("auto", "vanilla", "sdpa", "blockwise", "ring"))
    yield from ((f"pallas/{m}", lambda q, k, v, m=m, **kw: pallas_attention(q, k, v, mechanism=m, interpret=True, **kw))
                for m in ("flash_attn2", "blocksparse"))
    yield "blockwise_attention", lambda q, k, v, **kw: blockwise_attention(q, k, v, block_q=4, block_k=4, **kw)
    yield from ((f"decode/{m}", lambda q, k, v, m=m, **kw: decode_attention(q[:, -1:], k, v, **{
        **kw, "q_slots": kw["q_slots"][-1:]}, mechanism=m)) for m in ("auto", "vanilla", "sdpa", "blockwise"))


_BAD = {  # name -> (change to _case("causal"), what the error says)
    "window-0": (dict(sliding_window=0), "sliding_window=0: expected None (no window) or an int >= 1"),
    "window-negative": (dict(sliding_window=-2), "sliding_window=-2"),
    "window-float": (dict(sliding_window=2.5), "sliding_window=2.5"),
    "cap-0": (dict(logits_soft_cap=0.0), "logits_soft_cap=0.0: expected None (no cap) or a finite number > 0"),
    "cap-negative": (dict(logits_soft_cap=-2.0), "logits_soft_cap=-2.0"),
    "cap-inf": (dict(logits_soft_cap=float("inf")), "logits_soft_cap=inf"),
    "cap-nan": (dict(logits_soft_cap=float("nan")), "logits_soft_cap=nan"),
    "scale-nan": (dict(softmax_scale=float("nan")), "softmax_scale=nan"),
    "scale-0": (dict(softmax_scale=0.0), "softmax_scale=0.0: expected None (1/sqrt(head_dim)) or a finite number > 0"),
    "causal-str": (dict(causal="yes"), "causal='yes': expected True or False"),
    "int-q": (dict(q=jnp.int32), "q has dtype int32; expected floating q, k, v"),
    "int-kv": (dict(k=jnp.int8, v=jnp.int8), "k has dtype int8"),
    "int-dtype": (dict(dtype=jnp.int32), "dtype=int32: expected None (q's dtype) or a floating dtype"),
    "no-key": (dict(s=0), "have an empty axis"),
}


@pytest.mark.parametrize("bad", list(_BAD))
def test_every_entry_refuses_bad_input(bad):
    change, says = _BAD[bad]
    q, k, v, kw = _case("causal")
    if "s" in change:
        k, v, kw["k_slots"] = k[:, :change["s"]], v[:, :change["s"]], kw["k_slots"][:change["s"]]
    q, k, v = (x.astype(change.get(n, x.dtype)) for n, x in zip("qkv", (q, k, v)))
    kw.update({n: x for n, x in change.items() if n not in ("q", "k", "v", "s")})
    for name, fn in _entries():
        with pytest.raises(ValueError, match=re.escape(says)):
            fn(q, k, v, **kw)
            pytest.fail(f"{name} took {bad}")


def test_no_query_refused():
    """t = 0 (blockwise and ring died in a modulo by zero, vanilla returned an empty array); decode has its own
    refusal (one query per row)."""
    q, k, v, kw = _case("causal")
    kw["q_slots"] = kw["q_slots"][:0]
    for name, fn in _entries():
        with pytest.raises(ValueError, match="have an empty axis|one query per row"):
            fn(q[:, :0], k, v, **kw)


def test_rows_any_segment_ids():
    """`_rows` (which queries of a Pallas self-attention kernel see some key) equals the dense mask's rows for any
    segment ids, not only contiguous runs, with padding holes, with and without a window."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        t = int(rng.integers(1, 12))
        seg = jnp.asarray(rng.integers(0, 3, (3, t)), jnp.int32)
        kv = jnp.asarray(rng.random((3, t)) < 0.6)
        ing = dict(q_slots=jnp.arange(t), k_slots=jnp.arange(t), key_valid=kv, q_segments=seg, k_segments=seg)
        for window in (None, 2):
            want = visible_mask(**ing, causal=True, sliding_window=window).any(-1)
            got = _rows(ing, _Spec(1.0, sliding_window=window), t)
            np.testing.assert_array_equal(got, want, err_msg=f"segments {seg}, key_valid {kv}, window {window}")


def test_pallas_padding_query_with_segment_coming_back():
    """A padding query whose segment has real keys earlier (segment 0 comes back after segment 1): both kernels take
    query and key segments apart and compute it (both used to zero it; JAX's mha, flash_attn2's kernel until issue 44,
    could not compute it and marked it NaN)."""
    q, k, v, kw = _case("causal")
    seg = jnp.array([[0, 0, 1, 1, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1]])
    kw.update(q_segments=seg, k_segments=seg, key_valid=jnp.ones((2, 8), bool).at[0, 4].set(False))
    ref = np.asarray(attention(q, k, v, mechanism="vanilla", **kw))
    assert np.abs(ref[0, 4]).min() > 0
    np.testing.assert_allclose(_flash(q, k, v, **kw), ref, atol=1e-5)
    np.testing.assert_allclose(pallas_attention(q, k, v, mechanism="blocksparse", interpret=True, **kw), ref, atol=1e-5)


def test_blockwise_tiles_refused():
    q, k, v, kw = _case("causal")
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=re.escape(f"block_k={bad!r}: expected an int >= 1")):
            blockwise_attention(q, k, v, block_k=bad, **kw)
