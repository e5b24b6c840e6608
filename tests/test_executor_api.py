"""Every name of `eformer.executor` and `eformer.executor.ray` in eformer's API inventory exists in `eformer_nb`
with a compatible signature: each parameter the contract lists is accepted (ours may add keyword-only ones).

The inventory lives beside the repository (`../shared/reference/eformer-public-api.txt`, or `$EFORMER_API_INVENTORY`);
where it is absent the test is skipped and says so.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = [os.environ.get("EFORMER_API_INVENTORY", ""), ROOT.parent / "shared/reference/eformer-public-api.txt",
              ROOT.parent.parent / "shared/reference/eformer-public-api.txt"]
INVENTORY = next((Path(p) for p in CANDIDATES if p and Path(p).is_file()), None)


def _split_params(text: str) -> list[str]:
    "Split a parameter list at the commas outside brackets."
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            out.append(cur); cur = ""
        else:
            cur += ch
    return out + [cur]


def _contract(section: str, text: str) -> dict[str, dict]:
    "name -> {'params': [...], 'members': {member: [params]}} for one `## section` of the inventory."
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    out, current = {}, None
    for line in body.splitlines():
        if not line.strip():
            continue
        code = line.split("    # defined in")[0]
        sig = re.match(r"\s*(?:classmethod |staticmethod |property )?(?:def |class )?(\w+)\s*(?:\((.*)\))?", code)
        params = [p.strip().split("=")[0].split(":")[0].lstrip("*").strip() for p in _split_params(sig.group(2) or "")]
        params = [p for p in params if p and p not in ("self", "cls")]
        if not line.startswith(" "):
            current = sig.group(1)
            out[current] = {"params": params if line.startswith("def ") else [], "members": {}, "class": line.startswith("class ")}
        elif current and re.match(r"\s*(classmethod |staticmethod |property )?\w+\(", line):
            out[current]["members"][sig.group(1)] = params
        elif current and re.match(r"\s*\w+\s*:", line):
            out[current]["members"][sig.group(1).strip()] = None  # a field
    return out


def _missing_params(fn, params):
    sig = inspect.signature(fn)
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return []
    return [p for p in params if p not in sig.parameters]


@pytest.mark.skipif(INVENTORY is None, reason="eformer API inventory not found beside the repository")
@pytest.mark.parametrize("section", ["eformer.executor", "eformer.executor.ray"])
def test_executor_names_and_signatures(section):
    contract = _contract(section, INVENTORY.read_text())
    assert len(contract) >= 10, f"parsed too little of {section}: {sorted(contract)}"
    mod = importlib.import_module(section.replace("eformer", "eformer_nb", 1))
    problems = []
    for name, spec in contract.items():
        if not hasattr(mod, name):
            problems.append(f"{name}: missing")
            continue
        obj = getattr(mod, name)
        if spec["params"] and (m := _missing_params(obj, spec["params"])):
            problems.append(f"{name}: does not accept {m}")
        fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
        for member, params in spec["members"].items():
            if member == "__init__":
                if m := _missing_params(obj, params):
                    problems.append(f"{name}(): does not accept {m}")
            elif params is None:
                if member not in fields and not hasattr(obj, member) and member not in getattr(obj, "__annotations__", {}):
                    problems.append(f"{name}.{member}: field missing")
            elif not hasattr(obj, member):
                problems.append(f"{name}.{member}: method missing")
            elif m := _missing_params(getattr(obj, member), params):
                problems.append(f"{name}.{member}: does not accept {m}")
    assert not problems, "\n".join(problems)
