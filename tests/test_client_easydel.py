"""The real client on us: EasyDeL from PyPI, unmodified, imports, builds, trains, generates and saves on eformer_nb.

Runs in `.venv-client` (`make client`), where EasyDeL is installed with its own pins (jax 0.9.2) and `eformer` is
resolved to `eformer_nb` by the test-only alias in `eformer_alias.py`. Outside that venv (no `easydel`) the module is
skipped; with `EFORMER_NB_CLIENT=1` (set by `make client`) a missing EasyDeL is a failure instead.
"""
from __future__ import annotations

import atexit
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile

import numpy as np
import pytest

if importlib.util.find_spec("easydel") is None:
    if os.environ.get("EFORMER_NB_CLIENT") == "1":
        raise RuntimeError("EFORMER_NB_CLIENT=1 but easydel is not installed here: run `make client`")
    pytest.skip("easydel is installed only in .venv-client (`make client`)", allow_module_level=True)

import eformer_alias  # noqa: E402


def _pinned_eformer_version() -> str:
    "The eformer release EasyDeL pins in its metadata (`eformer==X`): what the alias reports as `eformer.__version__`."
    for req in importlib.metadata.requires("easydel") or []:
        m = re.fullmatch(r"eformer\s*==\s*([\w.]+)", req.split(";")[0].strip())
        if m:
            return m.group(1)
    raise RuntimeError(f"easydel {importlib.metadata.version('easydel')} declares no `eformer==` pin")


eformer_alias.install(_pinned_eformer_version())
# EasyDeL and ejkernel keep compiled executables under ~/.cache (COMPILE_FUNC_DIR) and load them in later runs; a fresh
# directory per session keeps this test from reading what another run, jax or machine compiled.
_COMPILE_DIR = tempfile.mkdtemp(prefix="easydel-compiled-")
atexit.register(shutil.rmtree, _COMPILE_DIR, True)
os.environ["COMPILE_FUNC_DIR"] = _COMPILE_DIR

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import easydel as ed  # noqa: E402
from eformer_nb.modules import llama as ours  # noqa: E402
from eformer_nb.infra.mixins.generation import GenerationConfig as OurGenerationConfig  # noqa: E402
from eformer_nb.infra.mixins.generation import GenerationMixin  # noqa: E402
from eformer_nb.infra.mixins.interop import state_dict_to_params  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
            tie_word_embeddings=False)
IDS = (np.arange(16).reshape(2, 8) * 7) % 64


def test_alias_is_eformer_nb_itself():
    import eformer
    import eformer.common_types
    import eformer_nb
    import eformer_nb.common_types
    assert eformer.common_types is eformer_nb.common_types  # the same module object, not a copy
    assert eformer.common_types.__spec__.name == "eformer_nb.common_types"
    assert eformer.__version__ == _pinned_eformer_version() != eformer_nb.__version__
    assert sys.modules["easydel"].__version__ == importlib.metadata.version("easydel")
    with pytest.raises(ModuleNotFoundError):
        import eformer.no_such_module  # noqa: F401


def test_runs_on_easydels_pinned_jax():
    pins = [r for r in importlib.metadata.requires("ejkernel") if r.startswith("jax~=") or r.startswith("jax>=")]
    assert pins, "ejkernel no longer pins jax: check which jax EasyDeL resolves to"
    assert jax.__version__.startswith("0.9."), f"expected EasyDeL's pinned jax 0.9.x here, got {jax.__version__}"


def _hf_state_dict(module) -> dict[str, np.ndarray]:
    "EasyDeL's Llama parameters under transformers' names and layouts (kernels transposed to (out, in))."
    out = {}
    for path, v in jax.tree_util.tree_flatten_with_path(nnx.state(module, nnx.Param))[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        *mod, leaf = [k for k in keys if k != "value"]
        a = np.asarray(v)
        out[".".join(mod) + ".weight"] = a if leaf == "embedding" or a.ndim == 1 else a.T
    return out


def _ours_from(module):
    "Our `modules.llama` model holding the same weights as the EasyDeL module."
    model = ours.LlamaForCausalLM(ours.LlamaConfig(**TINY), precision="highest")
    return model.merge_params_dict(state_dict_to_params(_hf_state_dict(module), TINY["tie_word_embeddings"]))


@pytest.fixture(scope="module")
def easydel_llama():
    # EasyDeL's attention defaults to bfloat16 (attn_dtype); float32 makes the comparison with ours exact to 1e-5
    config = ed.LlamaConfig(**TINY, attn_dtype=jnp.float32, attn_softmax_dtype=jnp.float32)
    return ed.LlamaForCausalLM(config=config, dtype=jnp.float32, param_dtype=jnp.float32, precision="highest",
                               rngs=nnx.Rngs(0))


def test_forward_matches_ours(easydel_llama):
    theirs = easydel_llama(input_ids=jnp.asarray(IDS)).logits
    mine = _ours_from(easydel_llama)(input_ids=jnp.asarray(IDS)).logits
    assert theirs.shape == mine.shape == (2, 8, TINY["vocab_size"])
    err = float(jnp.max(jnp.abs(theirs - mine)))
    assert err <= 1e-5, f"EasyDeL and eformer_nb logits differ by {err}"


@pytest.fixture(scope="module")
def trained_state(easydel_llama):
    "Five steps through EasyDeL's own path: `to_state`, `init_tx`, `compute_loss`, `apply_gradients`."
    state = easydel_llama.to_state().init_tx(optax.adam(1e-2))

    @jax.jit
    def step(state, ids):
        def loss_fn(graphstate):
            _, metrics = state.merge(graphstate).compute_loss(input_ids=ids, labels=ids)
            return metrics.loss
        loss, grads = jax.value_and_grad(loss_fn)(state.graphstate)
        return state.apply_gradients(grads=grads), loss

    losses = []
    for _ in range(5):
        state, loss = step(state, jnp.asarray(IDS))
        losses.append(float(loss))
    return state, losses


def test_five_training_steps(trained_state):
    state, losses = trained_state
    assert type(state).__name__ == "EasyDeLState" and int(state.step) == 5
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5, losses
    assert all(b < a for a, b in zip(losses, losses[1:])), f"loss did not fall at every step: {losses}"


def test_generation_matches_ours(trained_state):
    from transformers import GenerationConfig
    state, _ = trained_state
    model, prompt = state.model, jnp.asarray(IDS[:, :4])
    theirs = model.generate(prompt, generation_config=GenerationConfig(max_new_tokens=4, do_sample=False,
                                                                        eos_token_id=2, pad_token_id=0))
    mine = GenerationMixin.generate(_ours_from(model), prompt, OurGenerationConfig(max_new_tokens=4, eos_token_id=2,
                                                                      pad_token_id=0))
    assert np.asarray(theirs.sequences).shape == (2, 8)
    np.testing.assert_array_equal(np.asarray(theirs.sequences), np.asarray(mine.sequences))
    np.testing.assert_array_equal(np.asarray(theirs.sequences)[:, :4], IDS[:, :4])


def test_state_roundtrip_through_our_checkpointer(trained_state, tmp_path):
    "EasyDeL's training state (parameters and optimizer state) saved and restored by our Checkpointer."
    from eformer.serialization import Checkpointer  # the name EasyDeL imports, resolved to ours
    state, _ = trained_state
    ck = Checkpointer(base_path=str(tmp_path / "run"), save_interval=None, step_policies=[])
    tree = {"params": state.graphstate, "opt_state": state.opt_state}
    ck.save_pytree(tree, prefix="state", step=int(state.step))
    template = jax.tree.map(jnp.zeros_like, tree)
    restored, _ = ck.load_pytree(prefix="state", template=template, discover_latest=True)  # eformer: (tree, metadata)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    back = state.replace(graphstate=restored["params"], opt_state=restored["opt_state"])
    ids = jnp.asarray(IDS)
    np.testing.assert_array_equal(np.asarray(back.model(input_ids=ids).logits),
                                  np.asarray(state.model(input_ids=ids).logits))
    # the restored optimizer state keeps training exactly like the original
    up1, _ = state.tx.update(state.graphstate, state.opt_state, state.graphstate)
    up2, _ = back.tx.update(back.graphstate, back.opt_state, back.graphstate)
    for a, b in zip(jax.tree.leaves(up1), jax.tree.leaves(up2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_easydels_own_trainer(tmp_path):
    """EasyDeL's `Trainer` end to end on a tiny in-memory dataset: its TrainingArguments, its optimizer and scheduler
    (built by our OptimizerFactory through the alias), its data pipeline, sharded state and jitted step."""
    from datasets import Dataset
    from eformer_nb.optimizers import nonfinite_skips
    config = ed.LlamaConfig(**TINY, attn_dtype=jnp.float32, attn_softmax_dtype=jnp.float32)
    model = ed.LlamaForCausalLM(config=config, dtype=jnp.float32, param_dtype=jnp.float32, precision="highest",
                                rngs=nnx.Rngs(1))
    rows = (np.arange(48 * 16).reshape(48, 16) * 7) % TINY["vocab_size"]
    data = Dataset.from_dict({"input_ids": rows.tolist(), "attention_mask": np.ones_like(rows).tolist(),
                              "labels": rows.tolist()})

    def mean_loss(m):
        return float(np.mean([m.compute_loss(input_ids=jnp.asarray(b), labels=jnp.asarray(b))[1].loss
                              for b in np.split(rows, 6)]))

    before = mean_loss(model)
    args = ed.TrainingArguments(save_directory=str(tmp_path), total_batch_size=8, num_train_epochs=1,
                                max_training_steps=6, learning_rate=1e-2, optimizer="adamw", scheduler="none",
                                max_length=16, use_wandb=False, do_last_save=False, save_steps=None, report_steps=1,
                                log_steps=1, progress_bar_type="json", report_metrics=False)
    out = ed.Trainer(arguments=args, model=model, dataset_train=data).train()
    state = out.state
    assert type(state).__name__ == "EasyDeLState" and int(state.step) == 6  # 48 rows / 8 per step, one epoch
    assert nonfinite_skips(state.opt_state) == 0  # our non-finite guard is in EasyDeL's optimizer chain, unused
    after = mean_loss(state.model)
    assert np.isfinite(after) and after < before - 0.5, (before, after)


def test_easydel_save_state_and_load_state(trained_state, tmp_path):
    """EasyDeL's own save_state/load_state on our checkpoints: it adds its trees by prefix ('tx', then 'model') to a
    folder holding its own config.json and metadata.json; everything comes back bit-identical and its files stay."""
    state, _ = trained_state
    folder = tmp_path / "ckpt"
    state.save_state(str(folder))
    theirs = json.loads((folder / "metadata.json").read_text())  # EasyDeL's own file, written after our trees
    assert theirs["step"] == int(state.step) and (folder / "config.json").is_file()
    # the run-time settings EasyDeL does not store in config.json (it drops attn_dtype on save) are given again
    kw = dict(dtype=jnp.float32, param_dtype=jnp.float32, precision="highest", verbose=False, tx_template=state.tx,
              config_kwargs={"attn_dtype": jnp.float32, "attn_softmax_dtype": jnp.float32})
    back = ed.EasyDeLState.load_state(str(folder), **kw)
    assert int(back.step) == int(state.step)
    for name in ("graphstate", "opt_state"):
        a, b = jax.tree.leaves(getattr(state, name)), jax.tree.leaves(getattr(back, name))
        assert len(a) == len(b) > 0, name
        for x, y in zip(a, b):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ids = jnp.asarray(IDS)
    np.testing.assert_array_equal(np.asarray(back.model(input_ids=ids).logits),
                                  np.asarray(state.model(input_ids=ids).logits))
    # a second save_state over the same folder replaces our trees and leaves the folder loadable
    state.save_state(str(folder))
    again = ed.EasyDeLState.load_state(str(folder), **kw)
    for x, y in zip(jax.tree.leaves(state.graphstate), jax.tree.leaves(again.graphstate)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_partition_axis_is_ours(easydel_llama):
    "The model's sharding layout object is our PartitionAxis, as EasyDeL's config builds it."
    from eformer_nb.escale import PartitionAxis
    pa = easydel_llama.config.partition_axis
    assert isinstance(pa, PartitionAxis) and dataclasses.is_dataclass(pa)


def test_eformer_codec_functions_at_eformers_path():
    "eformer's codec functions, imported as an eformer user does (through the alias), on EasyDeL's jax."
    from eformer.ops.quantization.quantization_functions import (dequantize_int8, dequantize_nf4, pack_weights_1bit,
                                                                  quantize_and_pack_nf4, quantize_int8,
                                                                  unpack_weights_1bit)
    w = jnp.asarray(np.random.default_rng(0).normal(size=(4, 128)), jnp.float32)
    packed, absmax = quantize_and_pack_nf4(w, block_size=64)
    assert packed.shape == (4, 2, 32) and packed.dtype == jnp.uint8 and absmax.shape == (4, 2)
    back = dequantize_nf4(packed, absmax, 64)
    assert back.shape == w.shape and float(jnp.max(jnp.abs(back - w))) <= float(jnp.max(absmax)) * 0.16
    q, s = quantize_int8(w, axis=-1)
    assert q.dtype == jnp.int8 and s.shape == (4, 1)
    assert float(jnp.max(jnp.abs(dequantize_int8(q, s) - w))) <= float(jnp.max(s)) / 2 + 1e-7
    t = jnp.asarray(np.random.default_rng(1).integers(-1, 2, size=(8, 3)), jnp.int8)
    np.testing.assert_array_equal(np.asarray(unpack_weights_1bit(pack_weights_1bit(t), jnp.int8)), np.asarray(t))
