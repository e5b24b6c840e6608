"""The import graph of the package, read from its source with `ast` (nothing is imported).

Every `import` / `from ... import` of a package module counts, at module level or inside a function, and so does
`importlib.import_module("<package>...")` with a literal name. Prints the number of edges, the import cycles (strongly
connected components) and the edges from `infra/` or `serialization/` up into `modules/`. Exit status 0 either way: a
report for issue 38 (one home per concept), not yet a gate.

    python .ci/import_graph.py [eformer_nb]
"""
from __future__ import annotations

import ast
import pathlib
import sys


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    "Dotted module name -> file, for every .py under `root` (a package's `__init__` named as the package)."
    out = {}
    for p in root.rglob("*.py"):
        parts = p.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _absolute(current: str, is_package: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _targets(node: ast.AST, name: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        m = _absolute(name, is_package, node.level, node.module)
        return [m] + [f"{m}.{a.name}" for a in node.names]
    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
        if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            return [node.args[0].value]
    return []


def edges(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    "Module -> the package modules it imports (anywhere in its source)."
    out = {}
    for name, p in mods.items():
        found = set()
        for node in ast.walk(ast.parse(p.read_text())):
            found.update(t for t in _targets(node, name, p.name == "__init__.py") if t in mods and t != name)
        out[name] = found
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    "The strongly connected components with more than one module (Tarjan)."
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def main(root: str = "eformer_nb") -> None:
    pkg = pathlib.Path(root)
    mods = modules(pkg)
    graph = edges(mods)
    print(f"{len(mods)} modules, {sum(map(len, graph.values()))} import edges (module- and function-level)")
    found = cycles(graph)
    print(f"{len(found)} import cycle(s):")
    for c in found:
        print("  ", " <-> ".join(m.removeprefix(pkg.name + ".") for m in c))
    lower = (f"{pkg.name}.infra", f"{pkg.name}.serialization")
    up = sorted((a, b) for a, es in graph.items() for b in es
                if a.startswith(lower) and b.startswith(f"{pkg.name}.modules"))
    print(f"{len(up)} edge(s) from infra/ or serialization/ into modules/:")
    for a, b in up:
        print("  ", a, "->", b)


if __name__ == "__main__":
    main(*sys.argv[1:])
