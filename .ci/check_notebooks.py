"""Notebook rules that nbdev itself does not enforce; fails with every violation listed.

1. Each module is exported from exactly one notebook: `#| default_exp` values are unique.
2. nbdev's docs build runs every code cell that contains an import, so a cell with imports holds
   imports only (unless it is exported, or marked `#| exec_doc` because the docs need it to run).
3. Cells behind a test flag (slow, gpu, tpu, multidevice, bench, hf) hold no import statements:
   the docs build would run them anyway.
4. Every cell has an id, and no notebook that exports a module has "auto" in its path: nbdev 3 writes
   `# %% nb.ipynb #id` headers, and its `_modidx` builder drops a whole module when one header lacks the
   id, and every cell of a notebook whose path contains "auto" (it takes them for its own `__all__` cell),
   so the names of that module would never link in the docs.
"""
import ast, json, re, sys
from collections import defaultdict
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else "nbs")
FLAGS = {"slow", "gpu", "tpu", "multidevice", "bench", "notest", "hf"}
RUN_IN_DOCS = {"export", "exports", "exporti", "exec_doc"}
directive = re.compile(r"^#\|\s*([\w-]+)")
default_exp = re.compile(r"^#\|\s*default_exp\s+(\S+)", re.M)
seen, errors = defaultdict(list), []
for nb in sorted(root.rglob("*.ipynb")):
    if any(p.startswith((".", "_")) for p in nb.relative_to(root).parts):
        continue
    all_cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
    no_id = [i for i, c in enumerate(all_cells) if not c.get("id")]
    if no_id:
        errors.append(f"{nb} cells {no_id} have no id; nbdev's _modidx skips a module exported from such a cell "
                      "(give each an 8-hex-digit id)")
    cells = [c for c in all_cells if c["cell_type"] == "code"]
    if "auto" in str(nb.relative_to(root)) and any(default_exp.search("".join(c["source"])) for c in cells):
        errors.append(f"{nb} exports a module from a path containing 'auto'; nbdev's _modidx skips every cell of "
                      "it: rename the notebook")
    for i, cell in enumerate(cells):
        src = "".join(cell["source"])
        for m in default_exp.findall(src):
            seen[m].append(str(nb))
        names = {m.group(1) for line in src.splitlines() if (m := directive.match(line))}
        try:
            body = ast.parse(src).body
        except SyntaxError:
            continue  # magics and shell escapes: nothing to check
        imports = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
        if imports and names & FLAGS:
            errors.append(f"{nb} code cell {i}: imports in a cell flagged {sorted(names & FLAGS)}; "
                          "move them to an import cell")
        elif imports and len(imports) < len(body) and not names & RUN_IN_DOCS:
            errors.append(f"{nb} code cell {i}: mixes imports with other code; put the imports in a cell of their own")
for m, nbs in seen.items():
    if len(nbs) > 1:
        errors.append(f"default_exp {m} is declared by {len(nbs)} cells: {', '.join(nbs)}")
if errors:
    sys.exit("notebook rule violations:\n  " + "\n  ".join(errors))
print(f"{len(seen)} modules, each exported from exactly one notebook; import cells clean")
