"""`make bench-check`: do the saved benchmark pages hold up? (issue 28)

For every page: each judged row of its saved verdict table is re-judged from its own interval under the current rule
(`eformer_nb.benchmarking.verdict`). For the cheap pages (CI): the headline comparison is re-run briefly (a few
interleaved rounds) and its fresh verdict compared with the saved one. A miss the saved page did not call (a saved "met"
or "too noisy" whose own interval, or the fresh run, says "missed") fails. A saved honest miss (its interval wholly
outside the target) is printed as a miss and does not fail: the page states it. A fresh "met" against a saved miss is
printed as a note (re-run the page), and a fresh "too noisy to judge" contradicts nothing.

The re-runs pin the pages' thread budget first (`pin_threads(THREADS)`, before jax starts), so they time what the
pages timed.

    python tests/bench_check.py [PAGE ...]      # default: the cheap pages; `all` for every page
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import numpy as np  # noqa: E402

from eformer_nb.benchmarking import (MET, MISSED, Comparison, Target, disagreements, drop_page_cache,  # noqa: E402
                                     format_threads, interleaved_times, pin_threads, saved_rows, verdict)

ROOT = Path(__file__).resolve().parents[1] / "nbs" / "benchmarks"
ROUNDS = 7
THREADS = 1  # the pages' budget: Bench(..., threads=1)
TARGETS = {  # page -> {label: target}, as each page judges them
    "optimizers": {"adamw, default non-finite guard vs optax": Target("<=", 1.05),
                   "kron": Target("<=", 1.25), "mars(gamma=0) vs adam": Target("<=", 1.25), "mars": Target("<=", 1.25)},
    "escale": {"run time, compiled (64,256,512)": Target("<=", 1.05)},
    "quantization": {"NF4 GEMV M=1 vs fp32 dense (jax)": Target("<=", 2.0),
                     "NF4 quantize 4096² ours vs bnb": Target("<=", 1.0, margin=0.10),
                     "NF4 GEMM M=4096 vs fp32 dense": Target("<=", 1.05)},
    "pytree_serialization": {"round trip 256 MiB, ours vs flax": Target("<=", 1.0, margin=0.10)},
    "state": {"train step: apply_gradients vs hand-written": Target("<=", 1.02),
              "save_state + load_state vs checkpoint layer": Target("<=", 1.1),
              "save_state + load_state vs safetensors + fsync + sha256": Target("<=", 1.1)},
    "serialization": {"save 1 GiB, ours vs np": Target("<=", 1.1),
                      "restore from disk 1 GiB, ours vs np": Target("<=", 1.3)},
    "models": {"train step value_and_grad 4x128 vs plain function": Target("<=", 1.05),
               "QLoRA step 1x64 SmolLM2-135M (NF4, LoRA) vs nnx+optax": Target("<=", 1.1),
               "prefill 1x512 SmolLM2-135M vs transformers": Target("<=", 1.0, margin=0.10),
               "generate 1x(64+128) SmolLM2-135M vs transformers": Target("<=", 1 / 1.5),
               "generate 8x(64+128) SmolLM2-135M vs transformers": Target("<=", 1 / 1.5)},
    "executor": {"100 tiny tasks: execute vs ray.remote": Target("<=", 1.2)},
}
CHEAP = ("optimizers", "escale", "quantization", "pytree_serialization", "serialization")


def _compare(label: str, ours, peer, rounds: int = ROUNDS, repeat: int = 1) -> Comparison:
    "ours, peer, ours again in interleaved rounds; each call runs `repeat` times (seconds per call)."
    many = [lambda f=f: [f() for _ in range(repeat)][-1] for f in (ours, peer, ours)]
    t = interleaved_times(many, rounds=rounds, warmup=1) / repeat
    return Comparison(label, ours=t[:, 0], peer=t[:, 1], again=t[:, 2])


def fresh_optimizers() -> dict[str, Comparison]:
    "The page's guard row, as the page runs it: the same MLP (biases too), gradients and chained jitted steps."
    import jax
    import jax.numpy as jnp
    import optax

    from eformer_nb.optimizers import OptimizerFactory, SchedulerConfig

    r, params = np.random.default_rng(0), {}
    for i, (a, b) in enumerate(zip((256, 512, 512), (512, 512, 256))):
        params[f"w{i}"] = jnp.asarray(r.normal(size=(a, b)) / np.sqrt(a), jnp.float32)
        params[f"b{i}"] = jnp.zeros(b, jnp.float32)
    grads = jax.tree.map(lambda p: jnp.asarray(np.random.default_rng(1).normal(size=p.shape) * 1e-2, jnp.float32),
                         params)
    sc = SchedulerConfig("warmup_cosine", learning_rate=1e-3, learning_rate_end=1e-5, warmup_steps=100, steps=10_000)
    sched = OptimizerFactory.create("adamw", sc)[1]
    ours = OptimizerFactory.create("adamw", sc, weight_decay=0.1, clip_grad=1.0)[0]
    peer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.1))

    def runner(tx, steps=20):  # chained steps from the runner's own state, one wait at the end (as the page)
        step = jax.jit(lambda p, s, g: (lambda u, s2: (optax.apply_updates(p, u), s2))(*tx.update(g, s, p)))
        box = [params, tx.init(params)]

        def run():
            for _ in range(steps):
                box[:] = step(box[0], box[1], grads)
            return jax.block_until_ready(box[0])
        return run
    label = "adamw, default non-finite guard vs optax"
    return {label: _compare(label, runner(ours), runner(peer), rounds=15)}


def fresh_escale() -> dict[str, Comparison]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from eformer_nb.common_types import BATCH, EMBED, LENGTH
    from eformer_nb.escale import PartitionAxis, PartitionManager, create_mesh

    n = jax.device_count()
    mesh = create_mesh((1, 2, 2, 2) if n == 8 else (1, n, 1, 1), ("dp", "fsdp", "tp", "sp"))
    pm = PartitionManager(PartitionAxis())
    x = jax.device_put(jnp.ones((64, 256, 512)), NamedSharding(mesh, P(("fsdp", "dp"), "sp", "tp")))
    with jax.set_mesh(mesh):
        f_ours = jax.jit(lambda h: pm.shard(jnp.tanh(h) * 2, axes=(BATCH, LENGTH, EMBED)) + 1)
        f_peer = jax.jit(lambda h: jax.lax.with_sharding_constraint(
            jnp.tanh(h) * 2, NamedSharding(mesh, P(("fsdp", "dp"), "sp", "tp"))) + 1)
        label = "run time, compiled (64,256,512)"
        return {label: _compare(label, lambda: jax.block_until_ready(f_ours(x)),
                                lambda: jax.block_until_ready(f_peer(x)), rounds=15, repeat=3)}


def fresh_quantization() -> dict[str, Comparison]:
    import jax
    import jax.numpy as jnp

    from eformer_nb.ops.quantization.kernels import nf4_matmul
    from eformer_nb.ops.quantization.nf4 import ArrayNF4

    w = jax.random.normal(jax.random.key(0), (4096, 4096), jnp.float32)
    wq = ArrayNF4.quantize(w, block_size=64)
    x1 = jax.random.normal(jax.random.key(1), (1, 4096), jnp.float32)
    nf4_mm = jax.jit(lambda x, p, a: nf4_matmul(x, p, a, n=4096, backend="xla"))
    dense = jax.jit(lambda x, w: x @ w)
    label = "NF4 GEMV M=1 vs fp32 dense (jax)"
    return {label: _compare(label, lambda: jax.block_until_ready(nf4_mm(x1, wq.packed, wq.absmax)),
                            lambda: jax.block_until_ready(dense(x1, w)), rounds=15, repeat=5)}


def fresh_pytree_serialization() -> dict[str, Comparison]:
    import gc

    from flax import serialization as flax_ser

    from eformer_nb.pytree import from_bytes, to_bytes

    rng = np.random.default_rng(0)
    tree = {f"layer_{i}": {"w": rng.standard_normal((1024, 2048), np.float32),
                           "ids": rng.integers(0, 1000, (512, 1024), np.int32)} for i in range(4)}  # ~40 MiB
    ours = lambda: from_bytes(tree, to_bytes(tree))  # noqa: E731
    flax = lambda: flax_ser.msgpack_restore(flax_ser.msgpack_serialize(tree))  # noqa: E731
    t = interleaved_times([ours, flax, ours], rounds=ROUNDS, warmup=1, before=gc.collect)
    label = "round trip 256 MiB, ours vs flax"
    return {label: Comparison(label + " (fresh: 40 MiB)", ours=t[:, 0], peer=t[:, 1], again=t[:, 2])}


def fresh_serialization() -> dict[str, Comparison]:
    "The page's save and restore-from-disk rows, 5 rounds each, on the page's tree (16 float32[4096, 4096], 1 GiB)."
    import gc
    import shutil
    import tempfile

    import jax
    import jax.numpy as jnp

    from eformer_nb.serialization import tree_deserialize_leaves, tree_serialize_leaves

    rng = np.random.default_rng(0)
    tree = {f"layer_{i:02d}": jnp.asarray(rng.standard_normal((4096, 4096), dtype=np.float32)) for i in range(16)}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    root = Path(tempfile.mkdtemp(prefix="bench-check-ser-"))
    count = iter(range(10**6))

    def np_save(d):  # the page's floor: one file per leaf, each fsync'd, then the directory
        d.mkdir()
        for k, v in tree.items():
            with open(d / f"{k}.npy", "wb") as f:
                np.save(f, np.asarray(v))
                f.flush()
                os.fsync(f.fileno())
        fd = os.open(d, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def into_new(save):
        def run():
            d = root / f"save-{next(count)}"
            save(d)
            shutil.rmtree(d)
        return run

    try:
        t = interleaved_times([into_new(lambda d: tree_serialize_leaves(d, tree)), into_new(np_save),
                               into_new(lambda d: tree_serialize_leaves(d, tree))], rounds=5, warmup=1,
                              before=gc.collect)
        save = Comparison("save 1 GiB, ours vs np", ours=t[:, 0], peer=t[:, 1], again=t[:, 2])
        tree_serialize_leaves(root / "ours", tree)
        np_save(root / "np")
        ours = lambda: tree_deserialize_leaves(root / "ours", template=abstract)  # noqa: E731
        peer = lambda: {k: np.load(root / "np" / f"{k}.npy") for k in tree}  # noqa: E731
        t = interleaved_times([ours, peer, ours], rounds=5, warmup=0,
                              before=lambda: (gc.collect(), drop_page_cache(root)))
        load = Comparison("restore from disk 1 GiB, ours vs np", ours=t[:, 0], peer=t[:, 1], again=t[:, 2])
    finally:
        shutil.rmtree(root)
    return {c.label: c for c in (save, load)}


FRESH = {"optimizers": fresh_optimizers, "serialization": fresh_serialization, "escale": fresh_escale,
         "quantization": fresh_quantization,
         "pytree_serialization": fresh_pytree_serialization}


def check(page: str, fresh: bool = True) -> list[str]:
    rows = saved_rows(ROOT / f"{page}.ipynb")
    t0 = time.perf_counter()
    measured = FRESH[page]() if fresh and page in FRESH else {}
    for c in measured.values():
        print(f"  fresh {c}")
    problems = disagreements(rows, TARGETS[page], measured)
    for label, target in TARGETS[page].items():
        row = rows.get(label)
        if row and row["verdict"] == MISSED:
            print(f"  MISS (saved, honest): {label}: {row['ratio']}x [{row['lo']}, {row['hi']}] against {target}")
            if label in measured and verdict(measured[label], target) == MET:
                print(f"  NOTE: a fresh run meets it ({measured[label].ratio:.3f}x); re-run the page to claim it")
    devices = f", {sys.modules['jax'].device_count()} XLA device(s)" if "jax" in sys.modules and measured else ""
    print(f"{page}: {len(rows)} saved rows, {len(measured)} re-run ({time.perf_counter() - t0:.1f} s{devices}): "
          + ("holds up" if not problems else f"{len(problems)} disagreement(s)"))
    return [f"{page}: {p}" for p in problems]


def main(argv: list[str]) -> int:
    pages = list(TARGETS) if argv == ["all"] else (argv or list(CHEAP))
    unknown = [p for p in pages if p not in TARGETS]
    if unknown:
        print(f"unknown page(s) {unknown}; expected some of {list(TARGETS)} or 'all'")
        return 2
    print(f"bench-check on {os.cpu_count()} cores, load average {os.getloadavg()}")
    print(format_threads(pin_threads(THREADS)))
    problems = [p for page in pages for p in check(page)]
    for p in problems:
        print("DISAGREES", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
