"""Starts ``python -m v41cp serve`` on 127.0.0.1 as a subprocess for the server tests, and stops it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess on a free loopback port; ``url`` is its base address (``…/v1`` for the client)."""

    def __init__(self, *flags: str, devices: int = 1, timeout: float = 420):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env["JAX_PLATFORMS"] = "cpu"
        if devices > 1:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        self.out = tempfile.TemporaryFile("w+")      # a file, not a pipe: a chatty server never blocks on it
        self.proc = subprocess.Popen([sys.executable, "-m", "v41cp", "serve", "--host", "127.0.0.1", "--port",
                                      str(self.port), *flags], env=env, stdout=self.out,
                                     stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not come up within {timeout} s")

    def output(self) -> str:
        self.out.flush()
        self.out.seek(0)
        return self.out.read()

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_idle(self, timeout: float = 30) -> dict:
        """Poll /health until no request is in flight (every page back); returns the last health."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if (h["in_flight"] == 0 and h["running"] == 0 and h["waiting"] == 0
                    and h["free_blocks"] == h["total_blocks"]):
                return h
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {h}")
            time.sleep(0.1)

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode
