"""Issue 45: SIGTERM drains the server: the request in flight finishes, new connections are refused, the process
exits. Its own server (it is stopped by the test)."""
from __future__ import annotations

import json
import signal
import time

import httpx

from serve_helpers import start_server


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones():
    proc, url = start_server("--model", "tiny", "--max-num-seqs", "2", "--page-size", "8", "--max-model-length", "256",
                             "--drain-timeout", "60")
    try:
        body = {"model": "tiny", "prompt": "go on", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "temperature": 0}
        texts, reason = [], None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            for line in lines:  # the request is running: its first token came back
                if line.startswith("data: {"):
                    texts.append(json.loads(line[6:])["choices"][0]["text"])
                    break
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            try:
                refused = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                                     timeout=10).status_code
            except httpx.TransportError as e:
                refused = type(e).__name__
            for line in lines:
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    texts.append(choice["text"])
                    reason = choice["finish_reason"] or reason
        assert reason == "length", reason  # the request in flight ran to its end
        assert refused in ("ConnectError", 503), refused
        code = proc.wait(60)
        print(f"drained in {time.monotonic() - t0:.1f} s; a new request got {refused}; exit code {code}")
        assert code in (0, -signal.SIGTERM), code  # uvicorn re-raises the signal once drained: killed by SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
