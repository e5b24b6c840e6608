"""Test-only import alias: `import eformer.X` gives the module `eformer_nb.X` (the same object, not a copy).

eformer_nb ships no package named `eformer`. A client written against eformer (EasyDeL) runs unmodified on
eformer_nb in a test process once `install(version)` has put `EformerAlias` first on `sys.meta_path`.

The top-level `eformer` is the one module that is not eformer_nb itself: a thin package whose attributes are
eformer_nb's, except `__version__`, which is the eformer release the client pins. EasyDeL asserts that exact
version at import; eformer_nb's own version (`eformer_nb.__version__`) is untouched.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

ALIAS, TARGET = "eformer", "eformer_nb"


class EformerAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    "Finds `eformer` and `eformer.*`: the top level as a thin package, each submodule as the real `eformer_nb.*`."

    def __init__(self, version: str):
        self.version = version  # what `eformer.__version__` says

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        real = importlib.util.find_spec(TARGET + fullname[len(ALIAS):])
        if real is None:  # no such module under eformer_nb: the normal ModuleNotFoundError
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=real.submodule_search_locations is not None)

    def create_module(self, spec):
        if spec.name == ALIAS:
            top = types.ModuleType(ALIAS, f"import alias of {TARGET} (tests/eformer_alias.py)")
            top.__version__ = self.version
            top.__getattr__ = lambda name: getattr(importlib.import_module(TARGET), name)
            return top
        module = importlib.import_module(TARGET + spec.name[len(ALIAS):])
        self._real_spec = module.__spec__  # the import machinery overwrites __spec__ with the alias spec next
        return module

    def exec_module(self, module):
        if module.__name__ != ALIAS:
            module.__spec__ = self._real_spec  # the module keeps its own identity: eformer_nb.X


def install(version: str) -> EformerAlias:
    "Put the alias first on `sys.meta_path` (once); `eformer.__version__` will be `version`."
    for finder in sys.meta_path:
        if isinstance(finder, EformerAlias):
            if finder.version != version:
                raise ValueError(f"the eformer alias is installed with version {finder.version!r}, not {version!r}")
            return finder
    finder = EformerAlias(version)
    sys.meta_path.insert(0, finder)
    return finder
