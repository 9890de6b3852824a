"""A real ``tokenmill serve`` in a subprocess, for the server tests.

The server runs in its own temporary folder, so its default trace store
(``./tokenmill-data/traces.duckdb``) is private to it.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
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
