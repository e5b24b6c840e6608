"""escale decisions are the same in every process: hosts of a pod must pick the same specs without talking.

Each case runs in fresh interpreters with different PYTHONHASHSEED values (set and dict-of-str iteration
orders change with the seed), on 8 host CPU devices, and the printed decisions must be identical."""
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import jax
from eformer_nb.common_types import *
from jax.sharding import PartitionSpec as P, AbstractMesh, AxisType
from eformer_nb.escale import (PartitionAxis, PartitionManager, correct_partition_spec, auto_partition_spec,
                               match_partition_rules, create_mesh, MeshPartitionHelper)
import numpy as np

out = []
sizes = {"dp": 2, "fsdp": 4, "tp": 4, "sp": 2, "ep": 1}
for shape in [(6, 14), (12, 3, 8), (2, 8), (1, 24, 10), (16, 16, 16)]:
    for spec in [P(("fsdp", "dp"), "tp"), P(("tp", "dp", "fsdp"), None), P("sp", ("tp", "fsdp"), "dp"), P("ep", "zz")]:
        spec = P(*list(spec)[:len(shape)])
        try:  # 'zz' is not in the mesh: an error, with the same message everywhere
            out.append(str(correct_partition_spec(shape, spec, sizes)))
        except ValueError as e:
            out.append(f"ValueError: {e}")
am = AbstractMesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))
for shape in [(1024, 4096), (4096, 4096), (6, 10), (64, 3), (48, 48, 48)]:
    out.append(str(auto_partition_spec(shape, am, min_sharding_size=1)))
PartitionAxis.register("__CUSTOM__", ["head_axis", "sp"])
pm = PartitionManager(PartitionAxis())
for preset in [HiddenStateSharding, AttnQSharding, AttnKVSharding, ColumnWise, RowWise, ExpertColumnWiseAlt]:
    out.append(str(pm.resolve(preset, shape=(4, 1, 8, 8)[:len(preset.axes)])))
out.append(str(pm.resolve([BATCH, "__CUSTOM__"], MODE_DECODE)))
rules = [("kernel", P("fsdp", "tp")), ("bias", P()), (".*", P())]
tree = {f"layer{i}": {"kernel": np.zeros((8, 8)), "bias": np.zeros(8)} for i in range(5)}
out.append(str([(jax.tree_util.keystr(k), str(v)) for k, v in jax.tree_util.tree_leaves_with_path(match_partition_rules(rules, tree))]))
mesh = create_mesh((2, -1, 1, 2, 1))
out.append(str(MeshPartitionHelper(mesh).propose_specs({"a": np.zeros((64, 32)), "b": np.zeros((30, 16))})))
out.append(str([d.id for d in mesh.devices.flat]))
print("\n".join(out))
"""


def _run(seed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=seed, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               EFORMER_NB_LOG_LEVEL="ERROR")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.timeout(600)
def test_decisions_are_identical_across_processes():
    outputs = [_run(seed) for seed in ("0", "1", "12345")]
    assert outputs[0].count("\n") > 30
    assert outputs[0] == outputs[1] == outputs[2]
