"""The Llama model under each attention mechanism that runs on a CPU: the same loss and gradients as "vanilla" in
float32 (to 1e-5), on left-padded and on packed (segmented) batches, with and without gradient checkpointing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eformer_nb.modules.llama import LlamaConfig, LlamaForCausalLM
from eformer_nb.ops.attention import ATTENTION_MECHANISMS, resolve_attention_mechanism


def _runs_on_cpu(name: str) -> bool:
    try:
        resolve_attention_mechanism(name, platform="cpu")
    except ValueError:  # needs a GPU/TPU (its message says so)
        return False
    return name not in ("auto", "ring")  # auto: one of the others; ring: needs a mesh (tests/test_attention.py)


CPU_MECHANISMS = [m for m in ATTENTION_MECHANISMS if _runs_on_cpu(m)]
IDS = jax.random.randint(jax.random.key(0), (2, 12), 3, 128)
MASK = jnp.array([[0] * 4 + [1] * 8, [1] * 12], bool)  # row 0 left-padded
SEGMENTS = jnp.array([[1] * 5 + [2] * 7, [1] * 12], jnp.int32)  # row 0 packs two sequences
POSITIONS = jnp.array([list(range(5)) + list(range(7)), list(range(12))], jnp.int32)


def loss_and_grads(mechanism: str, gradient_checkpointing: str = "", packed: bool = False):
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_mechanism=mechanism, gradient_checkpointing=gradient_checkpointing)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    kw = dict(segment_ids=SEGMENTS, position_ids=POSITIONS) if packed else dict(attention_mask=MASK)
    return nnx.jit(nnx.value_and_grad(lambda m: m.compute_loss(input_ids=IDS, **kw)[0].loss))(model)


@pytest.fixture(scope="module")
def reference():
    return {packed: loss_and_grads("vanilla", packed=packed) for packed in (False, True)}


def _close(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mechanism", [m for m in CPU_MECHANISMS if m != "vanilla"])
@pytest.mark.parametrize("packed", [False, True], ids=["left-padded", "packed"])
def test_mechanism_equals_vanilla(reference, mechanism, packed):
    _close(loss_and_grads(mechanism, packed=packed), reference[packed])


def test_remat_with_blockwise_equals_vanilla(reference):
    _close(loss_and_grads("blockwise", "nothing_saveable"), reference[False])
