"""The doc-link settings of every docs build, in one place: imported by `.ci/docs_outputs.py` (pyproject's `doc_procs`,
which nbdev's docs pipeline imports in `nbdev-docs` with Quarto, `nbdev-readme` and `.ci/docs.py` alike), it hands
nbdev's link table what nbdev 3 cannot read here, so every build links the same names to the same targets:

- source and doc URLs: nbdev 3 takes `git_url` and the docs URL from pyproject's `[project.urls]`, which are dynamic
  here (settings.ini holds them, once); without them show_doc has no `[source]` link and a name links root-absolute;
- names in prose looked up without the `eformer_nb.` prefix (nbdev's `strip_libs` defaults to the project name,
  `eformer-nb`, not the package's entry-point name `eformer_nb`, so `ePath` would not link).

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
        def _build_lookup_table(strip_libs=None, incl_libs=None, skip_mods=None):
            return table(urls["lib_path"] if strip_libs is None else strip_libs, incl_libs, skip_mods)
        _build_lookup_table._site = True
        _build_lookup_table.cache_clear = table.cache_clear
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
