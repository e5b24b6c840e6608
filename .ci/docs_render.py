"""The show_doc renderer of the docs, registered the nbdev way (`renderer` in pyproject's `[tool.nbdev]`, with `.ci`
on PYTHONPATH): `nbdev-docs` with Quarto and `.ci/docs.py site` both execute show_doc cells through it, so the two
builds show the same entries.

It is nbdev's `BasicMarkdownRenderer` plus:
- fastcore's parameter table (`DocmentTbl`) under the signature when parameters carry docments;
- no annotations fastcore infers from a default's type (`jax._src...._ScalarMeta`, `_Empty`, `NoneType`): the code
  says nothing of them; default values as a reader writes them (`MISSING`, `Name(...)`, public jax names);
- the real constructor signature of NamedTuple-like classes, `class` for classes and no `->None`;
- a signature longer than `WRAP` characters has one parameter a line (fastcore's layout, as with docments);
- `__dunder__` names escaped in the heading, so Markdown does not turn them bold;
- a `[source]` link with its line number where nbdev's ends in `#LNone` (a name documented where it is imported).
"""
import inspect, re, sys

from fastcore.docments import DocmentTbl, DocmentText, docments
from nbdev.showdoc import BasicMarkdownRenderer

WRAP = 80


def _drop_inferred_annos(sym, dm):
    "fastcore annotates a parameter that has none with its default's type; the code says nothing of it"
    try: sig = inspect.signature(sym)
    except (TypeError, ValueError): return
    for name, p in sig.parameters.items():
        if name in dm and p.annotation is inspect.Parameter.empty:
            dm[name]["anno"] = inspect.Parameter.empty


def _kwargs_docments(sym, dm):
    """The docments of `*args`/`**kwargs` too. fastcore's table reads them with `args_kwargs=False`, which skips those
    parameters and hands a comment on the `**kwargs` line to the return value ("Returns: `field=value` pairs")."""
    try:
        full = docments(sym, full=True, args_kwargs=True)
    except Exception:  # what fastcore cannot read keeps the table it made
        return
    for name, v in full.items():
        if name in dm:
            dm[name]["docment"] = inspect.Parameter.empty if v["docment"] is None else v["docment"]


class Renderer(BasicMarkdownRenderer):
    "nbdev's show_doc renderer, plus fastcore's parameter table when parameters carry docments"

    def __init__(self, sym, name=None, title_level=3, maxline=110):
        _signature_from_init(sym)
        super().__init__(sym, name=name, title_level=title_level, maxline=maxline)
        target = self.sym
        self.is_class = inspect.isclass(target)
        if isinstance(self.dm, DocmentText):
            _drop_inferred_annos(target, self.dm.dm)
            names = [k for k in self.dm.dm if k != "return"]
            if self.is_class and names == ["args", "kwargs"]:
                # a NamedTuple / __new__-built class: the constructor's real signature
                self.dm = _ctor_signature(target, self.nm) or self.dm
        try:
            self.tbl = DocmentTbl(target)
            _kwargs_docments(target, self.tbl.dm)
            _drop_inferred_annos(target, self.tbl.dm)
        except Exception as e:  # a symbol fastcore cannot read stays without a table, and says so
            print(f"docs: no parameter table for {self.nm}: {type(e).__name__}: {e}", file=sys.stderr)
            self.tbl = None
        if isinstance(self.dm, DocmentText):
            if self.tbl is not None and self.tbl.has_docment:
                for v in self.dm.dm.values(): v["docment"] = None  # the table holds them
            if self.is_class and self.dm.dm.get("return", {}).get("anno") is None:
                self.dm.dm.pop("return", None)  # `__init__ -> None`: a class signature returns nothing to show
            if max(map(len, str(self.dm).splitlines())) > WRAP: self.dm.maxline = 1  # one parameter a line

    def _repr_markdown_(self):
        md = super()._repr_markdown_()
        if "#LNone)" in md: md = md.replace("#LNone)", _source_anchor(self.fn) + ")", 1)
        md = re.sub(r"^(#+ .*)$", lambda m: m.group(1).replace("_", "\\_"), md, count=1, flags=re.M)
        if self.is_class: md = md.replace("```python\ndef ", "```python\nclass ", 1)
        md = re.sub(r"\)\s*->\s*None:", "):", md)
        md = _clean_reprs(md)
        if self.tbl is not None and self.tbl.has_docment:  # the table shows the same defaults
            md += "\n\n" + _clean_reprs(self.tbl._repr_markdown_())
        return md


def _source_anchor(fn: str) -> str:
    """`#L<line>` of the full name `fn` in its module's file, else "" (a link to the file). nbdev looks a name's line up
    by the name as given, but knows lines only by the name inside its module (`ePath.read_bytes`, as `@patch` names
    them too): a name documented where it is imported, `eformer_nb.paths.ePath.read_bytes`, got `#LNone`."""
    from nbdev.doclinks import NbdevLookup, _lineno
    res = NbdevLookup()[fn]
    if not isinstance(res, tuple): return ""
    py = res[1]
    mod = py.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    line = _lineno(fn, py) or _lineno(fn.removeprefix(mod + "."), py)
    return f"#L{line}" if line else ""


def _signature_from_init(sym):
    """A class whose signature annotations cannot be evaluated (flax nnx modules: `inspect.signature` lands on
    `PytreeMeta.__call__`, annotated with a name flax does not define) is documented by its `__init__` instead."""
    if not inspect.isclass(sym) or "__signature__" in vars(sym):
        return
    try:
        inspect.signature(sym, eval_str=True)
    except NameError:
        init = inspect.signature(sym.__init__)
        sym.__signature__ = init.replace(parameters=list(init.parameters.values())[1:])
    except (TypeError, ValueError):
        pass  # no signature at all: nbdev's renderer shows the name alone


def _ctor_signature(cls, name):
    "`class Name(a: int, b: str = 'x')` from what calling `cls` takes, annotations resolved; None when unknown"
    import typing
    try: sig = inspect.signature(cls)
    except (TypeError, ValueError): return None
    kinds = [p.kind for p in sig.parameters.values()]
    if kinds == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]: return None
    try: hints = typing.get_type_hints(cls)
    except (NameError, TypeError, AttributeError): hints = {}  # unresolvable names: the annotations as written
    parts = []
    for p in sig.parameters.values():
        a = hints.get(p.name, p.annotation)
        s = ("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
        if a is not inspect.Parameter.empty:
            a = getattr(a, "__forward_arg__", a)
            s += ": " + (a if isinstance(a, str) else inspect.formatannotation(a))
        if p.default is not inspect.Parameter.empty: s += f" = {p.default!r}"
        parts.append(s)
    return f"class {name}({', '.join(parts)})"


def _clean_reprs(md: str) -> str:
    "Default values as a reader writes them: `MISSING`, `Name(...)` for other objects, public jax names"
    md = re.sub(r"(?:<|&lt;)dataclasses\._MISSING_TYPE object at 0x[0-9a-f]+(?:>|&gt;)", "MISSING", md)
    md = re.sub(r"(?:<|&lt;)([\w.]+) object at 0x[0-9a-f]+(?:>|&gt;)", r"\1(...)", md)
    return _public_jax_names(md)


_jax_names = {}
def _public_jax_names(text: str) -> str:
    "`jax._src.x.y.Name` -> the public name of the same object (`jax.Array`, `jax.sharding.Mesh`, ...) if any"
    def sub(m):
        path = m.group(0)
        if path not in _jax_names:
            _jax_names[path] = path
            mod, _, attr = path.rpartition(".")
            try:
                import importlib
                obj = getattr(importlib.import_module(mod), attr)
                for pub in ("jax", "jax.numpy", "jax.sharding", "jax.typing", "jax.lax", "jax.tree_util", "jax.stages"):
                    pm = importlib.import_module(pub)
                    hit = next((n for n in dir(pm) if not n.startswith("_") and getattr(pm, n, None) is obj), None)
                    if hit: _jax_names[path] = f"{pub}.{hit}"; break
            except (ImportError, AttributeError): pass
        return _jax_names[path]
    return re.sub(r"\bjax\._src(?:\.\w+)+", sub, text)
