"""Subprocess bodies for tests/test_hosts.py (run as `python hosts_worker.py MODE PORT PID DIR`): two JAX processes
(4 host CPU devices each, gloo collectives) on 127.0.0.1 with the demo's two-process mesh `fsdp:4,tp:2`.

`save_then_die PORT PID DIR`: both save checkpoint 2 of a tree sharded over all 8 devices and print its digest; then
both start checkpoint 4, and process 1 SIGKILLs itself as soon as the new checkpoint's first entry appears under DIR
(its write has begun, nothing is committed); process 0 exits
`GIVE_UP_S` later.
`restore PORT PID DIR`: both restore the latest checkpoint under DIR and print its step and digest.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np

GIVE_UP_S = 20  # process 0 gives up on checkpoint 4 this long after starting it


def tree_of(step: int, mesh) -> dict:
    "A tree like the demo's checkpoint: float32 weights sharded over fsdp and tp, a step counter (replicated)."
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    values = np.random.default_rng(step).standard_normal((512, 256)).astype(np.float32)
    w = jax.make_array_from_callback(values.shape, NamedSharding(mesh, P("fsdp", "tp")), lambda idx: values[idx])
    return {"w": w, "step": jax.device_put(np.int32(step), NamedSharding(mesh, P()))}


def join(port: int, pid: int):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from eformer_nb.demo import demo_mesh
    from eformer_nb.executor import DistributedConfig

    DistributedConfig(f"127.0.0.1:{port}", 2, pid, initialization_timeout_s=120).initialize()
    assert jax.process_count() == 2 and jax.device_count() == 8, (jax.process_count(), jax.device_count())
    return demo_mesh("fsdp:4,tp:2")


def die_when_a_new_entry_appears(root: str, before: set) -> None:
    "SIGKILL this process as soon as an entry not in `before` appears under `root` (polled every millisecond)."
    def watch():
        while not set(os.listdir(root)) - before:
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, daemon=True).start()


def save_then_die(port: int, pid: int, root: str) -> None:
    from eformer_nb.demo import state_digest
    from eformer_nb.serialization import Checkpointer

    mesh = join(port, pid)
    ckpt = Checkpointer(root, save_interval=None)
    ckpt.save_checkpoint(tree_of(2, mesh), step=2)
    print(f"saved 2 {state_digest(tree_of(2, mesh))}", flush=True)
    if pid == 1:
        die_when_a_new_entry_appears(root, set(os.listdir(root)))
    else:  # process 0 waits in the save for a peer that is gone (JAX would end it after its 100 s heartbeat timeout)
        def give_up():
            print(f"gave up on 4 after {GIVE_UP_S} s", flush=True)
            os._exit(1)
        threading.Timer(GIVE_UP_S, give_up).start()
    ckpt.save_checkpoint(tree_of(4, mesh), step=4)
    print("saved 4", flush=True)  # neither process may get here: process 1 dies, process 0 waits for it


def restore(port: int, pid: int, root: str) -> None:
    import jax

    from eformer_nb.demo import state_digest
    from eformer_nb.serialization import Checkpointer

    mesh = join(port, pid)
    ckpt = Checkpointer(root, save_interval=None)
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree_of(0, mesh))
    back = ckpt.load_checkpoint(template=template)
    print(f"restored {ckpt.latest_step()} {int(back['step'])} {state_digest(back)}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    mode, port, pid, root = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if mode not in ("save_then_die", "restore"):
        sys.exit(f"unknown mode {mode!r}; expected save_then_die or restore")
    {"save_then_die": save_then_die, "restore": restore}[mode](port, pid, root)
