"""Fuzz the parsers and decoders with hypothesis: config input (CLI, dict, YAML, JSON), policy strings, mesh
strings, msgpack payloads (`from_bytes`), `.npy` and dict files, and quantization inputs.

The property, for every input: either the documented result, or an exception of the documented type whose message
names the bad value (or the file or field it came from); never a hang (hypothesis' per-example deadline, and a
wall-clock limit on the whole run); never more than `MEMORY_LIMIT` of address space (each target runs in a fresh
subprocess under `resource.RLIMIT_AS`); never a file touched outside the target directory (checked on the whole
scratch tree around it).

Issue 26 added the model's config, eager forward and `generate` (tiny model, oracles: the model's own
teacher-forced argmax for greedy decoding, causality and row independence for the forward), `EasyDeLState`'s
`apply_gradients` (against optax by hand) and the executors' accelerator configs; `ISSUE26` lists them and
`test_issue26_budget` checks they try at least 2,000 inputs.

Runs are derandomized (the same inputs every time) and bounded. Each target prints one JSON line with the number
of inputs tried and the outcomes; `python tests/test_fuzz.py TARGET[,TARGET...] DIR` runs targets by hand
(`FUZZ_EXAMPLES=N` changes how many inputs each tries)."""
from __future__ import annotations

import collections
import dataclasses
import datetime
import io
import json
import os
import resource
import subprocess
import sys
import time
import typing as tp
from pathlib import Path

import pytest

MEMORY_LIMIT = 4 << 30  # bytes of address space per target process (JAX on CPU peaks at ~1.6 GB of it here)
# seconds per group process: a hang fails the test instead of stalling CI (120 s was exceeded by healthy runs at
# load 35-40 on 2 cores: the config group's five targets took ~80 s of work there)
WALL_LIMIT = 300
# hypothesis' per-example deadline: catches pathological slowness, not machine load (a 1419-deep YAML list takes
# ~0.9 s at load 28 on 2 cores; 2 s failed there)
DEADLINE_MS = 5000
MESSAGE_LIMIT = 4000  # characters an error message may have beyond twice the input's size


# --------------------------------------------------------------------------------------------------------------
# The property, shared by every target
# --------------------------------------------------------------------------------------------------------------

class Outcomes:
    "Counts inputs and outcomes; `check` applies the property to one call."

    def __init__(self):
        self.inputs = 0
        self.kinds: collections.Counter = collections.Counter()

    def check(self, fn: tp.Callable[[], tp.Any], allowed: tuple[type, ...], names: tp.Sequence[str] = (),
              size: int = 0, on_ok: tp.Callable[[tp.Any], None] | None = None):
        """Run `fn`; an exception must be one of `allowed` and its message must be non-empty, not absurdly long,
        and contain one of `names` (the bad value, the key, the field or the file) when names are given."""
        self.inputs += 1
        try:
            out = fn()
        except allowed as e:
            msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
            assert msg.strip(), f"{type(e).__name__} with an empty message"
            assert len(msg) <= 2 * size + MESSAGE_LIMIT, f"{type(e).__name__} message of {len(msg)} characters"
            if names:
                assert any(n in msg for n in names), (
                    f"{type(e).__name__}: {msg[:500]!r} names none of {list(names)[:5]}"
                )
            self.kinds[type(e).__name__] += 1
            return None
        self.kinds["ok"] += 1
        if on_ok is not None:
            on_ok(out)
        return out

    def summary(self, target: str) -> str:
        return json.dumps({"target": target, "inputs": self.inputs, "outcomes": dict(sorted(self.kinds.items()))})


def _settings(max_examples: int, deadline_ms: int = DEADLINE_MS):
    from hypothesis import HealthCheck, settings
    return settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        print_blob=True,
        deadline=datetime.timedelta(milliseconds=deadline_ms),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )


# --------------------------------------------------------------------------------------------------------------
# Targets (each runs in its own process; `target_dir` is the only place it may write)
# --------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Model:
    hidden: int = 8
    dtype: tp.Literal["bf16", "f32"] = "bf16"


def _parser():
    from eformer_nb.aparser import Argu, DataClassArgumentParser

    @dataclasses.dataclass
    class Run:
        steps: int = Argu(default=10, aliases=["-s"])
        lr: float = 3e-4
        name: str = "run"
        compile: bool = True
        seed: tp.Optional[int] = None
        layers: list[int] = Argu(default=[1, 2])
        ratios: tuple[float, float] = (0.5, 0.5)
        tags: dict[str, int] = Argu(default={})
        model: Model = dataclasses.field(default_factory=Model)

    return Run, DataClassArgumentParser(Run)


FIELDS = ["steps", "lr", "name", "compile", "seed", "layers", "ratios", "tags", "model", "hidden", "dtype"]


def _check_run(run) -> None:
    "An accepted config has the declared types (and finite floats, 64-bit ints)."
    import math
    (r,) = run
    assert type(r.steps) is int and -2**63 <= r.steps < 2**64
    assert type(r.lr) is float and math.isfinite(r.lr)
    assert type(r.name) is str and type(r.compile) is bool and (r.seed is None or type(r.seed) is int)
    assert all(type(x) is int for x in r.layers) and len(r.ratios) == 2
    assert all(type(x) is float and math.isfinite(x) for x in r.ratios)
    assert all(type(k) is str and type(v) is int for k, v in r.tags.items())
    assert type(r.model.hidden) is int and r.model.dtype in ("bf16", "f32")


def _json_values(st):
    leaves = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**62, max_value=2**70)
              | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
              | st.sampled_from(["1e-3", "12", "nan", "inf", "true", "bf16", "f32", "", "1_000", "0x10"]))
    return st.recursive(
        leaves,
        lambda kids: (
            st.lists(kids, max_size=4)
            | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6) | st.integers(0, 3), kids, max_size=4)
        ),
        max_leaves=12,
    )


def _config_dicts(st):
    "Dicts that are mostly valid configs, with a junk value, key or type mixed in now and then."
    junk = _json_values(st)
    good = {
        "steps": st.integers(-5, 10**6),
        "lr": st.floats(1e-8, 1.0),
        "name": st.text(max_size=5),
        "compile": st.booleans(),
        "seed": st.none() | st.integers(0, 99),
        "layers": st.lists(st.integers(0, 9), max_size=3),
        "ratios": st.tuples(st.floats(0, 1), st.floats(0, 1)).map(list),
        "tags": st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2),
        "model": st.fixed_dictionaries(
            {}, optional={"hidden": st.integers(1, 64), "dtype": st.sampled_from(["bf16", "f32"])}
        ),
    }
    valid = st.fixed_dictionaries({}, optional={k: v | junk if k in ("lr", "model") else v for k, v in good.items()})
    mixed = st.fixed_dictionaries({}, optional={k: v | junk for k, v in good.items()})
    return valid | mixed


def _names_of(data) -> list[str]:
    "Strings an error about `data` may name: field paths, keys, the reprs of keys and short values."
    out = ["Run", "parse_dict"]
    if isinstance(data, dict):
        for k, v in data.items():
            out += [repr(k), str(k)]
            if isinstance(v, dict):
                out += [repr(kk) for kk in v]
    return out


def fuzz_aparser_dict(target_dir: Path, n: int) -> Outcomes:
    from hypothesis import given, strategies as st
    from eformer_nb.aparser import ArgumentTypeError
    Run, parser = _parser()
    o = Outcomes()

    @_settings(n)
    @given(_config_dicts(st) | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6) | st.integers(0, 3)
                                               | st.tuples(st.integers()), _json_values(st), max_size=5))
    def run(data):
        o.check(lambda: parser.parse_dict(data), (ArgumentTypeError, KeyError, TypeError, ValueError),
                names=_names_of(data), size=len(repr(data)), on_ok=_check_run)

    run()
    return o


def fuzz_aparser_cli(target_dir: Path, n: int) -> Outcomes:
    from hypothesis import given, strategies as st
    from eformer_nb.aparser import ArgumentTypeError
    import contextlib
    Run, parser = _parser()
    o = Outcomes()
    options = ["--steps", "-s", "--lr", "--name", "--compile", "--no-compile", "--seed", "--layers", "--ratios",
               "--tags", "--model.hidden", "--model.dtype", "--model", "--stepz", "--", "-x"]
    values = st.sampled_from(["1", "-3", "1e-3", "nan", "inf", "none", "yes", "[1, 2]", "[[[[", '{"a": 1}', "bf16",
                              "9" * 30, "1_0", "", "0.5"]) | st.text(max_size=6)

    plausible = {"--steps": "12", "-s": "7", "--lr": "1e-3", "--name": "x", "--seed": "3", "--layers": "4",
                 "--ratios": "0.1", "--tags": '{"a": 1}', "--model.hidden": "16", "--model.dtype": "f32"}
    pairs = st.sampled_from(sorted(plausible)).flatmap(lambda k: st.tuples(st.just(k), st.just(plausible[k]) | values))
    argvs = st.lists(pairs, max_size=4).map(lambda ps: [t for p in ps for t in p])

    @_settings(n)
    @given(argvs | st.lists(st.sampled_from(options) | values, max_size=8))
    def run(argv):
        err = io.StringIO()

        def call():
            with contextlib.redirect_stderr(err):
                try:
                    return parser.parse_args_into_dataclasses(argv)
                except SystemExit as e:  # argparse's documented way out: usage and the error on stderr
                    assert e.code == 2, e.code
                    text = err.getvalue()
                    assert "error:" in text and len(text) <= 2 * len(" ".join(argv)) + MESSAGE_LIMIT, text[:300]
                    raise ValueError(text) from None

        o.check(call, (ArgumentTypeError, ValueError), names=["error:", "Run", "layers", "ratios", "tags"],
                size=len(" ".join(argv)), on_ok=_check_run)

    run()
    return o


def _yaml_text(st):
    scalar = st.sampled_from(
        [
            "1",
            "1e-3",
            "1.0e-3",
            ".nan",
            ".inf",
            "-.inf",
            "true",
            "~",
            "bf16",
            "'12'",
            "[1, 2]",
            "{a: 1}",
            "1" + "0" * 400,
            "0x1F",
            "[",
            "]",
            "{",
            ":",
            "&a [1, 1]",
            "*a",
            "*b",
            "!!python/name:os.system",
            "!!binary aGk=",
            "|",
            "- 1",
            '"\\x00"',
        ]
    )
    key = st.sampled_from(FIELDS + ["1", "null", "? x", "<<", "a b", "steps"])
    line = st.tuples(st.integers(0, 2), key, scalar).map(lambda t: "  " * t[0] + f"{t[1]}: {t[2]}")
    bomb = st.integers(2, 9).map(lambda k: "x0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"x{i}: &a{i} [{', '.join(['*a' + str(i - 1)] * 9)}]\n" for i in range(1, k)) + f"layers: *a{k - 1}\n")
    deep = st.integers(1, 3000).map(lambda d: "layers: " + "[" * d + "1" + "]" * d + "\n")
    return st.lists(line, max_size=6).map("\n".join) | bomb | deep | st.text(max_size=40)


def fuzz_aparser_files(target_dir: Path, n: int) -> Outcomes:
    from hypothesis import given, strategies as st
    from eformer_nb.aparser import ArgumentTypeError
    Run, parser = _parser()
    o = Outcomes()
    y, j = target_dir / "config.yaml", target_dir / "config.json"
    allowed = (ArgumentTypeError, KeyError, TypeError, ValueError)

    import yaml

    @_settings(n)
    @given(_yaml_text(st), st.binary(max_size=24), _json_values(st), st.integers(0, 3), _config_dicts(st))
    def run(yaml_text, junk, value, mode, cfg):
        as_json = mode % 2 == 1
        if mode == 2:  # a (mostly) valid config, dumped as YAML
            yaml_text, junk = yaml.safe_dump(cfg), b""
        if as_json:
            text = (
                (
                    json.dumps(cfg, allow_nan=True)
                    if mode == 3
                    else json.dumps({"layers": value, "lr": value}, allow_nan=True)
                )
                if not junk
                else junk.decode("latin-1")
            )
            j.write_text(text, encoding="utf-8")
            o.check(lambda: parser.parse_json_file(j), allowed, names=[str(j), "Run"], size=len(text), on_ok=_check_run)
        else:
            data = yaml_text.encode() if not junk or len(junk) % 3 else junk
            y.write_bytes(data)
            o.check(lambda: parser.parse_yaml_file(y), allowed, names=[str(y), "Run"], size=len(data), on_ok=_check_run)

    run()
    return o


def fuzz_policy(target_dir: Path, n: int) -> Outcomes:
    from hypothesis import given, strategies as st
    from eformer_nb.mpric.dtypes import DTYPE_NAMES
    from eformer_nb.mpric.policy import Policy, get_policy
    o = Outcomes()
    token = st.sampled_from(list(DTYPE_NAMES) + ["p", "c", "o", "params", "compute", "output", "=", ",", " ", "fp32",
                                                 "int8", "x", "==", "p=", ",,"])
    name = st.sampled_from(list(DTYPE_NAMES) + ["fp32", "int8", ""])
    pair = st.tuples(st.sampled_from(["p", "c", "o", "params", "compute", "output", "q"]), name).map("=".join)
    well_formed = name | st.lists(pair, min_size=1, max_size=3).map(",".join)
    policy = well_formed | st.lists(token, max_size=8).map("".join) | st.text(max_size=20) \
        | st.integers(1, 10**5).map(lambda k: "p=" + "f" * k)

    def ok(p):
        assert isinstance(p, Policy) and str(get_policy(str(p))) == str(p)

    @_settings(n)
    @given(policy | st.none() | st.integers())
    def run(s):
        o.check(
            lambda: get_policy(s),
            (ValueError, TypeError),
            names=["policy", "dtype"],
            size=min(len(repr(s)), 1000),
            on_ok=ok,
        )

    run()
    return o


def fuzz_mesh(target_dir: Path, n: int) -> Outcomes:
    from hypothesis import given, strategies as st
    from eformer_nb.escale.mesh import parse_mesh_spec, resolve_axis_dims
    o = Outcomes()
    token = st.sampled_from(["dp", "tp", "fsdp", "sp", "ep", ":", ",", "-1", "2", "4", "0", " ", "x", "99999999999",
                             "1e3", "dp:2", "tp:-1", ":4"])
    item = st.tuples(st.sampled_from(["dp", "tp", "fsdp", "sp", "ep", "x1", "1a", ""]), st.integers(-2, 16)).map(
        lambda t: f"{t[0]}:{t[1]}"
    )
    well_formed = st.lists(item, min_size=1, max_size=4).map(",".join) | st.lists(
        st.integers(-1, 8), min_size=1, max_size=3
    ).map(lambda ds: ",".join(map(str, ds)))
    spec = well_formed | st.lists(token, max_size=8).map("".join) | st.text(max_size=16)

    def ok(out):
        dims, names = out
        assert len(dims) == len(names) and len(set(names)) == len(names) and all(type(d) is int for d in dims)
        o.check(
            lambda: resolve_axis_dims(dims, names, 8), (ValueError, TypeError), names=["axis", "devices", "-1", "dims"]
        )

    @_settings(n)
    @given(spec, st.none() | st.lists(st.sampled_from(["dp", "tp", "sp", "", "dp"]), max_size=4))
    def run(s, names):
        o.check(
            lambda: parse_mesh_spec(s, names), (ValueError, TypeError), names=[repr(s), "names"], size=len(s), on_ok=ok
        )

    run()
    return o


def fuzz_msgpack(target_dir: Path, n: int) -> Outcomes:
    import zlib
    import msgpack
    import numpy as np
    from hypothesis import given, strategies as st
    from eformer_nb.pytree import serialization as ser
    o = Outcomes()
    good = ser.to_bytes({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "step": 3, "t": (1, 2.5, None), "k": b"x"})

    def with_header(header: bytes, data: bytes = b"") -> bytes:
        "A payload whose prefix and header checksum are right, so the header itself is what is parsed."
        pad = b"\0" * ser._pad(ser.PREFIX_SIZE + len(header))
        prefix = ser._PREFIX.pack(
            ser.MAGIC, ser.FORMAT_VERSION, len(header), len(data), zlib.crc32(data), ser._FLAG_DATA_CRC
        )
        return prefix + ser._HCRC.pack(zlib.crc32(header, zlib.crc32(prefix))) + header + pad + data

    leaf = (
        st.none()
        | st.booleans()
        | st.integers(-(2**70), 2**70)
        | st.floats()
        | st.text(max_size=4)
        | st.binary(max_size=4)
        | st.builds(msgpack.ExtType, st.integers(0, 8), st.binary(max_size=12))
    )
    tree = st.recursive(
        leaf,
        lambda k: st.lists(k, max_size=3) | st.dictionaries(st.text(max_size=3) | st.integers(), k, max_size=3),
        max_leaves=10,
    )
    entry = st.lists(
        st.sampled_from(["float32", "int8", "bfloat16", "nope"])
        | st.integers()
        | st.lists(st.integers(-1, 10**12), max_size=3),
        min_size=0,
        max_size=5,
    )
    header = st.builds(lambda arrays, t: {"arrays": arrays, "tree": t}, st.lists(entry, max_size=3), tree) | tree

    def payload(kind, blob, at, head, data):
        if kind == 0:
            return blob
        if kind == 1:  # a flipped byte of a good payload
            b = bytearray(good); b[at % len(b)] ^= 1 + blob[0] % 255 if blob else 1; return bytes(b)
        if kind == 2:  # a cut good payload
            return good[:at % len(good)]
        return with_header(msgpack.packb(head, use_bin_type=True, strict_types=False), data)

    def ok(out):
        assert out is None or isinstance(
            out, (dict, list, tuple, int, float, str, bytes, bool, np.ndarray, np.generic, complex)
        )

    @_settings(n)
    @given(
        st.integers(0, 3), st.binary(max_size=64), st.integers(0, 10**6), header, st.binary(max_size=96), st.booleans()
    )
    def run(kind, blob, at, head, data, verify):
        try:
            p = payload(kind, blob, at, head, data)
        except (TypeError, ValueError, OverflowError):  # msgpack cannot pack this header: not an input
            return
        o.check(lambda: ser.from_bytes(None, p, verify=verify), (ValueError, TypeError),
                names=["input", "header", "array", "entry", "tuple", "extension", "dtype", "bytes", "PRNG", "payload",
                       "corrupted", "reference", "shape", "version", "flags"], size=len(p), on_ok=ok)

    run()
    return o


def fuzz_files(target_dir: Path, n: int) -> Outcomes:
    "`.npy` and dict files: crafted headers, cut and flipped bytes, random JSON and msgpack."
    import msgpack
    import numpy as np
    from hypothesis import given, strategies as st
    from eformer_nb.paths import ePath, load_dict, load_jax_array, save_dict, save_jax_array
    o = Outcomes()
    buf = io.BytesIO(); np.save(buf, np.arange(12, dtype=np.float32).reshape(3, 4)); good = buf.getvalue()
    npy, js, mp = target_dir / "a.npy", target_dir / "d.json", target_dir / "d.msgpack"
    load_jax_array(save_jax_array(npy, np.ones(2)))  # warm up: the first call starts JAX's backend

    def npy_bytes(kind, shape, descr, blob, at):
        if kind == 0:  # a header written by hand: any shape, dtype string and order against 48 data bytes
            h = "{'descr': %r, 'fortran_order': %s, 'shape': %r, }" % (
                descr,
                "True" if at % 2 else "False",
                tuple(shape),
            )
            h = h.ljust(118) + "\n"
            return b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h.encode("latin-1") + good[128:]
        if kind == 1:
            b = bytearray(good); b[at % len(b)] = blob[0] if blob else 0; return bytes(b)
        if kind == 2:
            return good[:at % len(good)]
        return blob

    def ok_arr(a):
        assert a.size * a.dtype.itemsize <= 48

    @_settings(n)
    @given(
        st.integers(0, 3),
        st.lists(st.integers(-2, 2**40), max_size=4),
        st.sampled_from(["<f4", "<i2", "|u1", "|O", "<f8", "x", "|V4", "<U1", "|b1"]),
        st.binary(max_size=64),
        st.integers(0, 10**6),
        _json_values(st),
        st.text(max_size=30),
        st.booleans(),
    )
    def run(kind, shape, descr, blob, at, value, text, which):
        npy.write_bytes(npy_bytes(kind, shape, descr, blob, at))
        o.check(lambda: load_jax_array(npy), (ValueError,), names=[str(npy)], size=0, on_ok=ok_arr)
        if which:
            js.write_text(text if kind % 2 else json.dumps({"v": value}, allow_nan=True), encoding="utf-8")
            o.check(lambda: load_dict(js), (ValueError, TypeError), names=[str(js)], size=0)
            o.check(lambda: save_dict(ePath(target_dir) / "out.json", {"v": value}), (ValueError, TypeError),
                    names=["out.json"], size=len(repr(value)))
        else:
            try:
                mp.write_bytes(blob if kind % 2 else msgpack.packb({"v": value}, use_bin_type=True))
            except (OverflowError, TypeError, ValueError):  # msgpack cannot hold this value (ints beyond 64 bits)
                mp.write_bytes(blob)
            o.check(lambda: load_dict(mp), (ValueError, TypeError), names=[str(mp)], size=0)
        o.check(lambda: save_jax_array(target_dir / "out.npy", np.asarray(shape, np.int64)), (ValueError, TypeError))

    run()
    return o


def fuzz_quantization(target_dir: Path, n: int) -> Outcomes:
    import jax.numpy as jnp
    import numpy as np
    from hypothesis import given, strategies as st
    from eformer_nb.ops.quantization import quantize
    o = Outcomes()
    fmts = ["nf4", "int8", "binary", "ternary"]
    specials = [0.0, -0.0, 1e-30, 3e38, -3e38, float("nan"), float("inf"), -float("inf")]
    quantize(jnp.ones((4, 8)), "int8")  # warm up: the first call starts JAX's backend

    def ok_for(x, fmt, nonfinite):
        def ok(q):
            d = np.asarray(q.materialize(), np.float32)
            assert q.shape == x.shape and d.shape == x.shape and q.dtype == x.dtype
            xf = np.asarray(x, np.float32)
            fin = np.isfinite(xf)
            if nonfinite == "keep":  # kept exactly where they were, and nowhere else
                np.testing.assert_array_equal(np.isnan(d), np.isnan(xf))
                np.testing.assert_array_equal(d[np.isinf(xf)], xf[np.isinf(xf)])
            else:
                assert fin.all(), "non-finite input was accepted without nonfinite='keep'"
            finite_in = fin & (np.abs(xf) < 1e30)  # values near float max may round to inf in bf16/f16 outputs
            assert np.isfinite(d[finite_in]).all() or x.dtype != np.float32, (fmt, "finite input became non-finite")
        return ok

    @_settings(n, deadline_ms=20_000)  # the first call of each shape compiles
    @given(
        st.sampled_from(fmts),
        st.sampled_from([(4, 8), (3, 7), (2, 0), ()]),
        st.sampled_from(["float32", "bfloat16", "int32"]),
        st.none() | st.sampled_from([8, 64, 128, 3, 0, -8, 1 << 30, 2**63]),
        st.lists(st.sampled_from(specials), max_size=3),
        st.integers(0, 2**32 - 1),
        st.sampled_from(["raise", "keep", "zero"]),
        st.none() | st.sampled_from([-1, -2, 0, 1, 2, -3, 1.0, True]),  # nf4's block axis (bitsandbytes' layout: -2)
    )
    def run(fmt, shape, dtype, block, special, seed, nonfinite, block_axis):
        x = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
        for i, v in enumerate(special):
            if x.size:
                x.flat[(seed + 7 * i) % x.size] = v
        x = jnp.asarray(x).astype(dtype)
        kw = {"nonfinite": nonfinite}
        if block is not None:
            kw["block_size"] = block
            if fmt == "int8":
                kw["granularity"] = "block"
        if block_axis is not None:
            kw["block_axis"] = block_axis
        o.check(lambda: quantize(x, fmt, **kw), (ValueError, TypeError),
                names=["block_size", "not finite", "floating", "last axis", "nonfinite", "granularity", repr(block),
                       "block_axis"],
                on_ok=ok_for(x, fmt, nonfinite))

    run()
    return o


def fuzz_state(target_dir: Path, n: int) -> Outcomes:
    """`EasyDeLState.apply_gradients`, `merge_to_state` and `create(step=...)` with gradients of every wrong form:
    NaN/Inf values, a scalar per leaf, a leading axis, other dtypes, a missing or an extra leaf, a plain dict."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from hypothesis import given
    from hypothesis import strategies as st

    from eformer_nb.escale.partition.constraints import map_leaves_with_path
    from eformer_nb.infra.base_state import EasyDeLState
    from eformer_nb.optimizers import OptimizerFactory

    class Tiny(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
            self.norm = nnx.LayerNorm(3, rngs=nnx.Rngs(0))

    model, o = Tiny(), Outcomes()
    txs = {"sgd": optax.sgd(0.1), "adamw": optax.adamw(1e-2),
           "factory": OptimizerFactory.create("adamw", {"learning_rate": 1e-2}, clip_grad=1.0)[0]}
    states = {(t, pol): EasyDeLState.create(model=model, tx=tx, init_opt_state=True, nonfinite=pol)
              for t, tx in txs.items() for pol in ("skip", "raise", "off")}
    base = states[("sgd", "skip")].graphstate
    paths = []
    map_leaves_with_path(lambda p, x: paths.append(p), base)
    forms = ["ok", "scalar", "lead", "int32", "bfloat16", "drop", "dict", "extra", "transpose"]

    def grads_of(seed, form, specials):
        r = np.random.default_rng(seed)
        bad = {paths[(seed + i) % len(paths)]: v for i, v in enumerate(specials)}

        def leaf(p, x):
            g = r.normal(size=x.shape).astype(np.float32)
            if p in bad and g.size:
                g.flat[seed % g.size] = bad[p]
            g = jnp.asarray(g)
            if p == paths[seed % len(paths)]:  # the one leaf the form changes
                g = {"scalar": g.reshape(-1)[:1].reshape(()), "lead": g[None], "int32": g.astype(jnp.int32),
                     "bfloat16": g.astype(jnp.bfloat16), "transpose": g.T if g.ndim == 2 else g[None]}.get(form, g)
            return g
        g = map_leaves_with_path(leaf, base)
        if form == "dict":
            g = nnx.to_pure_dict(g)
        elif form in ("drop", "extra"):
            g = nnx.to_pure_dict(g)
            if form == "drop":
                del g["lin"]["bias"]
            else:
                g["lin"]["extra"] = jnp.ones(3)
        return g

    def finite(tree):
        return all(bool(jnp.isfinite(x).all()) for x in jax.tree_util.tree_leaves(tree))

    @_settings(n, deadline_ms=20_000)
    @given(st.sampled_from(sorted(txs)), st.sampled_from(["skip", "raise", "off"]), st.sampled_from(forms),
           st.lists(st.sampled_from([np.nan, np.inf, -np.inf, 1e30, 0.0]), max_size=2), st.integers(0, 2**31 - 1))
    def run(tx_name, policy, form, specials, seed):
        state = states[(tx_name, policy)]
        grads = grads_of(seed, form, specials)
        clean = finite(grads) if form in ("ok", "bfloat16") else None

        def on_ok(new):
            assert form in ("ok", "bfloat16"), f"apply_gradients accepted gradients of the form {form!r}"
            assert int(new.step) == int(state.step) + 1
            if clean:
                ref_u, _ = txs[tx_name].update(grads, state.opt_state, state.graphstate)
                ref = optax.apply_updates(state.graphstate, ref_u)
                for a, b in zip(jax.tree_util.tree_leaves(new.graphstate), jax.tree_util.tree_leaves(ref)):
                    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
                assert int(new.skipped_steps) == 0
            elif policy == "skip":  # a non-finite gradient: nothing moved, one skip counted
                assert int(new.skipped_steps) == 1 and finite(new.graphstate)
                for a, b in zip(jax.tree_util.tree_leaves(new.graphstate), jax.tree_util.tree_leaves(state.graphstate)):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            else:
                assert policy == "off", policy  # 'raise' must have raised
        o.check(lambda: state.apply_gradients(grads=grads), (ValueError, FloatingPointError),
                names=["apply_gradients"] + paths, on_ok=on_ok)
        def merged_ok(new):
            assert form == "ok", f"merge_to_state accepted parameters of the form {form!r}"
            assert new.graphstate is merged

        merged = grads_of(seed, form, [])
        o.check(lambda: state.merge_to_state(merged), (ValueError,), names=["merge_to_state"], on_ok=merged_ok)

    run()

    @_settings(max(n // 2, 1))
    @given(st.none() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True) | st.booleans() | st.text(max_size=4)
           | st.sampled_from([np.int64(3), np.float32(2.0), jnp.array(4), jnp.array([1, 2]), jnp.array(1.5)]))
    def steps(step):
        def ok(s):
            want = 0 if step is None else int(step)
            assert want >= 0 and int(s.step) == want and not isinstance(step, (bool, float, str)), step
        o.check(lambda: EasyDeLState.create(model=model, step=step), (ValueError,), names=["step="], on_ok=ok)

    steps()
    return o


# --------------------------------------------------------------------------------------------------------------
# Issue 26: the model config, forward and generate, and the executors' configs
# --------------------------------------------------------------------------------------------------------------

def _tiny_llama(**over):
    "The tiny model the model targets share: vocab 64, 16 positions, 2 layers, 4 query and 2 key/value heads."
    from flax import nnx
    from eformer_nb.modules.llama import LlamaConfig, LlamaForCausalLM
    kw = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=16, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(LlamaConfig(**{**kw, **over}), rngs=nnx.Rngs(0))


LLAMA_INTS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings"]


def fuzz_llama_config(target_dir: Path, n: int) -> Outcomes:
    """`LlamaConfig(**kwargs)` with sizes that do or do not fit together, non-finite or negative floats, token ids
    in and out of the vocabulary, typos of field names, and wrong types. Oracle for an accepted config: every rule
    holds (sizes positive ints that split into the heads, finite positive floats, ids in the vocabulary), no
    typo'd key is kept, and the dict round trip gives an equal config."""
    import math
    from hypothesis import given, strategies as st
    import numpy as np
    from eformer_nb.modules.llama import LlamaConfig
    from eformer_nb.infra.layers import rope_inv_freq
    o = Outcomes()
    bad = st.sampled_from([0, -1, -4, True, 2.0, 1.5, "8", None, float("nan"), 2**70])
    size = st.sampled_from([1, 2, 3, 4, 6, 8, 16, 32, 34, 64]) | bad
    real = st.sampled_from([1e-6, 0.02, 1.0, 1e4, 500000.0, 0.0, -1.0, -1e4, float("nan"), float("inf"), -float("inf"),
                            True, "1e-6", None, 10**400 if False else 1e308])
    tok = st.none() | st.integers(-3, 70) | st.sampled_from([10**6, True, 1.0, "2"])
    scaling = st.none() | st.sampled_from([{"rope_type": "linear", "factor": 2.0}, {"rope_type": "linear", "factor": 0},
                                           {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
                                           {"rope_type": "yarn", "factor": 2.0}, {"type": "linear", "factor": -1.0},
                                           {"rope_type": "linear"}, {}, {"rope_type": "linear", "factor": "2"},
                                           {"rope_type": "linear", "factor": float("inf")},
                                           {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                            "high_freq_factor": 4.0},
                                           {"rope_type": "llama3", "factor": 8.0,
                                            "original_max_position_embeddings": 0},
                                           {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": -1.0}])
    typo = st.sampled_from(["hidden_sise", "vocab_sze", "num_hiden_layers", "rope_thet", "rms_norm_epsilon",
                            "my_custom_flag", "intermediate_sizes"])
    fields = {**{k: size for k in LLAMA_INTS}, "rope_theta": real, "rms_norm_eps": real, "initializer_range": real,
              "bos_token_id": tok, "eos_token_id": tok | st.lists(st.integers(-1, 70), max_size=2),
              "pad_token_id": tok, "rope_scaling": scaling,
              "hidden_act": st.sampled_from(["silu", "gelu", "swish", "", "SILU"]),
              "tie_word_embeddings": st.booleans()}
    base = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=16)

    def pos_int(v):
        return type(v) is int and v > 0

    def ok_for(kw):
        def ok(c):
            for k in LLAMA_INTS:
                assert pos_int(getattr(c, k)), (k, getattr(c, k))
            assert c.num_attention_heads % c.num_key_value_heads == 0 and c.head_dim % 2 == 0
            if kw.get("head_dim") is None:
                assert c.head_dim * c.num_attention_heads == c.hidden_size, (c.hidden_size, c.num_attention_heads)
            assert c.rope_theta > 0 and c.rms_norm_eps > 0 and c.initializer_range >= 0
            assert all(math.isfinite(float(getattr(c, k))) for k in ("rope_theta", "rms_norm_eps", "initializer_range"))
            assert not any(type(getattr(c, k)) is bool for k in ("rope_theta", "rms_norm_eps", "initializer_range"))
            eos = c.eos_token_id if isinstance(c.eos_token_id, (list, tuple)) else [c.eos_token_id]
            for i in [c.bos_token_id, c.pad_token_id, *eos]:
                assert i is None or (type(i) is int and 0 <= i < c.vocab_size), i
            assert c.hidden_act in ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
            for t in ("hidden_sise", "vocab_sze", "num_hiden_layers", "rope_thet", "intermediate_sizes"):
                assert not hasattr(c, t), f"typo {t!r} kept silently"
            inv = np.asarray(rope_inv_freq(c))  # the rotary frequencies the forward will use
            assert inv.shape == (c.head_dim // 2,) and np.isfinite(inv).all() and (inv > 0).all(), (c.rope_scaling, inv)
            again = LlamaConfig.from_dict(c.to_dict())
            assert again.to_dict() == c.to_dict()
        return ok

    @_settings(n)
    @given(st.fixed_dictionaries({}, optional=fields), st.lists(typo, max_size=1), st.sampled_from([0, 7, "x", -2]),
           st.booleans())
    def run(over, typos, typo_value, on_base):
        kw = {**(base if on_base else {}), **over, **{t: typo_value for t in typos}}
        if not on_base and not set(kw) & {"hidden_size", "intermediate_size"}:  # keep the 4096-wide default cheap
            kw.update(base)
        names = ["LlamaConfig"] + [k for k in kw] + [repr(v) for v in kw.values()]
        o.check(lambda: LlamaConfig(**kw), (ValueError, TypeError), names=names, size=len(repr(kw)), on_ok=ok_for(kw))

    run()
    return o


def _ids(st, vocab: int):
    "Token ids: mostly in the vocabulary, sometimes the ids a buggy tokenizer or caller hands over."
    return st.integers(0, vocab - 1) | st.sampled_from([-1, -1000, vocab, vocab + 1, 10**6, 2**31 - 1])


def fuzz_llama_forward(target_dir: Path, n: int) -> Outcomes:
    """The eager forward of the tiny model with ids in and out of the vocabulary, lengths past the position table,
    position ids in and out of range, masks of every shape, integer/float/bool id arrays. Oracle for an accepted
    call: logits `(batch, length, vocab)`, finite; causal (changing the last token leaves the earlier positions'
    logits as they were); each row as if alone in the batch."""
    import jax.numpy as jnp
    import numpy as np
    from hypothesis import given, strategies as st
    model = _tiny_llama()
    vocab, maxpos = 64, 16
    o = Outcomes()
    model(input_ids=jnp.ones((1, 3), jnp.int32))  # warm up: the first call starts JAX's backend

    def ok_for(ids, kw, check_more):
        def ok(out):
            b, t = ids.shape
            logits = np.asarray(out.logits)
            assert logits.shape == (b, t, vocab) and np.isfinite(logits).all(), "non-finite or misshaped logits"
            a = np.asarray(ids)
            assert ((a >= 0) & (a < vocab)).all(), f"ids {a.tolist()} outside [0, {vocab}) were accepted"
            if kw.get("position_ids") is not None:
                p = np.asarray(kw["position_ids"])
                assert ((p >= 0) & (p < maxpos)).all(), f"positions {p.tolist()} were accepted"
                assert np.issubdtype(p.dtype, np.integer), f"positions of dtype {p.dtype} were accepted"
            elif kw.get("attention_mask") is None:
                assert t <= maxpos, f"length {t} > max_position_embeddings was accepted"
            if not check_more or kw:
                return
            if t > 1:  # causal: the last token does not change what came before it
                other = ids.at[:, -1].set((ids[:, -1] + 1) % vocab)
                np.testing.assert_allclose(np.asarray(model(input_ids=other).logits)[:, :-1], logits[:, :-1],
                                           rtol=2e-5, atol=2e-5)
            if b > 1:  # a row's logits do not depend on the other rows
                np.testing.assert_allclose(np.asarray(model(input_ids=ids[-1:]).logits)[0], logits[-1],
                                           rtol=2e-5, atol=2e-5)
        return ok

    @_settings(n, deadline_ms=20_000)  # each new shape compiles the eager ops once
    @given(st.integers(1, 2), st.sampled_from([1, 2, 3, 5, 16, 17, 40]), st.data(),
           st.sampled_from(["int32"] * 4 + ["int64", "uint8", "float32", "bool"]),
           st.sampled_from(["none"] * 4 + ["arange", "shifted", "negative", "big", "wrong-shape", "float"]),
           st.sampled_from(["none"] * 4 + ["ones", "left-pad", "right-pad", "zeros", "wrong-shape"]), st.integers(0, 3))
    def run(b, t, data, dtype, pos, mask, more):
        ids = np.array(data.draw(st.lists(st.integers(0, vocab - 1), min_size=b * t, max_size=b * t)), np.int64)
        for at, v in data.draw(st.lists(st.tuples(st.integers(0, b * t - 1), _ids(st, vocab)), max_size=2)):
            ids[at] = v  # now and then an id a buggy tokenizer or caller hands over
        ids = ids.reshape(b, t)
        if dtype != "int64":
            ids = ids.astype(dtype) if dtype in ("float32", "bool") else np.clip(ids, np.iinfo(dtype).min,
                                                                              np.iinfo(dtype).max).astype(dtype)
        ids = jnp.asarray(ids)
        kw = {}
        ar = np.broadcast_to(np.arange(t), (b, t))
        if pos != "none":
            kw["position_ids"] = jnp.asarray({"arange": ar, "shifted": ar + 3, "negative": ar - 1, "big": ar + maxpos,
                                              "wrong-shape": ar[:, :-1] if t > 1 else ar[:0], "float": ar + 0.5}[pos])
        if mask != "none":
            m = {"ones": np.ones((b, t)), "zeros": np.zeros((b, t)), "wrong-shape": np.ones((b, t + 1)),
                 "left-pad": (np.arange(t) >= t // 2)[None].repeat(b, 0),
                 "right-pad": (np.arange(t) < max(t // 2, 1))[None].repeat(b, 0)}[mask]
            kw["attention_mask"] = jnp.asarray(m, bool)
        o.check(lambda: model(input_ids=ids, **kw), (ValueError, TypeError),
                names=["input_ids", "position_ids", "attention_mask", "max_position_embeddings", "vocab_size"],
                on_ok=ok_for(ids, kw, more == 0))

    run()
    return o


def fuzz_llama_generate(target_dir: Path, n: int) -> Outcomes:
    """`generate` with prompts in and out of the vocabulary, budgets past the position table (up to 10**9),
    booleans, floats and infinities where ints and temperatures go, pad/EOS ids out of range, top-k/top-p values in
    and out of range. Oracle for accepted greedy decoding: each generated token is the argmax of the model's own
    forward logits on the sequence so far (teacher forcing), rows stop at EOS and are padded after it; for
    sampling: tokens in the vocabulary, `top_k=1` equal to greedy."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from hypothesis import given, strategies as st
    model = _tiny_llama()
    vocab, maxpos = 64, 16
    o = Outcomes()

    def reference(prompt, steps, eos, pad):
        "Greedy decoding by full forward passes, one token at a time, without a cache."
        seq, done = np.asarray(prompt), np.zeros(prompt.shape[0], bool)
        for _ in range(steps):
            nxt = np.asarray(model(input_ids=jnp.asarray(seq)).logits)[:, -1].argmax(-1)
            nxt = np.where(done, pad, nxt)
            done = done | np.isin(nxt, eos)
            seq = np.concatenate([seq, nxt[:, None]], 1)
        return seq

    def ok_for(prompt, kw, wrong):
        def ok(out):
            assert wrong is None, f"generate accepted {wrong[0]}={wrong[1]!r}"
            b, t = prompt.shape
            p = np.asarray(prompt)
            assert ((p >= 0) & (p < vocab)).all(), f"generate accepted the prompt {p.tolist()}"
            seqs = np.asarray(out.sequences)
            new = kw.get("max_new_tokens", 1)
            assert seqs.shape == (b, t + new) and (seqs >= 0).all() and (seqs < vocab).all(), seqs
            assert type(new) is int and 1 <= new and t + new <= maxpos, f"max_new_tokens={new!r} accepted"
            assert np.isfinite(np.asarray(out.scores)).all()
            np.testing.assert_array_equal(seqs[:, :t], np.asarray(prompt))
            eos = kw.get("eos_token_id", 2)
            pad = kw.get("pad_token_id", 0)
            if not kw.get("do_sample") or kw.get("top_k") == 1:
                np.testing.assert_array_equal(seqs, reference(prompt, new, eos, pad))
        return ok

    # valid settings come from two profiles and two budgets on two prompt shapes, so at most 8 decode loops compile
    # (eos and pad ids are traced: free to vary); the bad values replace one setting and fail before any compile
    profiles = [{}, {"do_sample": True, "top_k": 1, "temperature": 0.7}]
    bad = st.sampled_from([("max_new_tokens", v) for v in (0, -1, True, 2.0, 15, 10**9, None)]
                          + [("temperature", v) for v in (0.0, -1.0, float("inf"), float("nan"), "1")]
                          + [("top_k", v) for v in (-1, 1.5, True, "2")]
                          + [("top_p", v) for v in (0.0, 1.5, float("nan"))]
                          + [("eos_token_id", v) for v in (-2, 64, 10**6, (2, 64), 2.0)]
                          + [("pad_token_id", v) for v in (-1, 64, 10**6, True, 1.0)]
                          + [("num_beams", v) for v in (0, -2, 1.5)] + [("do_sample", "yes")])

    @_settings(n, deadline_ms=60_000)  # a new (shape, budget, profile) compiles the decode loop
    @given(st.sampled_from([(1, 2), (2, 3)]), st.data(), st.sampled_from([1, 4]), st.sampled_from(profiles),
           st.sampled_from([2, 5, (2, 3), -1, None]), st.sampled_from([0, 3, None]), st.none() | bad)
    def run(shape, data, new, profile, eos, pad, wrong):
        b, t = shape
        ids = np.array(data.draw(st.lists(st.integers(0, vocab - 1), min_size=b * t, max_size=b * t)), np.int64)
        for at, v in data.draw(st.lists(st.tuples(st.integers(0, b * t - 1), st.sampled_from([-1, vocab, 10**6])),
                                        max_size=1)):
            ids[at] = v
        prompt = jnp.asarray(ids.reshape(b, t), jnp.int32)
        kw = {"max_new_tokens": new, **profile, **({} if eos is None else {"eos_token_id": eos}),
              **({} if pad is None else {"pad_token_id": pad})}
        if wrong is not None:
            kw[wrong[0]] = wrong[1]
        if kw.get("do_sample"):  # sampling draws from a fixed key: the same tokens every run
            kw["prng_key"] = jax.random.key(0)
        names = ["max_new_tokens", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id", "input_ids",
                 "vocab_size", "max_position_embeddings", "num_beams", "do_sample"]
        o.check(lambda: model.generate(prompt, **kw), (ValueError, TypeError), names=names,
                on_ok=ok_for(prompt, {k: v for k, v in kw.items() if k != "prng_key"}, wrong))

    run()
    return o


def fuzz_executor_configs(target_dir: Path, n: int) -> Outcomes:
    """The CPU, GPU and TPU accelerator configs with counts of every wrong kind (0, negatives, NaN, inf, bools,
    strings, floats) and TPU types real and made up. Oracle for an accepted config: what it asks Ray for is finite
    and positive, one TPU worker per host of the slice with the slice's chips spread over them, and every worker's
    environment names its index and count."""
    import math
    from hypothesis import given, strategies as st
    from eformer_nb.executor.ray.resource_manager import (TPU_GENERATIONS, CpuAcceleratorConfig,
                                                          GpuAcceleratorConfig, TpuAcceleratorConfig, tpu_spec)
    o = Outcomes()
    count = st.sampled_from([1, 2, 4, 8, 0, -1, -8, True, 2.5, 0.5, float("nan"), float("inf"), "2", None, 10**6])
    tpu_types = st.sampled_from(["v4-8", "v4-16", "v5e-16", "v5p-128", "v6e-32", "v5litepod-4", "v6e-1", "v4-12",
                                 "v7-8", "v4", "V4-8", "v4-０８", "v4-08", "", "tpu", "v5e-16 "])
    env = st.sampled_from([{}, {"env_vars": {"A": "1"}}, None, "x", []])
    names = st.sampled_from(["CPU", "GPU", "TPU", "", 3, None, "my-res"])

    def ok(cfg):
        r = cfg.to_ray_resources()
        amounts = [r.num_cpus, r.num_gpus, *r.resources.values()]
        assert all(type(a) in (int, float) and math.isfinite(a) and a >= 0 for a in amounts), r
        assert all(isinstance(k, str) and k for k in r.resources), r.resources
        for c in ("worker_count", "pod_count", "head_workers"):
            v = getattr(cfg, c, 1)
            assert type(v) is int and v >= 1, (c, v)
        if isinstance(cfg, TpuAcceleratorConfig):
            spec = tpu_spec(cfg.tpu_version)
            assert cfg.tpu_version.split("-")[0] in TPU_GENERATIONS
            assert cfg.worker_count == spec.num_hosts and cfg.chips_per_host * cfg.worker_count == spec.chips, (
                cfg.tpu_version, cfg.worker_count, cfg.chips_per_host, spec)
        else:
            assert isinstance(cfg.resource_name, str) and cfg.resource_name
        for i in range(cfg.worker_count):
            e = cfg.worker_env(i)
            assert e["EFORMER_PROCESS_INDEX"] == str(i) and e["EFORMER_PROCESS_COUNT"] == str(cfg.worker_count)

    @_settings(n)
    @given(st.sampled_from(["cpu", "gpu", "tpu"]), st.fixed_dictionaries({}, optional={
        "core_count": count, "cpu_count": count, "device_count": count, "chips_per_host": count,
        "worker_count": count, "pod_count": count, "head_workers": count, "execution_env": env,
        "gpu_model": st.sampled_from(["A100", "", " ", None, 7]), "resource_name": names}), tpu_types)
    def run(kind, kw, tpu_type):
        cls = {"cpu": CpuAcceleratorConfig, "gpu": GpuAcceleratorConfig, "tpu": TpuAcceleratorConfig}[kind]
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in kw.items() if k in fields}
        args = (tpu_type,) if kind == "tpu" else ()
        o.check(lambda: cls(*args, **kw), (ValueError, TypeError),
                names=[cls.__name__, "TPU type"] + list(kw), size=len(repr(kw)), on_ok=ok)

    run()
    return o


TARGETS: dict[str, tuple[tp.Callable[[Path, int], Outcomes], int]] = {
    "aparser_dict": (fuzz_aparser_dict, 400),
    "aparser_cli": (fuzz_aparser_cli, 300),
    "aparser_files": (fuzz_aparser_files, 300),
    "policy": (fuzz_policy, 500),
    "mesh": (fuzz_mesh, 500),
    "msgpack": (fuzz_msgpack, 500),
    "files": (fuzz_files, 250),
    "quantization": (fuzz_quantization, 300),
    "state": (fuzz_state, 250),
    "llama_config": (fuzz_llama_config, 700),
    "llama_forward": (fuzz_llama_forward, 250),
    "llama_generate": (fuzz_llama_generate, 120),
    "executor_configs": (fuzz_executor_configs, 700),
}
GROUPS = {  # targets sharing one process (one interpreter start each; the config group never imports a backend)
    "config": ["aparser_dict", "aparser_cli", "aparser_files", "policy", "mesh"],
    "arrays": ["msgpack", "files", "quantization"],
    "state": ["state"],  # EasyDeLState (issue 26): apply_gradients, merge_to_state, create(step=)
    "model": ["llama_config", "llama_forward"],  # issue 26: LlamaConfig and the eager forward
    "generate": ["llama_generate"],  # issue 26: generate (its own process: it compiles decode loops)
    "executor": ["executor_configs"],  # issue 26: the accelerator configs
}
ISSUE26 = ["state", "llama_config", "llama_forward", "llama_generate", "executor_configs"]  # >= 2,000 inputs in all


def _main(targets: list[str], target_dir: str) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    for target in targets:
        fn, n = TARGETS[target]
        t0 = time.monotonic()
        (Path(target_dir) / target).mkdir()
        out = fn(Path(target_dir) / target, int(os.environ.get("FUZZ_EXAMPLES", n)))
        line = json.loads(out.summary(target))
        line["budget"], line["seconds"] = int(os.environ.get("FUZZ_EXAMPLES", n)), round(time.monotonic() - t0, 1)
        print("FUZZ " + json.dumps(line), flush=True)


# --------------------------------------------------------------------------------------------------------------
# pytest: one subprocess per target, in a scratch tree whose only writable target is target/
# --------------------------------------------------------------------------------------------------------------

def _snapshot(root: Path, skip: Path) -> dict[str, tuple]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p == skip or skip in p.parents:
            continue
        st = p.lstat()
        out[str(p.relative_to(root))] = (
            st.st_mode,
            st.st_size,
            st.st_mtime_ns,
            p.read_bytes() if p.is_file() else None,
        )
    return out


@pytest.mark.timeout(WALL_LIMIT + 60)
@pytest.mark.parametrize("group", list(GROUPS))
def test_fuzz(group, tmp_path):
    target_dir, work, home = tmp_path / "target", tmp_path / "work", tmp_path / "home"
    for d in (target_dir, work, home):
        d.mkdir()
    (tmp_path / "canary.txt").write_text("must stay as it is")
    (work / "config.yaml").write_text("steps: 1\n")  # a file of the same name as the target's, one level off
    before = _snapshot(tmp_path, target_dir)
    env = dict(os.environ, HOME=str(home), TMPDIR=str(target_dir), PYTHONDONTWRITEBYTECODE="1",
               HYPOTHESIS_STORAGE_DIRECTORY=str(target_dir / ".hypothesis"),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
               EFORMER_NB_LOG_LEVEL="ERROR", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one device is enough here; 8 would only cost memory
    proc = subprocess.run([sys.executable, "-B", __file__, ",".join(GROUPS[group]), str(target_dir)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=WALL_LIMIT)
    assert proc.returncode == 0, f"{group}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    lines = [l for l in proc.stdout.splitlines() if l.startswith("FUZZ ")]
    print("\n".join(lines))
    summaries = [json.loads(l[5:]) for l in lines]
    assert [s["target"] for s in summaries] == GROUPS[group], proc.stdout[-2000:] + proc.stderr[-2000:]
    for s in summaries:  # every example reached the property at least once (none filtered away or cut short)
        assert s["inputs"] >= s["budget"] > 0, s
    after = _snapshot(tmp_path, target_dir)
    assert after == before, f"{group} touched files outside its target: {sorted(set(after) ^ set(before))}"


def test_issue26_budget():
    "The model, generate, state and executor-config targets try at least 2,000 generated inputs between them."
    total = sum(TARGETS[t][1] for t in ISSUE26)
    print(f"issue-26 targets: {total} examples by budget (each checks one input or more)")
    assert total >= 2000, total


if __name__ == "__main__":
    _main(sys.argv[1].split(","), sys.argv[2])
