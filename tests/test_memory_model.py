"""Memory of a Llama training step, from XLA's own analysis of the compiled program: each step is lowered and
compiled for abstract inputs (`jax.ShapeDtypeStruct`s), never run, so these cost compile time only.

A 4-layer model with a small hidden size:
- under `attn_mechanism="blockwise"` the step's temporary memory grows at most linearly with the length
  (2048 -> 8192 tokens: <= 4.5x), under `"vanilla"` (the `(t, s)` scores of every layer kept for the backward)
  about quadratically;
- `gradient_checkpointing="nothing_saveable"` cuts it by >= 3x at 2048 tokens (hidden 256, MLP 1024: the saving is
  the layers' activations, so it needs layers whose activations outweigh one layer's attention work; measured 3.3x);
- `loss_chunk_size` removes the `(batch, length, vocab)` float32 logits (and their gradient) from it.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from eformer_nb.modules.llama import LlamaConfig, LlamaForCausalLM

MiB = 2**20


def step_temp_bytes(length: int, batch: int = 1, **fields) -> int:
    "Temporary bytes XLA plans for one `value_and_grad` of `compute_loss` (4 layers, hidden 64), compiled only."
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=8192)
    config = LlamaConfig(**{**shape, **fields})
    model = LlamaForCausalLM.lazy_init(config)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def step(params, ids):
        return jax.value_and_grad(lambda p: nnx.merge(graphdef, p, rest).compute_loss(input_ids=ids)[0].loss)(params)

    ids = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    return jax.jit(step).lower(params, ids).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_grows_linearly_vanilla_quadratically():
    block = {n: step_temp_bytes(n, attn_mechanism="blockwise") for n in (2048, 8192)}
    vanilla = {n: step_temp_bytes(n, attn_mechanism="vanilla") for n in (2048, 8192)}
    print(f"temp memory 2048 -> 8192 tokens: blockwise {block[2048] / MiB:.1f} -> {block[8192] / MiB:.1f} MiB "
          f"({block[8192] / block[2048]:.2f}x), vanilla {vanilla[2048] / MiB:.1f} -> {vanilla[8192] / MiB:.1f} MiB "
          f"({vanilla[8192] / vanilla[2048]:.2f}x)")
    assert block[8192] <= 4.5 * block[2048]
    assert vanilla[8192] >= 12 * vanilla[2048]  # ~16x: the (t, s) scores of every layer
    assert block[8192] * 8 < vanilla[8192]


def test_nothing_saveable_cuts_the_step():
    wider = dict(hidden_size=256, intermediate_size=1024)  # attn_mechanism "auto": on a CPU at 2048 tokens, vanilla
    plain, remat = (step_temp_bytes(2048, **wider, gradient_checkpointing=gc) for gc in ("", "nothing_saveable"))
    print(f"temp memory at 2048 tokens (hidden 256): no remat {plain / MiB:.1f} MiB, nothing_saveable "
          f"{remat / MiB:.1f} MiB ({plain / remat:.2f}x less)")
    assert plain >= 3 * remat


def test_chunked_loss_drops_the_logits_buffer():
    logits = 2 * 1024 * 8192 * 4  # (batch, length, vocab) float32
    kw = dict(vocab_size=8192, attn_mechanism="blockwise")  # blockwise: the logits, not the scores, stand out
    whole = step_temp_bytes(1024, batch=2, loss_chunk_size=None, **kw)
    chunked = step_temp_bytes(1024, batch=2, loss_chunk_size=256, **kw)
    print(f"(batch, length, vocab) float32 = {logits / MiB:.0f} MiB; step temp memory: whole logits {whole / MiB:.1f} "
          f"MiB, chunks of 256 tokens {chunked / MiB:.1f} MiB")
    assert whole - chunked >= 2 * logits  # the logits and their gradient are gone
