"""A batteries-included JAX toolkit for building, quantizing, scaling, checkpointing and running transformer workloads, written notebook-first."""


def __getattr__(name: str):
    # The version lives once, in settings.ini; read it from the installed metadata on demand
    # so that `import eformer_nb` stays as cheap as possible.
    if name == "__version__":
        from importlib.metadata import version
        return version("eformer-nb")
    raise AttributeError(f"module 'eformer_nb' has no attribute {name!r}")
