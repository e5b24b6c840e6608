"""Fail when two notebooks declare the same `#| default_exp` (each module has one source notebook)."""
import json, re, sys
from collections import defaultdict
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else "nbs")
pat = re.compile(r"^#\|\s*default_exp\s+(\S+)", re.M)
seen = defaultdict(list)
for nb in sorted(root.rglob("*.ipynb")):
    if any(p.startswith((".", "_")) for p in nb.relative_to(root).parts): continue
    cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
    mods = [m for c in cells if c["cell_type"] == "code" for m in pat.findall("".join(c["source"]))]
    if len(mods) > 1: sys.exit(f"{nb}: declares default_exp {len(mods)} times ({mods}); one per notebook")
    for m in mods: seen[m].append(str(nb))
dups = {m: nbs for m, nbs in seen.items() if len(nbs) > 1}
if dups:
    sys.exit("duplicate default_exp:\n" + "\n".join(f"  {m}: {', '.join(v)}" for m, v in dups.items()))
print(f"{len(seen)} modules, each exported from exactly one notebook")
