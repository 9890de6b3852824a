"""Who else uses the host's CPU: a census of the processes outside the server.

The host sampler knows how much CPU the server's own process tree used and how much the whole
machine used; the difference (``cpu_others_pct``) is "others". This module says who they are,
so a finding can name them and so our own load generator is not mistaken for a noisy
neighbour: a benchmark client on the same two cores slows the engine it measures, and that is a
fact about the benchmark's validity, not a production problem.

:class:`ProcessCensus` lists every process outside a given set of pids at most once per
``refresh_s`` and reads each one's CPU time from ``/proc`` (through psutil) against its previous
reading. A process counts as the **load generator** when its command line is tokenmill's own
load client or scenario driver (``tokenmill bench``, ``tokenmill scenario``, ``python -m
tokenmill.engine.cli bench``, ...) — :func:`is_load_generator`. The noisy-neighbour drill
(``python -m tokenmill.bench.cpu_hog``) is deliberately *not* a load generator: it stands in for
someone else's job.

The census gives two host-row columns:

- ``loadgen_cpu_pct`` (%, 0..100 of all CPUs): CPU used by load-generator processes.
- ``busy_others`` (JSON text): up to :data:`TOP_N` processes outside the server that used at
  least :data:`MIN_SHOWN_PCT` % of the CPUs, busiest first:
  ``[{"pid", "command", "cpu_pct", "load_generator"}]``.

A proxy in front of another engine on the same host counts that engine's process as the
server's: :class:`ListeningProcess` finds it by the port it listens on.
"""

from __future__ import annotations

import json
import math
import os
import time

import psutil

TOP_N = 5
MIN_SHOWN_PCT = 2.0
# argv words that follow `tokenmill` (or `tokenmill.engine.cli`) in our load generator's commands
LOADGEN_COMMANDS = ("bench", "scenario", "demo")


def is_load_generator(cmdline: list[str]) -> bool:
    """Whether a process's argv is tokenmill's own load client or scenario driver."""
    for i, word in enumerate(cmdline[:-1]):
        base = os.path.basename(word)
        if base == "tokenmill" or word == "tokenmill.engine.cli":
            return cmdline[i + 1] in LOADGEN_COMMANDS
    return False


def short_command(cmdline: list[str], name: str) -> str:
    """A process's command as an operator would recognise it, at most 80 characters."""
    if not cmdline:
        return name
    words = [os.path.basename(cmdline[0]), *cmdline[1:]]
    return " ".join(words)[:80]


class ProcessCensus:
    """CPU shares of the processes outside ``own_pids``, refreshed at most every
    ``refresh_s`` seconds (between refreshes :meth:`read` returns the last result)."""

    def __init__(self, refresh_s: float = 1.0):
        self.refresh_s = refresh_s
        self._prev: dict[int, tuple[float, float]] = {}  # pid -> (cpu seconds, monotonic)
        self._at = 0.0
        self._last: tuple[float | None, str | None] = (None, None)
        self._ncpu = psutil.cpu_count() or 1

    def read(self, own_pids: set[int]) -> tuple[float | None, str | None]:
        """``(loadgen_cpu_pct, busy_others JSON)``; ``(None, None)`` until two listings exist."""
        now = time.monotonic()
        if now - self._at < self.refresh_s:
            return self._last
        last = self._at
        self._at = now
        seen: dict[int, tuple[float, float]] = {}
        loadgen = 0.0
        shown = []
        first = not self._prev
        for proc in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
            info = proc.info
            pid = info["pid"]
            if pid in own_pids or info.get("cpu_times") is None:
                continue
            t = info["cpu_times"]
            cpu_s = float(t.user + t.system)
            seen[pid] = (cpu_s, now)
            prev = self._prev.get(pid)
            if prev is None and not first:
                # not in the last listing: started since, so all its CPU time is since then
                # (a client process starting, a short cron job, are busy right at their start)
                prev = (0.0, last)
            if prev is None or now <= prev[1]:
                continue
            pct = max(0.0, (cpu_s - prev[0]) / (now - prev[1]) * 100.0 / self._ncpu)
            cmd = info.get("cmdline") or []
            lg = is_load_generator(cmd)
            if lg:
                loadgen += pct
            if pct >= MIN_SHOWN_PCT:
                shown.append(
                    {
                        "pid": pid,
                        "command": short_command(cmd, info.get("name") or ""),
                        "cpu_pct": round(pct, 1),
                        "load_generator": lg,
                    }
                )
        self._prev = seen
        if first:
            self._last = (None, None)
            return self._last
        shown.sort(key=lambda d: -d["cpu_pct"])
        self._last = (round(loadgen, 2), json.dumps(shown[:TOP_N]))
        return self._last


#: host names that are this machine whatever its addresses
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0", "::"})


def listening_pids(port: int) -> list[int]:
    """The processes of this host listening on TCP ``port`` (any address), by pid; [] when none
    is found or the host does not say (another user's process, another network namespace)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return []
    return sorted(
        {
            c.pid
            for c in conns
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
        }
    )


class ListeningProcess:
    """The pids of the process listening on ``port`` of this host, looked up again when the
    last one found has ended or ``refresh_s`` has passed (the host sampler asks about once a
    second; listing every socket costs more than that). Call it for the list."""

    def __init__(self, port: int, refresh_s: float = 30.0, *, find=listening_pids):
        self.port = port
        self.refresh_s = refresh_s
        self._find = find
        self._pids: list[int] = []
        self._at: float | None = None

    def __call__(self) -> list[int]:
        now = time.monotonic()
        since = math.inf if self._at is None else now - self._at
        gone = not self._pids or not all(psutil.pid_exists(p) for p in self._pids)
        if since >= self.refresh_s or (gone and since >= 1.0):
            self._pids = self._find(self.port)
            self._at = now
        return list(self._pids)
