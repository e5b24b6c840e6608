"""Start `python -m eformer_nb.serve` on a free loopback port for a test module, and read its metrics."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx


def start_server(*args: str, timeout: float = 180) -> tuple[subprocess.Popen, str]:
    "The server process and its URL once `/health` answers 200 (the CLI prints the port it bound)."
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "eformer_nb.serve", "--port", "0", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    t0, lines = time.monotonic(), []
    while True:
        line = proc.stdout.readline()
        lines.append(line)
        if m := re.search(r"on (http://127\.0\.0\.1:\d+)", line):
            url = m.group(1)
            break
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            proc.kill()
            raise RuntimeError("the server did not start:\n" + "".join(lines)[-3000:])
    while time.monotonic() - t0 < timeout:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{url}/health did not answer within {timeout} s")


def stop_server(proc: subprocess.Popen, timeout: float = 60) -> int:
    "SIGTERM, then wait; SIGKILL if it does not end. Returns the exit code."
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def metric(url: str, name: str) -> float:
    "One sample of `/metrics` (Prometheus text), e.g. metric(url, 'eformer_nb_kv_pages_used')."
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics:\n{text[:2000]}"
    return float(m.group(1))


def wait_metric(url: str, name: str, value: float, timeout: float = 60) -> float:
    "Poll until metric `name` equals `value`; returns it (the last value seen if the time runs out)."
    t0 = time.monotonic()
    while (v := metric(url, name)) != value and time.monotonic() - t0 < timeout:
        time.sleep(0.2)
    return v
