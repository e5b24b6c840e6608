"""Behaviours that differ between the jax releases we support (settings.ini: jax>=0.9.2,<0.12).

`make pytest` runs this on .venv's jax (0.10 on Python 3.11), `make gpu-lower` on jax 0.11.2 (Python 3.12,
.venv-jax011), and `make client` on EasyDeL's pinned jax 0.9.2 (.venv-client).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from eformer_nb.common_types import EMPTY_VAL, NOT_GIVEN
from eformer_nb.pytree import auto_pytree, field


def test_auto_pytree_init_false_field_on_this_jax():
    # jax 0.9.2's register_dataclass unpacked each drop_fields name into characters: the init=False field `count`
    # dropped the data field `n` ("Unexpected fields: {'n'}") when auto_pytree passed drop_fields
    @auto_pytree
    class Block:
        n: jax.Array
        name: str = field(pytree_node=False, default="b")
        count: int = dataclasses.field(init=False, default=0)

        def __post_init__(self):
            self.count = int(self.n.size)

    b = jax.tree.map(lambda a: jnp.concatenate([a, a]), Block(jnp.ones(3)))
    assert (b.count, b.name, b.n.shape) == (6, "b", (6,))
    assert Block.__pytree_meta__ == {"data_fields": ("n",), "meta_fields": ("name",), "frozen": False}
    out = jax.jit(lambda blk: blk.n * 2)(b)
    np.testing.assert_array_equal(np.asarray(out), np.full(6, 2.0, np.float32))


def test_sentinel_is_eformers_class_and_instance():
    assert isinstance(NOT_GIVEN, EMPTY_VAL) and isinstance(EMPTY_VAL, type) and bool(NOT_GIVEN)
    assert not isinstance("__train__", EMPTY_VAL)
