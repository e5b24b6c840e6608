"""Exported-cell lengths (lines of each `#| export` cell, the directive included) of the notebooks that changed between
two commits, before and after: median, max and how many exceed 40 lines (issue 38's cell-length statistics).

    python .ci/cell_stats.py BASE [HEAD]
"""
import json, re, statistics, subprocess, sys


def lengths(rev: str, nb: str) -> list:
    "line counts of the exported cells of `nb` at `rev` (empty when the notebook is not there)"
    r = subprocess.run(["git", "show", f"{rev}:{nb}"], capture_output=True, text=True)
    if r.returncode: return []
    return [len("".join(c["source"]).splitlines()) for c in json.loads(r.stdout)["cells"]
            if c["cell_type"] == "code" and re.match(r"\s*#\|\s*export\b", "".join(c["source"]))]


def stats(xs: list) -> str:
    if not xs: return "n=0"
    return f"n={len(xs)} median={statistics.median(xs)} max={max(xs)} >40={sum(x > 40 for x in xs)}"


if __name__ == "__main__":
    base, head = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "HEAD")
    nbs = subprocess.run(["git", "diff", "--name-only", f"{base}..{head}", "--", "nbs/*.ipynb"],
                         capture_output=True, text=True, check=True).stdout.split()
    before, after = [], []
    for nb in nbs:
        b, a = lengths(base, nb), lengths(head, nb)
        before += b; after += a
        print(f"{nb}: before {stats(b)} | after {stats(a)}")
    print(f"ALL {len(nbs)} notebooks: before {stats(before)} | after {stats(after)}")
