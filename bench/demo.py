"""``tokenmill demo`` (``make demo``): the whole product in one run.

1. Start ``tokenmill serve`` on the default model with tracing on (batch capped at 2 running
   requests, so the tour can provoke queueing on a CPU in seconds).
2. Start the console (``tokenmill dashboard``) on the live server.
3. The tour: ``tokenmill bench`` with a healthy phase, then an overload phase at 8x the rate.
4. Fetch a dump, print ``tokenmill diagnose``'s report and the console URL.
5. Keep the server and the console running until Ctrl-C.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

TOUR = [
    "--request-rate",
    "0.4",
    "--phases",
    "healthy:25s,overload:25s@8x",
    "--prompt-tokens",
    "uniform:32:64",
    "--output-tokens",
    # 48, not 24: with the compiled decode step (2026-12-01) a batch of 2 finished 24-token
    # answers nearly as fast as 8x the rate sent them, and the tour's top finding became
    # ttft_queueing instead of overload
    "48",
    "--seed",
    "42",
]


class DemoError(Exception):
    """The demo could not start (one line)."""


def _free_port(preferred: int) -> int:
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise DemoError("no free port")


def _tm(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill.engine.cli", *args]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text()[-400:].strip().splitlines()
            raise DemoError(f"the server exited: {tail[-1] if tail else 'no output'}")
        try:
            if httpx.get(url + "/health", timeout=2).json().get("status") == "ok":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise DemoError(f"the server did not become healthy in {timeout_s:.0f} s")


#: Exit codes of a child that was stopped, not one that failed: 0 (tokenmill serve after a
#: SIGINT/SIGTERM), killed by SIGINT/SIGTERM, or 128 + the signal.
STOPPED_CODES = (0, -signal.SIGINT, -signal.SIGTERM, 128 + signal.SIGINT, 128 + signal.SIGTERM)


def wait_for_stop(procs: dict[str, subprocess.Popen], poll_s: float = 1.0) -> str:
    """Wait while every child runs; returns the name of the first that stopped cleanly (a
    Ctrl-C goes to the whole process group, so a child may end before this process sees it).
    A Ctrl-C here raises KeyboardInterrupt as usual.

    Raises:
        DemoError: a child exited with another code (it failed), naming it and the code.
    """
    while True:
        for name, proc in procs.items():
            code = proc.poll()
            if code is None:
                continue
            if code in STOPPED_CODES:
                return name
            raise DemoError(f"the {name} stopped with exit code {code} (see its log)")
        time.sleep(poll_s)


def _ignore_sigint():
    """Ignore Ctrl-C from now on (so a second one cannot cut the cleanup short); returns the
    previous handler, or None off the main thread (where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, signal.SIG_IGN)


def run(*, port: int = 8000, console_port: int = 8501, wait: bool = True, say=print) -> int:
    """Run the demo; returns the exit code (0 after Ctrl-C, once or twice, or at once with
    ``wait=False``).

    Raises:
        DemoError: the server or console could not start, or the tour failed.
    """
    work = Path(tempfile.mkdtemp(prefix="tokenmill-demo-"))
    port = _free_port(port)
    console_port = _free_port(console_port)
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []
    previous_sigint = None
    try:
        say(f"• starting the server on {url} (default model, tracing on; logs in {work})")
        server_log = work / "server.log"
        with open(server_log, "w") as f:
            server = subprocess.Popen(
                _tm(
                    "serve",
                    *("--port", str(port), "--max-num-seqs", "2"),
                    *("--trace-db", str(work / "traces.duckdb")),
                ),
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=work,
            )
        procs.append(server)
        _wait_healthy(url, server, server_log)
        say(f"• starting the console on http://127.0.0.1:{console_port}")
        with open(work / "console.log", "w") as f:
            procs.append(
                subprocess.Popen(
                    _tm(
                        "dashboard",
                        *("--source", url, "--port", str(console_port), "--refresh", "5"),
                    ),
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    cwd=work,
                )
            )
        say(
            "• the tour: 25 s of healthy traffic, then 25 s at 8x the rate (batch capped at 2), "
            "then the backlog drains; 1.5 to 3.5 minutes on a 2-core CPU"
        )
        # the load generator's own progress: a bar on a terminal, a line per phase and every
        # 10 s otherwise (phase, elapsed, requests sent/done/failed/in flight)
        r = subprocess.run(_tm("bench", "--url", url, *TOUR, "--out", str(work / "tour.json")))
        if r.returncode != 0:
            raise DemoError("the tour's load generator failed (see above)")
        say("• fetching a dump of the tour's traces")
        dump = work / "dump.duckdb"
        r = subprocess.run(_tm("dump", "--url", url, "-o", str(dump)))
        if r.returncode != 0:
            raise DemoError("could not fetch a dump from the server")
        say("• the diagnosis of what just happened:")
        subprocess.run(_tm("diagnose", str(dump), "--window", "5s"))
        say(f"\nconsole: http://127.0.0.1:{console_port}   server: {url}/v1   (Ctrl-C to stop)")
        if wait:
            signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
            wait_for_stop(dict(zip(("server", "console"), procs, strict=True)))
            say("\nstopping")
    except KeyboardInterrupt:
        previous_sigint = _ignore_sigint()
        say("\nstopping")
    finally:
        if previous_sigint is None:
            previous_sigint = _ignore_sigint()
        # SIGTERM, not SIGINT: a job started in the background by a non-interactive shell
        # inherits SIGINT ignored, and then neither child would stop on it (the console's
        # Streamlit process was left running after `--no-wait` runs started that way); both
        # stop on SIGTERM as on Ctrl-C, the server after the requests in flight (none by now)
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        if previous_sigint is not None:
            signal.signal(signal.SIGINT, previous_sigint)
    return 0
