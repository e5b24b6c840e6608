"""`python -m eformer_nb.demo` when a local Ray cannot start: exit status 1 and one line naming the cause.

The start failure is real, not mocked: TMPDIR is a directory whose path is so long that Ray's session socket
(`<temp dir>/eformer-ray-*/session_*/sockets/plasma_store`) passes the 107-byte AF_UNIX limit, so each of
`auto_ray_cluster`'s three start tries fails within seconds, and the demo turns its `RayStartError` into one line.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def test_demo_exits_1_with_one_line_when_ray_cannot_start(tmp_path):
    from eformer_nb.executor.cluster_util import ray_processes

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # start a local Ray, never join one
    env.update(TMPDIR=str(deep), PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    argv = ["--model", "tiny", "--steps", "2", "--checkpoint-every", "1", "--crash-at-step", "0"]
    p = subprocess.run([sys.executable, "-m", "eformer_nb.demo", *argv], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 1, (p.returncode, p.stderr[-3000:])
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("eformer_nb.demo: auto_ray_cluster: local Ray did not start (3 tries"), p.stderr[-3000:]
    assert "AF_UNIX path length" in last and f"session logs: {deep}" in last, last  # the cause and where to look
    assert "Traceback" not in p.stderr and p.stdout == "", (p.stdout, p.stderr[-3000:])  # no trace, no report
    tries = sorted(deep.glob("eformer-ray-*"))
    assert len(tries) == 3 and all(ray_processes(str(d)) == [] for d in tries), tries  # every try's processes stopped


def test_tiny_demo_resume_is_checked_by_digests_and_a_changed_record_is_caught(tmp_path):
    """The whole job through a local Ray with the tiny random model: the worker SIGKILLs itself after step 5, the
    executor retries, the new worker resumes from the step-4 checkpoint. The report shows the restored state and the
    recomputed step 5 bit-identical to the killed worker's (digest and loss), and the same check on the same logs
    with one record of the killed attempt changed fails and names the step: the check is not vacuous."""
    import json

    import numpy as np

    from eformer_nb.demo import check_resume, load_report, read_step_logs, report_problems

    out, report_json = tmp_path / "run", tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # start a local Ray, never join one
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    argv = ["--model", "tiny", "--seq-len", "32", "--batch-size", "4", "--steps", "8", "--checkpoint-every", "2",
            "--crash-at-step", "5", "--max-new-tokens", "8", "--prompt", "The ", "--out-dir", str(out),
            "--report-json", str(report_json)]
    p = subprocess.run([sys.executable, "-m", "eformer_nb.demo", *argv], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    assert "losses and state digests bit-identical to the killed run: True" in p.stdout, p.stdout
    r = load_report(str(report_json))
    assert r["attempts"] == [("preempted", "worker-crashed"), ("succeeded", "")], r["attempts"]
    assert (r["killed_at_step"], r["resume_step"]) == (5, 4)
    assert (r["restored_state_identical"], r["replayed_steps_identical"], r["frozen_base_identical"]) == \
        ((1, True), (1, True), (2, True)), r
    assert report_problems(r) == [] and "identical_to_uninterrupted" not in r

    killed, resumed = read_step_logs(str(out))
    assert [rec["step"] for rec in killed["steps"]] == [0, 1, 2, 3, 4, 5]  # written before the SIGKILL
    assert [rec["step"] for rec in resumed["steps"]] == [4, 5, 6, 7, 8]
    flipped = np.array([killed["steps"][5]["loss"]], np.float32).view(np.uint32) ^ np.uint32(1)  # the lowest bit
    one_bit = float(flipped.view(np.float32)[0])
    for step, field, value, kind in [(5, "digest", "0" * 64, "replayed"), (5, "loss", one_bit, "replayed"),
                                     (4, "digest", "0" * 64, "restored")]:
        changed = json.loads(json.dumps(killed))
        changed["steps"][step][field] = value
        check = check_resume([changed, resumed])
        assert check[kind] == (1, False), (step, field, check)
        assert check["mismatches"] and check["mismatches"][0].startswith(f"step {step} ({kind}): the "), check
        bad = {**r, "restored_state_identical": check["restored"], "replayed_steps_identical": check["replayed"],
               "resume_mismatches": check["mismatches"]}
        assert report_problems(bad) == ["the resumed job differs from the killed run: " + check["mismatches"][0]], bad


def test_two_host_demo_resumes_bit_identically_and_restores_across_layouts(tmp_path):
    """`--hosts 2` with the tiny model: two JAX processes (Ray CPU workers, gloo) share one mesh over 8 devices with
    fsdp spanning both; process 0 is SIGKILLed after step 3, the executor restarts both, both resume from step 2 and
    the replayed step is bit-identical. Each process wrote its own part of the checkpoint (its bytes reported, a line
    per host), and the two-process checkpoint restores in one process with the digest the job recorded. The
    one-process training run of `make demo` is left out here (`--no-cross-train`): the notebook checks its report
    lines. Every job of the run shares one cache of compiled programs, so the resumed attempt and the restore compile
    almost nothing."""
    import time

    from eformer_nb.demo import load_report, report_problems

    out, report_json = tmp_path / "run", tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # start a local Ray, never join one
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    argv = ["--model", "tiny", "--hosts", "2", "--seq-len", "16", "--batch-size", "8", "--steps", "4",
            "--checkpoint-every", "2", "--crash-at-step", "3", "--max-new-tokens", "4", "--prompt", "The ",
            "--no-cross-train", "--out-dir", str(out), "--report-json", str(report_json)]
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "eformer_nb.demo", *argv], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    print(f"the two-host demo took {time.monotonic() - t0:.0f} s")
    assert p.returncode == 0, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    r = load_report(str(report_json))
    assert r["attempts"] == [("preempted", "worker-crashed"), ("succeeded", "")], r["attempts"]
    assert (r["killed_at_step"], r["resume_step"]) == (3, 2)
    assert (r["restored_state_identical"], r["replayed_steps_identical"]) == ((1, True), (1, True)), r
    assert report_problems(r) == [], report_problems(r)

    hosts = r["hosts"]
    assert [(h["process"], h["processes"], len(h["devices"])) for h in hosts] == [(0, 2, 4), (1, 2, 4)], hosts
    assert all(h["axis_processes"]["fsdp"] == 2 and h["axis_processes"]["tp"] == 1 for h in hosts), hosts
    assert len({h["pid"] for h in hosts}) == 2
    total = r["checkpoint_bytes"][4]
    for h in hosts:  # the resumed attempt saved step 4: each process wrote at least its own shards, not the other's
        (step, wrote, owned), = h["written"]
        assert step == 4 and owned <= wrote < total, (h, total)
    assert sum(h["written"][0][2] for h in hosts) <= total
    lines = p.stdout.splitlines()
    assert sum(line.startswith(("host 0 of 2", "host 1 of 2")) for line in lines) == 2, p.stdout

    assert list(r["cross_restore"]) == ["hosts_in_one"] and "loss_max_abs_diff" not in r, r["cross_restore"]
    c = r["cross_restore"]["hosts_in_one"]
    assert (c["step"], c["processes"], c["restored"]) == (2, [1], [c["written"]]), c
    assert sum(line.startswith("cross-layout restore step-2 of the 2-process checkpoint restored in 1 process: "
                               "digest equal to the recorded one: True") for line in lines) == 1, p.stdout
