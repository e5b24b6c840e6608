"""Damage a saved checkpoint and a saved training state at random, and restore: every case is either a bit-exact restore
or a clear error, never a wrong value.

hypothesis picks, per case, one file of the saved folder (`index.json`, `metadata.json`, each array's `zarr.json`, each
chunk, the marker; for the state also `config.json`, `model.safetensors`, `easydel_state.json` and the optimizer's
tree) and one damage: flip one byte (XOR with a non-zero value at a random offset), truncate the file to a random
length, or delete it. The damaged copy is then restored with the ordinary entry points (`CheckpointManager.load`,
`EasyDeLState.load_state(tx=...)`).

A "clear error" is one of the checkpoint errors (`CorruptCheckpointError`, `TornCheckpointError`,
`CheckpointNotFoundError`) or another `ValueError`/`OSError` whose message names the damaged folder; anything else (a
`KeyError`, a `UnicodeDecodeError` without a path...) fails the test, and so does a restore that returns other bytes
than were saved. Runs are derandomized: the same cases every time. The counts per outcome are printed."""
from __future__ import annotations

import collections
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eformer_nb.serialization import CheckpointManager
from eformer_nb.serialization.serialization import CheckpointNotFoundError, CorruptCheckpointError, TornCheckpointError

pytestmark = pytest.mark.timeout(900)
CKPT_CASES, STATE_CASES = 200, 200
CLEAR = (CorruptCheckpointError, TornCheckpointError, CheckpointNotFoundError)
DAMAGES = ("flip", "truncate", "delete")


def _bits(tree):
    import jax

    return jax.tree.map(lambda x: (type(x).__name__, str(x.dtype), np.shape(x), np.asarray(x).tobytes())
                        if hasattr(x, "dtype") else (type(x).__name__, repr(x)), tree)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _damage(root: Path, data: st.DataObject) -> str:
    "Apply one drawn damage to one drawn file under `root`; returns what was done."
    rnd = data.draw(st.randoms(use_true_random=False), label="rng")  # uniform: st.integers favours small values
    name = rnd.choice(_files(root))
    path, damage = root / name, rnd.choice(DAMAGES)
    size = path.stat().st_size
    if damage == "delete" or size == 0:
        path.unlink()
        return f"delete {name}"
    if damage == "truncate":
        n = rnd.randrange(size)
        with open(path, "r+b") as f:
            f.truncate(n)
        return f"truncate {name} to {n} of {size}"
    offset, xor = rnd.randrange(size), rnd.randrange(1, 256)
    blob = bytearray(path.read_bytes())
    blob[offset] ^= xor
    path.write_bytes(bytes(blob))
    return f"flip {name}[{offset}] ^= {xor:#x}"


def _judge(done: str, restore, want, where: Path, outcomes: collections.Counter) -> None:
    "Restore; a bit-exact value or a clear error naming `where` passes, anything else fails with `done` in the message."
    try:
        got = restore()
    except CLEAR as e:
        outcomes[type(e).__name__] += 1
        return
    except (ValueError, OSError) as e:
        assert str(where) in str(e), f"{done}: {type(e).__name__} does not name the folder: {e}"
        outcomes[type(e).__name__] += 1
        return
    assert got == want, f"{done}: the restore returned other values than were saved"
    outcomes["bit-exact"] += 1


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    import jax.numpy as jnp

    base = tmp_path_factory.mktemp("corrupt-ckpt") / "run"
    rng = np.random.default_rng(7)
    tree = {"w": rng.standard_normal((96, 64)).astype(np.float32), "ids": rng.integers(0, 2**40, (32, 40)),
            "h": jnp.asarray(rng.standard_normal((48, 48)), jnp.bfloat16), "small": np.arange(5, dtype=np.int16),
            "lr": 3e-4, "name": "run-7", "step": 1}
    CheckpointManager(base).save(tree, 1, extras={"loss": 1.25})
    return base, _bits(tree)


@settings(max_examples=CKPT_CASES, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_damaged_checkpoint_restores_exactly_or_fails_clearly(saved_checkpoint, tmp_path_factory, data):
    base, want = saved_checkpoint
    work = Path(tmp_path_factory.mktemp("case")) / "run"
    shutil.copytree(base, work)
    done = _damage(work / "step-1", data)
    DAMAGED[done.split()[1].split("[")[0]] += 1
    _judge(done, lambda: _bits(CheckpointManager(work, clean=False).load(1)), want, work, OUTCOMES["checkpoint"])
    shutil.rmtree(work.parent)


@pytest.fixture(scope="module")
def saved_state(tmp_path_factory):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from serialization_worker import state_of

    folder = tmp_path_factory.mktemp("corrupt-state") / "state"
    state = state_of(5)
    state.save_state(folder, verbose=False)
    return folder, _state_bits(state)


def _state_bits(state) -> tuple:
    return int(state.step), _bits(state.graphstate), _bits(state.opt_state)


@settings(max_examples=STATE_CASES, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_damaged_state_restores_exactly_or_fails_clearly(saved_state, tmp_path_factory, data):
    import optax

    from eformer_nb.infra.base_state import EasyDeLState
    from serialization_worker import TX_LR

    folder, want = saved_state
    work = Path(tmp_path_factory.mktemp("case")) / "state"
    shutil.copytree(folder, work)
    done = _damage(work, data)
    DAMAGED[done.split()[1].split("[")[0]] += 1
    load = lambda: _state_bits(EasyDeLState.load_state(work, tx=optax.adam(TX_LR), verbose=False))  # noqa: E731
    _judge(done, load, want, work, OUTCOMES["state"])
    shutil.rmtree(work.parent)


OUTCOMES: dict[str, collections.Counter] = {"checkpoint": collections.Counter(), "state": collections.Counter()}
DAMAGED: collections.Counter = collections.Counter()  # how often each file was damaged


def test_corruption_matrix_counts():
    "Runs last (file order): prints the outcome counts of the two tests above and checks that they ran in full."
    for what, counts in OUTCOMES.items():
        print(f"{what}: {sum(counts.values())} cases: {dict(counts)}")
    print(f"{len(DAMAGED)} distinct files damaged, the most often: {DAMAGED.most_common(4)}")
    if os.environ.get("PYTEST_XDIST_WORKER") is None and all(OUTCOMES.values()):
        assert sum(OUTCOMES["checkpoint"].values()) >= CKPT_CASES and sum(OUTCOMES["state"].values()) >= STATE_CASES
        assert OUTCOMES["checkpoint"]["bit-exact"] > 0 and len(OUTCOMES["checkpoint"]) > 1
