"""Issue 48's save-path figures, before and after a change (run from the repository root):

- the walk of `EasyDeLState.save_state(save_directory)` through the storage code (`paths.py`, `pytree/`,
  `serialization/`, `infra/mixins/files.py`, `infra/base_state.py`), traced with `sys.setprofile` on a tiny Llama state
  with an optimizer: the files entered, how often each is entered (a call from another file), the climbs back up (a
  return into another file), and the re-entries (a call into a file already on the stack below another file: the
  reader is sent back to a file they left);
- the `is_remote_path(` call sites per file in `eformer_nb/` (the definition not counted);
- the private names (`_x`) that cross a module boundary: imported from another module (`from m import _x`), or read
  as an attribute of another module or object (`m._x`, `p._x()`), outside the module that defines them.

`python .ci/save_walk.py [--json OUT]`."""
from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "eformer_nb"
STORAGE = ("paths.py", "pytree/", "serialization/", "infra/mixins/files.py", "infra/base_state.py")


def _storage_file(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(PKG).as_posix()
    except ValueError:
        return None
    return rel if rel.startswith(STORAGE) else None


def trace_save_state() -> dict:
    "Save a tiny Llama state once untraced (imports, compiles), then trace a second save into a fresh folder."
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import optax
    from flax import nnx

    from eformer_nb.infra.base_state import EasyDeLState
    from eformer_nb.modules.llama import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    state = EasyDeLState.create(model=model, tx=optax.adamw(1e-2), init_opt_state=True)
    tmp = Path(tempfile.mkdtemp())
    state.save_state(tmp / "warm", verbose=False)
    stack, entries, climbs, reentries, order = [], collections.Counter(), 0, [], []
    edges = set()  # (caller file, callee file, callee function): the distinct places a reader is sent into a file

    def prof(frame, event, arg):
        nonlocal climbs
        if event not in ("call", "return"):
            return
        f = _storage_file(frame.f_code.co_filename)
        if event == "call":
            if f is not None and (not stack or stack[-1] != f):
                entries[f] += 1
                edges.add((stack[-1] if stack else "<caller>", f, frame.f_code.co_name))
                if f not in order:
                    order.append(f)
                if f in stack:
                    reentries.append(" -> ".join(stack[stack.index(f):] + [f]) + f" ({frame.f_code.co_name})")
            stack.append(f if f is not None else (stack[-1] if stack else None))
        elif stack:
            left = stack.pop()
            if stack and left is not None and stack[-1] is not None and stack[-1] != left:
                climbs += 1

    sys.setprofile(prof)
    try:
        state.save_state(tmp / "traced", verbose=False)
    finally:
        sys.setprofile(None)
    by_callee = collections.Counter(e[1] for e in edges)
    callers = {f: sorted({e[0] for e in edges if e[1] == f}) for f in order}
    return {"files": order, "entries": dict(entries), "climbs": climbs, "edges": sorted(edges),
            "distinct_entries": dict(by_callee), "entered_from": callers,
            "reentries": sorted(collections.Counter(reentries).items())}


def remote_branches() -> dict[str, int]:
    "`is_remote_path(` call sites per file of the package (its definition excluded)."
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        n = len(re.findall(r"(?<!def )\bis_remote_path\(", p.read_text()))
        if n:
            out[p.relative_to(PKG).as_posix()] = n
    return out


def _module_of(p: Path) -> str:
    parts = list(p.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def private_crossings() -> list[str]:
    """Private names used outside the module that defines them: `from m import _x` and `m._x`/`obj._x` where `_x` is
    defined (def, class, or top-level/class-level assignment) in another module of the package. Dunders excluded."""
    defined: dict[str, set[str]] = collections.defaultdict(set)
    trees = {}
    for p in sorted(PKG.rglob("*.py")):
        mod, tree = _module_of(p), ast.parse(p.read_text())
        trees[mod] = tree
        for node in ast.walk(tree):
            names = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):  # module or class level; `self._x = ...` anywhere
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name) and node.col_offset == 0]
                names += [t.attr for t in targets if isinstance(t, ast.Attribute)]
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "__setattr__" and len(node.args) > 1:
                arg = node.args[1]  # object.__setattr__(self, "_x", v): a frozen class's own attribute
                names = [arg.value] if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else []
            if isinstance(node, ast.ClassDef):
                for st in node.body:
                    if isinstance(st, (ast.Assign, ast.AnnAssign)):
                        ts = st.targets if isinstance(st, ast.Assign) else [st.target]
                        names += [t.id for t in ts if isinstance(t, ast.Name)]
            for n in names:
                if n.startswith("_") and not n.startswith("__"):
                    defined[n].add(mod)
    hits = set()
    for mod, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__") and mod not in defined.get(a.name, ()):
                        hits.add(f"{mod}: from {'.' * node.level}{node.module or ''} import {a.name}")
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                homes = defined.get(node.attr)
                mine = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if homes and mod not in homes and not mine:
                    hits.add(f"{mod}: .{node.attr} (defined in {', '.join(sorted(homes))})")
    return sorted(hits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--no-trace", action="store_true", help="only the static counts (no JAX run)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    out = {"is_remote_path": remote_branches(), "private_crossings": private_crossings()}
    if not args.no_trace:
        out["save_state"] = trace_save_state()
    rb = out["is_remote_path"]
    print(f"is_remote_path( call sites: {sum(rb.values())} in {len(rb)} files {rb}")
    pc = out["private_crossings"]
    names = sorted({re.search(r"(?:import |\.)(_\w+)", h).group(1) for h in pc})
    print(f"private names crossing modules: {len(names)} names, {len(pc)} uses")
    for h in pc:
        print("   ", h)
    if "save_state" in out:
        w = out["save_state"]
        print(f"save_state walk: {len(w['files'])} files {w['files']}")
        print(f"  calls into each file {w['entries']}; climbs back up {w['climbs']}; re-entries {len(w['reentries'])}")
        print(f"  distinct functions entered per file {w['distinct_entries']} ({len(w['edges'])} distinct edges)")
        print(f"  entered from {w['entered_from']}")
        for r, n in w["reentries"]:
            print(f"    {n}x {r}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
