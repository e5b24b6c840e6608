"""pytest plugin for `make peer-suite`: eformer's own tests/ run against eformer_nb.

Loaded with `-p peer_suite` (never collected by `pytest tests/`: it lives in .ci/, not tests/). It installs the
test-only alias of tests/eformer_alias.py (`eformer.X` is the module `eformer_nb.X`) with one addition that only this
suite gets: a private module eformer has and eformer_nb does not (`eformer.aparser._aparser`) falls back to its public
parent (`eformer_nb.aparser`), the home of the names eformer's tests import from it. At the end it writes a per-file
summary (passed / failed / errors / skipped) to $PEER_SUMMARY (default `_peer/summary.md`, ignored by git).
"""
from __future__ import annotations

import collections
import importlib
import importlib.machinery
import importlib.util
import json
import os
import pathlib
import sys

import eformer_alias

EFORMER_VERSION = "0.1.0"  # the eformer release whose tests/ this suite runs (4b17881)


def _exists(module: str) -> bool:
    "Whether the module `module` exists (False also when a parent is a plain module, not a package)."
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


class PeerAlias(eformer_alias.EformerAlias):
    "The alias, plus: `eformer.a.b._private` with no `eformer_nb.a.b._private` resolves to `eformer_nb.a.b`."

    @staticmethod
    def _real(fullname):
        """The eformer_nb module `fullname` (an `eformer...` name) resolves to: itself; else, when a private part of
        it (`_aparser`, `_tx`) does not exist under eformer_nb, the public parent of the first such part."""
        parts = fullname.split(".")[1:]
        for i, part in enumerate(parts):
            if part.startswith("_") and not _exists(".".join([eformer_alias.TARGET, *parts[:i + 1]])):
                return ".".join([eformer_alias.TARGET, *parts[:i]])
        return ".".join([eformer_alias.TARGET, *parts])

    def find_spec(self, fullname, path=None, target=None):
        if fullname != eformer_alias.ALIAS and not fullname.startswith(eformer_alias.ALIAS + "."):
            return None
        real = importlib.util.find_spec(self._real(fullname))
        if real is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=real.submodule_search_locations is not None)

    def create_module(self, spec):
        if spec.name == eformer_alias.ALIAS:
            return super().create_module(spec)
        module = importlib.import_module(self._real(spec.name))
        self._real_spec = module.__spec__
        return module


def _seed_private_modules(src: pathlib.Path) -> None:
    """Python looks a submodule up only under a package: `eformer.aparser._aparser` cannot be found through a finder
    when `eformer.aparser` resolves to the plain module `eformer_nb.aparser`. Each such private module of the eformer
    tree at `src` is put in `sys.modules` as the parent it falls back to."""
    for path in sorted((src / "eformer").rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            continue
        name = ".".join(parts)
        real = PeerAlias._real(name)
        if real != eformer_alias.TARGET + name[len(eformer_alias.ALIAS):] and _exists(real):
            module = importlib.import_module(real)
            if not hasattr(module, "__path__"):
                sys.modules.setdefault(name, module)


def install(src: pathlib.Path) -> None:
    "The alias first on `sys.meta_path` (once), and the private modules of the eformer tree at `src` seeded."
    if not any(isinstance(f, PeerAlias) for f in sys.meta_path):
        sys.meta_path.insert(0, PeerAlias(EFORMER_VERSION))
    _seed_private_modules(src)


def pytest_configure(config):
    # subprocesses a test starts (tests/imports/test_import_xla.py imports every eformer module in a fresh python)
    # get the alias too: .ci/peer_site/sitecustomize.py installs it where EFORMER_NB_PEER_SRC is set
    os.environ["EFORMER_NB_PEER_SRC"] = str(config.rootpath)
    install(pathlib.Path(str(config.rootpath)))
    config._peer_counts = collections.defaultdict(collections.Counter)


def _file(nodeid):
    return nodeid.split("::")[0]


def pytest_runtest_logreport(report):
    counts = _config._peer_counts
    f = _file(report.nodeid)
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = "error" if report.when == "setup" and report.failed else report.outcome
        if report.when == "call" and hasattr(report, "wasxfail"):
            outcome = "xfail"
        counts[f][outcome] += 1
    elif report.when == "teardown" and report.failed:
        counts[f]["error"] += 1


def pytest_collectreport(report):
    if report.failed:
        _config._peer_counts[_file(report.nodeid)]["uncollectable"] += 1


_config = None


def pytest_sessionstart(session):
    global _config
    _config = session.config


def pytest_sessionfinish(session, exitstatus):
    counts = _config._peer_counts
    out = pathlib.Path(os.environ.get("PEER_SUMMARY", "_peer/summary.md"))
    out.parent.mkdir(parents=True, exist_ok=True)
    keys = ["passed", "failed", "error", "skipped", "xfail", "uncollectable"]
    rows = ["| file | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    total = collections.Counter()
    for f in sorted(counts):
        total.update(counts[f])
        rows.append(f"| {f} | " + " | ".join(str(counts[f][k]) for k in keys) + " |")
    rows.append("| **total** | " + " | ".join(str(total[k]) for k in keys) + " |")
    ran = total["passed"] + total["failed"] + total["error"]
    rows.append(f"\n{total['passed']} of {ran} collected tests pass ({100 * total['passed'] / max(ran, 1):.1f}%); "
                f"{total['uncollectable']} file(s) uncollectable.")
    out.write_text("\n".join(rows) + "\n")
    out.with_suffix(".json").write_text(json.dumps({f: dict(c) for f, c in counts.items()}, indent=1))
    print("\n" + "\n".join(rows))
    floor = os.environ.get("PEER_MIN_PASS")  # the gate: this share of the collected tests passes, every file collects
    if floor:
        ok = total["passed"] >= float(floor) * ran and not total["uncollectable"]
        print(f"peer-suite gate (PEER_MIN_PASS={floor}, no uncollectable file): {'met' if ok else 'MISSED'}")
        session.exitstatus = 0 if ok else 1
