"""The doc-link settings of every docs build, in one place: imported by `.ci/docs_outputs.py` (pyproject's `doc_procs`,
which nbdev's docs pipeline imports in `nbdev-docs` with Quarto, `nbdev-readme` and `.ci/docs.py` alike), it hands
nbdev's link table what nbdev 3 cannot read here, so every build links the same names to the same targets:

- source and doc URLs: nbdev 3 takes `git_url` and the docs URL from pyproject's `[project.urls]`, which are dynamic
  here (settings.ini holds them, once); without them show_doc has no `[source]` link and a name links root-absolute;
- names in prose looked up without the `eformer_nb.` prefix (nbdev's `strip_libs` defaults to the project name,
  `eformer-nb`, not the package's entry-point name `eformer_nb`, so `ePath` would not link);
- a short name that two modules define links to the one a package re-exports in its `__all__` (nbdev takes the
  first module in alphabetical order: `quantize` went to `infra.mixins.adapters`, not `ops.quantization`).

Both are patches of nbdev's `doclinks` in the importing process; `apply()` is idempotent and returns `restore`.
"""
import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def settings() -> dict:
    "settings.ini's URLs, as nbdev's link table names them"
    ini = configparser.ConfigParser(delimiters=["="])
    ini.read(ROOT / "settings.ini", encoding="utf-8")
    d = ini["DEFAULT"]
    return dict(git_url=d.get("git_url", ""), branch=d.get("branch", "main"), doc_host=d.get("doc_host", ""),
                doc_baseurl=d.get("doc_baseurl", "/"), lib_path=d.get("lib_path", "eformer_nb"))


def package_homes() -> dict:
    "name -> the module a package `__init__.py` re-exports it from (in its `__all__`; chains of packages followed)"
    import ast
    pkgs = {}  # package -> {public name: "module.name" it imports}
    for init in sorted((ROOT / urls_lib()).rglob("__init__.py")):
        pkg = ".".join(init.relative_to(ROOT).parent.parts)
        tree = ast.parse(init.read_text(encoding="utf-8"))
        public = set()
        for n in tree.body:
            if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets):
                public |= {e.value for e in getattr(n.value, "elts", []) if isinstance(e, ast.Constant)}
        got = pkgs.setdefault(pkg, {})
        for n in tree.body:
            if not isinstance(n, ast.ImportFrom): continue
            base = pkg.split(".")[:len(pkg.split(".")) - n.level + 1] if n.level else []
            mod = ".".join(base + ([n.module] if n.module else []))
            for a in n.names:
                if (a.asname or a.name) in public: got[a.asname or a.name] = f"{mod}.{a.name}"
    homes = {}
    for got in pkgs.values():
        for name, full in got.items():
            for _ in range(10):  # a package re-exporting another package's name: follow it to the module
                mod, _, nm = full.rpartition(".")
                if nm not in pkgs.get(mod, {}): break
                full = pkgs[mod][nm]
            homes.setdefault(name, full)
    return homes


def urls_lib() -> str: return settings()["lib_path"]


def apply():
    "patch nbdev's link table (this process); returns a function that undoes it"
    import nbdev.doclinks as dl
    saved = dl._qual_syms, dl._build_lookup_table
    urls = settings()

    def restore():
        dl._qual_syms, dl._build_lookup_table = saved
        dl._build_lookup_table.cache_clear()

    table = saved[1]
    if not getattr(table, "_site", False):
        import functools
        homes = package_homes()

        @functools.lru_cache(None)
        def _build_lookup_table(strip_libs=None, incl_libs=None, skip_mods=None):
            entries, syms = table(urls["lib_path"] if strip_libs is None else strip_libs, incl_libs, skip_mods)
            syms = {**syms, **{n: syms[full] for n, full in homes.items() if full in syms}}
            return entries, syms
        _build_lookup_table._site = True
        clear_own = _build_lookup_table.cache_clear
        _build_lookup_table.cache_clear = lambda: (clear_own(), table.cache_clear())
        dl._build_lookup_table = _build_lookup_table

    qual = dl._qual_syms
    if not getattr(qual, "_site", False):
        def _qual_syms(entries):
            s = entries.get("settings", {})
            if s.get("lib_path") == urls["lib_path"]:  # only our own package's table
                s = dict(s)
                if not s.get("git_url"): s.update(git_url=urls["git_url"], branch=urls["branch"])
                if not s.get("doc_host"): s.update(doc_host=urls["doc_host"], doc_baseurl=urls["doc_baseurl"])
                entries = {**entries, "settings": s}
            return qual(entries)
        _qual_syms._site = True
        dl._qual_syms = _qual_syms
    dl._build_lookup_table.cache_clear()
    return restore


apply()
