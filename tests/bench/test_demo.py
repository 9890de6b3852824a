"""`tokenmill demo --no-wait`: server, console, the tour and its diagnosis, then a clean stop."""

from __future__ import annotations

import itertools
import re
import socket
import subprocess
import sys

import psutil
import pytest

# the README's tour as a user runs it (minutes): in `make test-e2e`, not `make test`
pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_demo_runs_the_tour_and_prints_the_diagnosis_and_console(smollm2_dir):
    console_port = _port()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.engine.cli",
            "demo",
            "--no-wait",
            "--port",
            str(_port()),
            "--console-port",
            str(console_port),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "tokenmill diagnosis" in r.stdout and "key numbers" in r.stdout
    # the tour's overload phase (8x the rate the 2-sequence batch keeps up with) is the first
    # finding: with the queue growing window after window, this is the CI proof of `overload`
    # (the queueing_overload scenario, the same traffic, runs in `make scenarios`)
    # host_contention may rank above it: on a shared VM a neighbour's CPU burst is a true first
    # finding (stop 28's CI: overload was not first and the log kept only the last 3000
    # characters, so every finding's header goes into the message now)
    ranked = re.findall(r"\b\d+\. (\w+) — ", r.stdout)
    assert [f for f in ranked if f != "host_contention"][:1] == ["overload"], (
        ranked,
        r.stdout[-3000:],
    )
    assert "overload — arrivals exceed completions" in r.stdout
    assert "console: http://127.0.0.1:" in r.stdout
    # the tour is never silent (issue 19 item 13): the load generator's progress lines, one per
    # phase and every 10 s, with the requests done
    for phase in ("[healthy] ", "[overload] "):
        assert phase in r.stderr and " of 50 s · sent " in r.stderr, r.stderr[-2000:]
    assert "· done " in r.stderr and "fetching a dump" in r.stdout
    assert "Traceback" not in r.stderr
    # nothing left running: the console's Streamlit process stopped with its CLI (it was once
    # left serving when the test ran in a background job, where SIGINT is ignored)
    port = str(console_port)
    left = [
        p.info["pid"]
        for p in psutil.process_iter(["pid", "cmdline"])
        if any(
            a == "--server.port" and b == port
            for a, b in itertools.pairwise(p.info["cmdline"] or [])
        )
    ]
    assert left == [], left
