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
            out[current] = {"params": params if line.startswith("def ") else [], "members": {},
                            "class": line.startswith("class ")}
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
                annotated = member in getattr(obj, "__annotations__", {})
                if member not in fields and not hasattr(obj, member) and not annotated:
                    problems.append(f"{name}.{member}: field missing")
            elif not hasattr(obj, member):
                problems.append(f"{name}.{member}: method missing")
            elif m := _missing_params(getattr(obj, member), params):
                problems.append(f"{name}.{member}: does not accept {m}")
    assert not problems, "\n".join(problems)


def _scripted(outcomes):
    "An attempt runner for the executor's retry loop that plays `outcomes` in order and refuses to run any more."
    from eformer_nb.executor.ray.types import _STATUS_BY_OUTCOME, Attempt, JobInfo, JobSucceeded

    def run_one(i):
        assert i < len(outcomes), f"attempt {i} started; the retry budget should have stopped at {len(outcomes)}"
        kind = outcomes[i]
        info = JobInfo("scripted", kind, "CPU")
        st = JobSucceeded(info, i) if kind == "succeeded" else _STATUS_BY_OUTCOME[kind](info, RuntimeError(kind))
        st.attempts = [Attempt(i, kind)]
        return st
    return run_one


@pytest.mark.parametrize("outcomes, preempt, fail, state, n", [
    (["preempted"] * 3 + ["succeeded"], 3, 0, "succeeded", 4),  # exactly the budget: still retried
    (["preempted"] * 3, 2, 5, "preempted", 3),  # one over: the third preemption is the last attempt
    (["failed", "preempted", "failed"], 5, 1, "failed", 3),  # failures and preemptions counted apart
    (["failed"] * 2, 1000, 1, "failed", 2),  # a large preemption budget lends nothing to failures
    (["error", "succeeded"], 5, 5, "error", 1),  # an error (not the job's code, not a preemption) is never retried
    (["cancelled", "succeeded"], 5, 5, "cancelled", 1),
])
def test_retry_budgets(outcomes, preempt, fail, state, n):
    "The executor's retry loop: each kind of ending spends its own budget, `max_retries_*` retries, never more."
    from eformer_nb.executor.ray.executor import _resumable

    st = _resumable(_scripted(outcomes), preempt, fail, 0.0)
    assert (st.info.state, len(st.attempts)) == (state, n), st
    assert [a.outcome for a in st.attempts] == outcomes[:n]
