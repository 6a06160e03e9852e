"""Starts ``python -m v41cp serve`` on 127.0.0.1 as a subprocess for the server tests, and stops it; runs a command
as two processes of one `jax.distributed` program (`two_processes`)."""

from __future__ import annotations

import os
import re
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


def subprocess_env(devices: int | None = None) -> dict:
    """This environment for a child process on the CPU: the test run's XLA flags without its device count
    (``devices`` sets one; None leaves it to the child's ``--devices``)."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).split()
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    return env


class ServerProcess:
    """A server subprocess on a free loopback port; ``url`` is its base address (``…/v1`` for the client).

    ``nnodes`` > 1: that many processes of one server (`jax.distributed` on 127.0.0.1, ``devices`` each): ``proc``
    is rank 0 (the one serving HTTP), ``followers`` the others; `stop` signals rank 0, whose shutdown ends the
    followers, and kills whatever is left when the time is up."""

    def __init__(self, *flags: str, devices: int = 1, timeout: float = 420, nnodes: int = 1):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = subprocess_env(devices if devices > 1 else None)
        cmd = [sys.executable, "-m", "v41cp", "serve", "--host", "127.0.0.1", "--port", str(self.port), *flags]
        dist = []
        if nnodes > 1:
            cmd += ["--devices", str(devices)]
            dist = ["--nnodes", str(nnodes), "--dist-init-addr", f"127.0.0.1:{free_port()}"]
        self.out = tempfile.TemporaryFile("w+")      # a file, not a pipe: a chatty server never blocks on it
        self.follower_out = [tempfile.TemporaryFile("w+") for _ in range(1, nnodes)]
        self.followers = [subprocess.Popen(cmd + dist + ["--node-rank", str(r)], env=env, stdout=out,
                                           stderr=subprocess.STDOUT, text=True)
                          for r, out in enumerate(self.follower_out, start=1)]
        self.proc = subprocess.Popen(cmd + dist + (["--node-rank", "0"] if dist else []), env=env, stdout=self.out,
                                     stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.followers):
                self.stop()
                raise RuntimeError(f"a follower exited:\n{self.output()[-4000:]}")
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
        """Rank 0's output, then each follower's."""
        text = []
        for i, out in enumerate([self.out, *self.follower_out]):
            out.flush()
            out.seek(0)
            text.append(out.read() if i == 0 else f"\n--- rank {i} ---\n" + out.read())
        return "".join(text)

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
        """Rank 0's exit status (the followers must have exited with 0, else ``-1`` is returned)."""
        deadline = time.monotonic() + timeout
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        ok = True
        for p in [self.proc, *self.followers]:
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
                ok = False
            if p is not self.proc and p.returncode != 0:
                ok = False
        return self.proc.returncode if ok else -1


def two_processes(*args: str, timeout: float = 480, program: str | None = None) -> list[tuple[int, str, str]]:
    """``python -m v41cp ARGS --nnodes 2 --node-rank r --dist-init-addr 127.0.0.1:PORT`` for r = 0, 1 at once
    (``--devices`` in ARGS: each one's local devices; ``program``: a script run instead of ``-m v41cp``, taking the
    same flags); each one's (exit status, stdout, stderr). Both are killed at ``timeout`` seconds."""
    port = free_port()
    env = subprocess_env()                         # each process sets its own device count (--devices)
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(2)]
    run = ["-m", "v41cp"] if program is None else [program]
    procs = [subprocess.Popen([sys.executable, *run, *args, "--nnodes", "2", "--node-rank", str(r),
                               "--dist-init-addr", f"127.0.0.1:{port}"], env=env, stdout=out, stderr=err, text=True)
             for r, (out, err) in enumerate(files)]
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    result = []
    for p, (out, err) in zip(procs, files):
        out.seek(0)
        err.seek(0)
        result.append((p.returncode, out.read(), err.read()))
    return result
