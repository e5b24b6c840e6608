"""`save_pretrained` into a local folder when a write fails part-way: the previous version is never lost.

One process saving locally writes a fresh `.partial` folder beside the target, `config.json` last, and swaps it in
whole; a failure at any write (half the tensors written, or the config) leaves the previous folder byte-identical and
the user's own files (a tokenizer) survive every save. Several processes (and gs://) write in place instead
(`_write_committed`): new shards under fresh names, then the index, the commit, then `config.json`; these tests run
that path on a local folder (the same failures on gs:// are in `test_pretrained_gcs.py`): a failed commit leaves
every previous file byte-identical, and a save that stops between its commit and its `config.json` write loads the
committed config with a warning. Each failure is injected with `monkeypatch` at one write of the module."""
from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx

import eformer_nb.infra.mixins.files as files
import eformer_nb.serialization.durable as durable
from eformer_nb.modules.llama import LlamaForCausalLM
from eformer_nb.modules.llama.configuration import LlamaConfig
from eformer_nb.paths import ePath

pytestmark = pytest.mark.timeout(300)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
FAR = dict(rope_theta=500.0)  # a config change that keeps every shape: the weights alone cannot tell it


def _model(seed: int = 0, **config):
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **config}), rngs=nnx.Rngs(seed))


_forward = nnx.jit(lambda m, ids: m(input_ids=ids).logits)  # compiled once for every model of this config


def _logits(model):
    ids = np.arange(14, dtype=np.int32).reshape(2, 7) * 17 % TINY["vocab_size"]
    return np.asarray(_forward(model, ids))


def _contents(d: ePath) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir()}


def _state(model) -> dict:
    return files.to_hf_state_dict(model.split_params_dict())


def _fail(monkeypatch, name: str, err: OSError) -> None:
    "Make `files.<name>` raise `err`."
    monkeypatch.setattr(files, name, lambda *a, **kw: (_ for _ in ()).throw(err))


def test_local_overwrite_failing_half_way_keeps_the_previous_folder(tmp_path, monkeypatch):
    """An overwrite that fails after writing part of the tensors leaves the previous folder byte-identical (the
    user's tokenizer.json included) and no `.partial` folder the next save trips on; the next save keeps the user's
    file and removes the marker."""
    model = _model()
    d = model.save_pretrained(tmp_path / "m")
    (d / "tokenizer.json").write_text("{}")
    before = _contents(d)
    real_write = files._write_files

    def half_then_full(model, work, tensors, size):
        real_write(model, work, dict(list(tensors.items())[:1]), size)
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(files, "_write_files", half_then_full)
        with pytest.raises(OSError, match="No space left on device"):
            model.save_pretrained(d, float_dtype="bfloat16")
    assert _contents(d) == before
    assert np.array_equal(_logits(LlamaForCausalLM.from_pretrained(d)), _logits(model))
    model.save_pretrained(d, max_shard_size="100KB")
    assert (d / "tokenizer.json").read_text() == "{}"
    assert not (d / ".eformer_nb").exists() and not ePath(f"{tmp_path}/m.partial").exists()


def test_local_config_write_failure_keeps_the_previous_folder(tmp_path, monkeypatch):
    """A local folder saved by one process has no config window: config.json is the last file written into the
    `.partial` folder, and the folder is swapped in whole; a failure at the config write of a shape-neutral change
    (rope_theta) leaves the previous folder as it was, and it loads with its own config and weights."""
    model = _model()
    d = model.save_pretrained(tmp_path / "m")
    before = _contents(d)
    with monkeypatch.context() as m:
        _fail(m, "_write_config", OSError(5, "Input/output error"))
        with pytest.raises(OSError, match="Input/output error"):
            _model(**FAR).save_pretrained(d)
    assert _contents(d) == before
    back = LlamaForCausalLM.from_pretrained(d)
    assert back.config.rope_theta == model.config.rope_theta != FAR["rope_theta"]
    assert np.array_equal(_logits(back), _logits(model))


def test_in_place_failed_commit_keeps_the_previous_version(tmp_path, monkeypatch):
    """The in-place save (several processes, gs://) on a local folder: a commit (the index write) that fails after the
    new shards are written leaves every previous file byte-identical, config.json included, and only fresh-named
    shards beside them; the previous version loads bit-exactly, and the next save removes the crashed one's shards."""
    model = _model()
    d, sd = ePath(tmp_path) / "m", _state(model)
    assert files._write_committed(model, d, sd, "5GB") == 1
    before = _contents(d)
    with monkeypatch.context() as m:
        # the commit (DurableSave's one commit_json of the index) fails
        full = OSError(28, "No space left on device")
        m.setattr(durable, "commit_json", lambda *a, **kw: (_ for _ in ()).throw(full))
        with pytest.raises(OSError, match="No space left"):
            files._write_committed(model, d, files.to_hf_state_dict(model.split_params_dict(), "bfloat16"), "100KB")
    after = _contents(d)
    assert {k: after[k] for k in before} == before  # config.json included: it is written after the commit
    assert set(after) - set(before) and all(files._FRESH_SHARD.match(k) for k in set(after) - set(before))
    assert np.array_equal(_logits(LlamaForCausalLM.from_pretrained(d)), _logits(model))  # the previous version
    n = files._write_committed(model, d, sd, "100KB")  # removes the crashed save's shards and the old one
    index = json.loads((d / files.WEIGHTS_INDEX_NAME).read_text())
    assert sorted(p.name for p in d.glob("model*.safetensors")) == sorted(set(index["weight_map"].values()))
    assert n > 1 and len(list(d.glob("model*.safetensors"))) == n
    assert np.array_equal(_logits(LlamaForCausalLM.from_pretrained(d)), _logits(model))


def test_in_place_config_window_loads_the_committed_config(tmp_path, monkeypatch, warnings_seen):
    """The one window of the in-place save: it stops between its commit and its config.json write. With a
    shape-neutral change (rope_theta) of a model with the very same weights (so the same shard names), the index
    commits the new config while config.json (what transformers reads) still holds the old one; from_pretrained loads
    the committed config, with a warning naming the folder and the key; `config_kwargs=` still overrides it; a missing
    config.json is read the same way; the next save repairs the folder and the warning is gone."""
    model, far = _model(), _model(**FAR)
    d = ePath(tmp_path) / "m"
    files._write_committed(model, d, _state(model), "5GB")
    old_config = (d / "config.json").read_bytes()
    ours, theirs = _state(model), _state(far)
    assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)
    assert not np.allclose(_logits(far), _logits(model))  # same weights, another model
    with monkeypatch.context() as m:
        _fail(m, "_write_config", OSError(5, "Input/output error"))
        with pytest.raises(OSError, match="Input/output error"):
            files._write_committed(far, d, theirs, "5GB")
    assert (d / "config.json").read_bytes() == old_config
    back = LlamaForCausalLM.from_pretrained(d)
    assert back.config.rope_theta == FAR["rope_theta"]  # the committed config, not config.json's
    assert np.array_equal(_logits(back), _logits(far))
    assert len(warnings_seen) == 1 and str(d) in warnings_seen[0] and "'rope_theta'" in warnings_seen[0], warnings_seen
    assert LlamaForCausalLM.from_pretrained(d, config_kwargs={"rope_theta": 20.0}).config.rope_theta == 20.0
    (d / "config.json").unlink()
    warnings_seen.clear()
    assert LlamaForCausalLM.from_pretrained(d).config.rope_theta == FAR["rope_theta"]
    assert "config.json is missing or not JSON" in warnings_seen[0], warnings_seen
    files._write_committed(far, d, theirs, "5GB")  # the next save repairs it
    warnings_seen.clear()
    assert np.array_equal(_logits(LlamaForCausalLM.from_pretrained(d)), _logits(far)) and warnings_seen == []
