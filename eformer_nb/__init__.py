"""A batteries-included JAX toolkit for building, quantizing, scaling, checkpointing and running transformer
workloads, written notebook-first."""

# eformer's top-level packages, importable as attributes (`import eformer_nb; eformer_nb.pytree.tree_add`) as in
# eformer; each is imported on first access, so `import eformer_nb` itself stays cheap.
from eformer_nb.eformer_paths import install as _install_eformer_paths

_install_eformer_paths()  # eformer's module paths that we organise differently (nbs/97_eformer_paths.ipynb): stdlib only

_SUBPACKAGES = ("aparser", "common_types", "escale", "executor", "infra", "jaximus", "loggings", "modules", "mpric",
                "ops", "optimizers", "paths", "pytree", "serialization")


def __getattr__(name: str):
    # The version lives once, in settings.ini; read it from the installed metadata on demand
    # so that `import eformer_nb` stays as cheap as possible.
    if name == "__version__":
        from importlib.metadata import version
        return version("eformer-nb")
    if name in _SUBPACKAGES:
        import importlib
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module 'eformer_nb' has no attribute {name!r}")
