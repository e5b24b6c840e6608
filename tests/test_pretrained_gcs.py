"""`save_pretrained` re-saving a gs:// folder (fake-gcs-server): a failed re-save never loses the previous weights,
the config read is the one committed with the weights, and a second writer never destroys the first one's version.

Object stores have no rename, so on gs:// a save takes the folder's lock object, writes the new shards under fresh
names (`model-<8 hex>-0000i-of-0000N`), then `model.safetensors.index.json`, the commit (conditional on the index's
generation read under the lock, and recording the config), then `config.json`; only after the commit are the replaced
weight files removed. Each test injects a failure at one write of a re-save, or a second writer, and checks which
version `from_pretrained` loads, bit-exactly, and that the next save works and leaves only the files the index names."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save as st_save

import eformer_nb.infra.mixins.files as files
import eformer_nb.serialization.durable as durable
from eformer_nb.modules.llama import LlamaForCausalLM
from eformer_nb.modules.llama.configuration import LlamaConfig

pytestmark = pytest.mark.timeout(300)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
INDEX = files.WEIGHTS_INDEX_NAME


def _model(seed: int, **config):
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **config}), rngs=nnx.Rngs(seed))


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
    """Make the next re-save raise at `point`: the first or second shard write, the index write (the commit, whichever
    way it is written), or the config write."""

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
        real, real_if = files._write_blob, durable.write_json_if_generation
        monkeypatch.setattr(files, "_write_blob", lambda f, parts: (_ for _ in ()).throw(boom) if f.name == INDEX
                            else real(f, parts))
        monkeypatch.setattr(durable, "write_json_if_generation", lambda f, *a: (_ for _ in ()).throw(boom)
                            if f.name == INDEX else real_if(f, *a))  # the commit: DurableSave's commit_json
    else:
        raise ValueError(point)


@pytest.mark.parametrize("point", ["shard1", "shard2", "commit"])
@pytest.mark.parametrize("first_shards", ["5GB", "100KB"])
def test_gcs_pretrained_injected_failure_keeps_previous(gcs_root, monkeypatch, point, first_shards):
    """A failure at any write before the commit: the previous weights load bit-exactly and every previous object,
    config.json included, is byte-identical; the next save removes the crashed save's shards."""
    m1 = _model(1)
    m1.save_pretrained(gcs_root, max_shard_size=first_shards)
    (gcs_root / "notes.txt").write_text("mine")
    before = _objects(gcs_root)
    with monkeypatch.context() as m:
        _fail_at(point, m)
        with pytest.raises(OSError, match=f"injected failure at {point}"):
            _model(2).save_pretrained(gcs_root, max_shard_size="100KB")
    after = _objects(gcs_root)
    assert {k: after[k] for k in before} == before
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


FAR = dict(rope_theta=500.0)  # a config change that keeps every shape: the weights alone cannot tell it


def _config(root) -> dict:
    return json.loads((root / "config.json").read_text())


def _logits(model):
    import jax
    ids = jax.random.randint(jax.random.key(0), (2, 7), 0, TINY["vocab_size"])
    return np.asarray(model(input_ids=ids).logits)


@pytest.mark.parametrize("same_weights", [False, True])
def test_gcs_pretrained_failed_commit_keeps_the_old_config(gcs_root, monkeypatch, warnings_seen, same_weights):
    """A re-save with a shape-neutral config change (rope_theta) that fails at its index write, the commit: the old
    version loads bit-exactly with its old config (config.json byte-identical, no warning), as transformers reads it.
    (Before the fix config.json was written just before the index: the new rope_theta was read with the old weights.)"""
    m1, m2 = _model(1), _model(1 if same_weights else 2, **FAR)
    m1.save_pretrained(gcs_root, max_shard_size="100KB")
    config_before = (gcs_root / "config.json").read_bytes()
    with monkeypatch.context() as m:
        _fail_at("commit", m)
        with pytest.raises(OSError, match="injected failure at commit"):
            m2.save_pretrained(gcs_root, max_shard_size="100KB")
    assert (gcs_root / "config.json").read_bytes() == config_before
    back = LlamaForCausalLM.from_pretrained(str(gcs_root))
    assert back.config.rope_theta == m1.config.rope_theta != m2.config.rope_theta
    assert _bits(back) == _bits(m1) and np.array_equal(_logits(back), _logits(m1))
    assert warnings_seen == []


@pytest.mark.parametrize("same_weights", [False, True])
def test_gcs_pretrained_config_window_loads_the_committed_config(gcs_root, monkeypatch, warnings_seen, same_weights):
    """A re-save that stops between its commit and its config.json write (the one window left): config.json is still
    the old one (what a transformers reader sees), the index records the new config, and from_pretrained loads the
    committed pair, the new weights with the new config, bit-exactly, with a warning naming the folder and the key.
    The next save rewrites config.json and the warning is gone."""
    m1, m2 = _model(1), _model(1 if same_weights else 2, **FAR)
    m1.save_pretrained(gcs_root)
    config_before = (gcs_root / "config.json").read_bytes()
    with monkeypatch.context() as m:
        _fail_at("config", m)
        with pytest.raises(OSError, match="injected failure at config"):
            m2.save_pretrained(gcs_root)
    assert (gcs_root / "config.json").read_bytes() == config_before
    back = LlamaForCausalLM.from_pretrained(str(gcs_root))
    assert back.config.rope_theta == FAR["rope_theta"]
    assert _bits(back) == _bits(m2) and np.array_equal(_logits(back), _logits(m2))
    index = json.loads((gcs_root / INDEX).read_text())
    assert index["metadata"][files.CONFIG_KEY]["rope_theta"] == FAR["rope_theta"]
    assert len(warnings_seen) == 1 and str(gcs_root) in warnings_seen[0] and "'rope_theta'" in warnings_seen[0]
    m2.save_pretrained(gcs_root)
    assert _config(gcs_root)["rope_theta"] == FAR["rope_theta"] and _weights(gcs_root) == _indexed(gcs_root)
    warnings_seen.clear()
    assert _load_bits(gcs_root) == _bits(m2) and warnings_seen == []


def _lock(root):
    return root.parent / f".{root.name}.lock"


def test_gcs_pretrained_second_writer_is_refused(gcs_root):
    """Two writers of one gs:// folder, in two real threads: the second starts while the first is writing its shards.
    The second gets `CheckpointLockedError` naming the folder, before it writes anything; the first finishes, and its
    folder loads bit-exactly with every file its index names. (Before: the second's clean-up of fresh-named leftovers
    removed the first one's in-flight shard, and the first then committed an index naming it.)"""
    from eformer_nb.serialization.serialization import CheckpointLockedError

    _model(1).save_pretrained(gcs_root)
    first, second = _model(2), _model(3)
    in_flight, second_done, outcome = threading.Event(), threading.Event(), {}
    real = files._write_shard

    def paused(f, shard):
        real(f, shard)
        if threading.current_thread().name == "first" and not in_flight.is_set():
            in_flight.set()  # one shard written, the others still to come
            assert second_done.wait(120), "the second writer did not finish"

    def run(name, model):
        try:
            if name == "second":
                assert in_flight.wait(120), "the first writer did not start"
            model.save_pretrained(gcs_root, max_shard_size="100KB")
            outcome[name] = "saved"
        except Exception as e:  # noqa: BLE001  (the test reads it)
            outcome[name] = e
        finally:
            if name == "second":
                second_done.set()

    files._write_shard = paused
    try:
        threads = [threading.Thread(target=run, args=(n, m), name=n) for n, m in (("first", first), ("second", second))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
    finally:
        files._write_shard = real
    assert outcome["first"] == "saved", outcome
    assert _weights(gcs_root) == _indexed(gcs_root) and len(_indexed(gcs_root)) > 1
    assert _load_bits(gcs_root) == _bits(first) and not _lock(gcs_root).exists()
    err = outcome["second"]
    assert isinstance(err, CheckpointLockedError), outcome
    assert f"model folder {str(gcs_root)!r} is being saved by another writer" in str(err), str(err)


def test_gcs_pretrained_dead_writers_lock_is_named(gcs_root):
    "A lock object left by a writer that died refuses the next save, naming the object; once deleted, saves work."
    from eformer_nb.serialization.serialization import CheckpointLockedError

    m1 = _model(1)
    m1.save_pretrained(gcs_root)
    before = _objects(gcs_root)
    _lock(gcs_root).write_text("pid 1 on a-dead-host")
    with pytest.raises(CheckpointLockedError, match="pid 1 on a-dead-host.*delete that object"):
        _model(2).save_pretrained(gcs_root)
    assert _objects(gcs_root) == before and _load_bits(gcs_root) == _bits(m1)
    _lock(gcs_root).unlink()
    _model(2).save_pretrained(gcs_root)
    assert _load_bits(gcs_root) == _bits(_model(2))


@pytest.mark.parametrize("winner_config", ["other_weights", "same_weights_other_config"])
def test_gcs_pretrained_lock_broken_loser_fails_at_commit(gcs_root, winner_config):
    """A writer whose lock object is deleted mid-save (after its shards, before its commit) while another writer saves
    the folder whole: the first one's commit is refused (`CheckpointLockedError` naming the folder), it removes only
    shards it created that the winner does not name, so every object of the winner stays byte-identical and the
    winner's version loads bit-exactly. With the same weights the two writers' shards bear the same names: the loser
    must leave them. (Before: the loser committed its index over the winner's, naming shards the winner removed.)"""
    from eformer_nb.serialization.serialization import CheckpointLockedError

    _model(1).save_pretrained(gcs_root, max_shard_size="100KB")
    loser = _model(2)
    winner = _model(3) if winner_config == "other_weights" else _model(2, **FAR)
    n = len(files._shards(files.to_hf_state_dict(loser.split_params_dict()), files.parse_size("100KB")))
    real, calls, seen = files._write_shard, [], {}

    def race(f, shard):
        real(f, shard)
        calls.append(f.name)
        if len(calls) == n:  # the loser's shards are written, its commit is next
            seen["locked"] = _lock(gcs_root).exists()
            _lock(gcs_root).unlink(missing_ok=True)  # taken for a dead writer's
            t = threading.Thread(target=lambda: seen.update(err=_save(winner)))  # another writer: another thread
            files._write_shard = real
            t.start()
            t.join(240)
            seen["winner"] = _objects(gcs_root)

    def _save(model):
        try:
            model.save_pretrained(gcs_root, max_shard_size="100KB")
        except Exception as e:  # noqa: BLE001
            return e

    files._write_shard = race
    try:
        seen["loser"] = _save(loser)
    finally:
        files._write_shard = real
    assert seen.get("err") is None, seen
    assert _objects(gcs_root) == seen["winner"]  # nothing of the winner's removed, nothing of the loser's left
    assert _weights(gcs_root) == _indexed(gcs_root)
    assert _load_bits(gcs_root) == _bits(winner)
    assert LlamaForCausalLM.from_pretrained(str(gcs_root)).config.rope_theta == winner.config.rope_theta
    err = seen["loser"]
    assert isinstance(err, CheckpointLockedError), err
    msg = str(err)
    assert f"model folder {str(gcs_root)!r} was committed by another writer" in msg and INDEX in msg, msg
    assert seen["locked"] and not _lock(gcs_root).exists()
    _model(4).save_pretrained(gcs_root)  # and the next save works
    assert _load_bits(gcs_root) == _bits(_model(4)) and _weights(gcs_root) == _indexed(gcs_root)


def test_gcs_state_commit_lost_race_is_an_error_and_keeps_the_winner(gcs_root, monkeypatch):
    """11j's gs:// state commit is conditional on the state file's generation read when the save began: when another
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


def test_two_processes_save_pretrained_sharded(gcs_root, gcs_emulator, tmp_path):
    """Two real JAX processes (4 host devices each) hold one model sharded over all 8 devices and call save_pretrained
    together, to gs:// and to a local folder, then re-save another model in place over both: every version loads
    bit-exactly on each process. (A parameter spread over both processes is not fully addressable on either: this
    used to fail in jax.device_get.) Then `save_state`/`load_state` the same way (load_state used to place an unsharded
    state on the global device 0, which process 1 does not hold), and a restore onto process 0's device only."""
    import os
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    sys.path.insert(0, str(here))
    from serialization_worker import run_pair

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=str(here.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = lambda i: [gcs_emulator.url, str(gcs_root), str(tmp_path / "local")]  # noqa: E731
    for i, (rc, out) in enumerate(run_pair("multiprocess_pretrained", args, env, timeout=150)):
        assert rc == 0, f"process {i} failed:\n{out[-4000:]}"
        assert f"process {i}: save 1 loads bit-exactly from both" in out, out[-2000:]
        assert f"process {i}: save_state loads bit-exactly from both" in out, out[-2000:]
        assert f"process {i}: a leaf placed on another process's device restores" in out, out[-2000:]
    names = sorted(p.name for p in gcs_root.iterdir())
    assert INDEX in names and "config.json" in names and not [n for n in names if n.endswith(".lock")], names
