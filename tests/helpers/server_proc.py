"""A real ``tokenmill serve`` in a subprocess, for the server tests.

The server runs in its own temporary folder, so its default trace store
(``./tokenmill-data/traces.duckdb``) is private to it.
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now and below the kernel's ephemeral range: the server's own sockets bound
    to port 0 while it starts (its workers' rendezvous) can never be handed the same port before
    its HTTP listener binds it (a fresh clone's make test lost a disaggregated server's port
    that way)."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range below is full: any port the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp_path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp_path / f"server-{self.port}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tokenmill.engine.cli",
                "serve",
                "--port",
                str(self.port),
                *args,
            ],
            stdout=self.log,
            cwd=tmp_path,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (tmp_path / f"server-{self.port}.log").read_text()
            try:
                if httpx.get(self.url + "/health", timeout=2).json()["status"] == "ok":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise AssertionError("server did not become healthy")

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def host_busy_pct(interval_s: float = 1.0) -> float:
    """% of the host's CPU time busy (not idle, not iowait) over ``interval_s``, from
    ``/proc/stat``'s first line."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]

    t0, i0 = sample()
    time.sleep(interval_s)
    t1, i1 = sample()
    return 100.0 * (1 - (i1 - i0) / max(1, t1 - t0))


def wait_for_quiet_host(limit_s: float = 60.0, busy_pct: float = 10.0) -> None:
    """Start a run on a settled host: in CI the first run once began while something an
    earlier test left behind still took 22 % of the CPU, and its report read "not comparable"
    against the later runs (78 % vs 95-97 % CPU left to the server)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and host_busy_pct() > busy_pct:
        pass
