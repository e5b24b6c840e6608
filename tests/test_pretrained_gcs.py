"""`save_pretrained` re-saving a gs:// folder (fake-gcs-server): a failed re-save never loses the previous weights.

Object stores have no rename, so on gs:// the new shards go under fresh names (`model-<8 hex>-0000i-of-0000N`), then
`config.json`, then `model.safetensors.index.json`, the commit; only after it are the replaced weight files removed.
Each test injects a failure at one write of a re-save and checks which version `from_pretrained` loads, bit-exactly,
and that the next save works and leaves only the files the index names."""
from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save as st_save

import eformer_nb.modules.llama.files as files
from eformer_nb.modules.llama import LlamaForCausalLM
from eformer_nb.modules.llama.configuration import LlamaConfig

pytestmark = pytest.mark.timeout(300)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
INDEX = files.WEIGHTS_INDEX_NAME


def _model(seed: int):
    return LlamaForCausalLM(LlamaConfig(**TINY), rngs=nnx.Rngs(seed))


def _bits(model) -> dict:
    tensors = files.to_hf_state_dict(model.split_params_dict())
    return {k: (str(v.dtype), v.shape, v.tobytes()) for k, v in tensors.items()}


def _load_bits(root) -> dict:
    return _bits(LlamaForCausalLM.from_pretrained(str(root)))


def _objects(root) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.iterdir() if p.is_file()}


def _weights(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.endswith(".safetensors"))


def _indexed(root) -> list[str]:
    return sorted(set(json.loads((root / INDEX).read_text())["weight_map"].values()))


def test_gcs_pretrained_layout_roundtrip_and_resave(gcs_root):
    """The index layout even for one shard; a re-save with another shard count replaces every weight file."""
    m1, m2 = _model(1), _model(2)
    m1.save_pretrained(gcs_root)
    (one,) = _weights(gcs_root)
    assert files._FRESH_SHARD.match(one) and _indexed(gcs_root) == [one]
    assert sorted(p.name for p in gcs_root.iterdir()) == sorted(["config.json", INDEX, one])
    assert _load_bits(gcs_root) == _bits(m1)
    m2.save_pretrained(gcs_root, max_shard_size="100KB")
    assert len(_weights(gcs_root)) > 1 and _weights(gcs_root) == _indexed(gcs_root) and one not in _weights(gcs_root)
    assert _load_bits(gcs_root) == _bits(m2)
    m1.save_pretrained(gcs_root)  # back to one shard: the same tensors give the same name as the first save
    assert _weights(gcs_root) == _indexed(gcs_root) == [one] and _load_bits(gcs_root) == _bits(m1)


def _fail_at(point: str, monkeypatch) -> None:
    "Make the next re-save raise at `point`: the first or second shard write, the config write, the commit."
    boom = OSError(28, f"injected failure at {point}")
    calls = []

    def shard(real, k):
        def f(*a, **kw):
            calls.append(1)
            if len(calls) == k:
                raise boom
            return real(*a, **kw)
        return f

    if point in ("shard1", "shard2"):
        monkeypatch.setattr(files, "_write_shard", shard(files._write_shard, int(point[-1])))
    elif point == "config":
        monkeypatch.setattr(files, "_write_config", lambda *a: (_ for _ in ()).throw(boom))
    elif point == "commit":
        real = files._write_blob
        monkeypatch.setattr(files, "_write_blob", lambda f, parts: (_ for _ in ()).throw(boom) if f.name == INDEX
                            else real(f, parts))
    else:
        raise ValueError(point)


@pytest.mark.parametrize("point", ["shard1", "shard2", "config", "commit"])
@pytest.mark.parametrize("first_shards", ["5GB", "100KB"])
def test_gcs_pretrained_injected_failure_keeps_previous(gcs_root, monkeypatch, point, first_shards):
    """A failure at any write before the commit: the previous weights load bit-exactly and every previous weight
    object and the index are byte-identical; the next save removes the crashed save's shards."""
    m1 = _model(1)
    m1.save_pretrained(gcs_root, max_shard_size=first_shards)
    (gcs_root / "notes.txt").write_text("mine")
    before = _objects(gcs_root)
    with monkeypatch.context() as m:
        _fail_at(point, m)
        with pytest.raises(OSError, match=f"injected failure at {point}"):
            _model(2).save_pretrained(gcs_root, max_shard_size="100KB")
    after = _objects(gcs_root)
    assert {k: after[k] for k in before if k != "config.json"} == {k: v for k, v in before.items()
                                                                   if k != "config.json"}
    if point != "commit":  # the config is written just before the commit
        assert after["config.json"] == before["config.json"]
    assert all(files._FRESH_SHARD.match(k) for k in set(after) - set(before))
    assert len(set(after) - set(before)) == {"shard1": 0, "shard2": 1}.get(point, len(set(after) - set(before)))
    assert _load_bits(gcs_root) == _bits(m1)
    m3 = _model(3)
    m3.save_pretrained(gcs_root)
    assert _weights(gcs_root) == _indexed(gcs_root) and len(_weights(gcs_root)) == 1
    assert _load_bits(gcs_root) == _bits(m3) and (gcs_root / "notes.txt").read_text() == "mine"


def test_gcs_pretrained_failure_after_commit_loads_the_new_one(gcs_root, monkeypatch):
    "A failure while the replaced files are removed: the new weights are committed and load; the next save cleans."
    _model(1).save_pretrained(gcs_root, max_shard_size="100KB")
    old = _weights(gcs_root)
    with monkeypatch.context() as m:
        boom = OSError("injected failure at drop")
        m.setattr(files, "_drop_replaced_weights", lambda *a: (_ for _ in ()).throw(boom))
        with pytest.raises(OSError, match="at drop"):
            _model(2).save_pretrained(gcs_root)
    assert set(old) < set(_weights(gcs_root)) and _load_bits(gcs_root) == _bits(_model(2))
    _model(3).save_pretrained(gcs_root)
    assert _weights(gcs_root) == _indexed(gcs_root) and len(_weights(gcs_root)) == 1
    assert _load_bits(gcs_root) == _bits(_model(3))


def test_gcs_pretrained_replaces_only_ours(gcs_root, tmp_path):
    """A `model.safetensors` of ours (what the older in-place save wrote) is replaced; one of another writer is
    refused before anything is written; a user's file and a shard no index names and not fresh-named stay."""
    m1 = _model(1)
    m1.save_pretrained(tmp_path / "flat")
    for f in (tmp_path / "flat").iterdir():
        (gcs_root / f.name).write_bytes(f.read_bytes())
    (gcs_root / "model-00001-of-00009.safetensors").write_bytes(st_save({"x": np.zeros(2, np.float32)}))
    assert _load_bits(gcs_root) == _bits(m1)
    _model(2).save_pretrained(gcs_root)
    assert "model.safetensors" not in _weights(gcs_root) and "model-00001-of-00009.safetensors" in _weights(gcs_root)
    assert _load_bits(gcs_root) == _bits(_model(2))
    foreign = st_save({"x": np.ones(2, np.float32)})
    (gcs_root / "model.safetensors").write_bytes(foreign)
    before = _objects(gcs_root)
    with pytest.raises(FileExistsError, match="was not written by save_pretrained"):
        _model(3).save_pretrained(gcs_root)
    assert _objects(gcs_root) == before


def test_gcs_state_commit_lost_race_is_an_error_and_keeps_the_winner(gcs_root, monkeypatch):
    """13a's gs:// state commit is conditional on the state file's generation read when the save began: when another
    writer commits in between (here: its lock object deleted mid-save, then a whole save of another state), ours is a
    `CheckpointLockedError` naming the folder, removes only its own version folder, and the winner's state loads."""
    import sys
    from pathlib import Path

    import optax

    import eformer_nb.infra.base_state as bs
    from eformer_nb.infra.base_state import EasyDeLState
    from eformer_nb.serialization.serialization import CheckpointLockedError

    sys.path.insert(0, str(Path(__file__).parent))
    from serialization_worker import TX_LR, state_of

    def bits(state):
        return [np.asarray(x).tobytes() for x in __import__("jax").tree.leaves((state.graphstate, state.opt_state))]

    state_of(1).save_state(gcs_root, verbose=False)
    real, raced = bs._write_state, []

    def write_then_race(*a, **k):
        out = real(*a, **k)
        if not raced:  # once, between our version folder's files and our commit
            raced.append(1)
            (gcs_root.parent / f".{gcs_root.name}.lock").unlink()
            state_of(3).save_state(gcs_root, verbose=False)
        return out
    monkeypatch.setattr(bs, "_write_state", write_then_race)
    with pytest.raises(CheckpointLockedError, match=f"{gcs_root}.*committed by another writer"):
        state_of(2).save_state(gcs_root, verbose=False)
    winner = json.loads((gcs_root / bs.STATE_FILE).read_text())["dir"]
    assert sorted(p.name for p in gcs_root.iterdir() if bs._VERSION_DIR.fullmatch(p.name)) == [winner]
    loaded = EasyDeLState.load_state(gcs_root, tx=optax.adam(TX_LR), verbose=False)
    assert int(loaded.step) == 3 and bits(loaded) == bits(state_of(3))


@pytest.mark.parametrize("shards", ["5GB", "100KB"])
def test_gcs_pretrained_folder_loads_in_transformers(gcs_root, tmp_path, shards):
    "A copy of a re-saved gs:// folder (index layout, fresh shard names) loads in transformers with our tensors."
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    _model(1).save_pretrained(gcs_root)
    m2 = _model(2)
    m2.save_pretrained(gcs_root, max_shard_size=shards)
    for name, blob in _objects(gcs_root).items():
        (tmp_path / name).write_bytes(blob)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    want = files.to_hf_state_dict(m2.split_params_dict())
    got = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    assert all(np.array_equal(got[k], v) for k, v in want.items())
