"""`make peer-suite` only (this directory is on PYTHONPATH there, nowhere else): a Python process started by one of
eformer's tests resolves `eformer.X` to `eformer_nb.X` as the test process does (.ci/peer_suite.py)."""
import os
import pathlib

if os.environ.get("EFORMER_NB_PEER_SRC"):
    import peer_suite

    peer_suite.install(pathlib.Path(os.environ["EFORMER_NB_PEER_SRC"]))
