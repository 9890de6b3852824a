"""A noisy neighbour for drills: processes outside the server that burn CPU.

``python -m tokenmill.bench.cpu_hog --procs 2 --duration 20`` keeps two cores busy for 20 s;
``--every 3 --busy 0.5`` makes it periodic (0.5 s of work every 3 s, the seed's "scheduled job").
Scenarios start it through ``host_load`` (:mod:`.scenario`); it is a separate process group, so
the server's sampler counts it as another process (``cpu_others_pct``), never as its own.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time


def _burn(until: float, every_s: float | None, busy_s: float | None) -> None:
    """Spin until ``until`` (``time.monotonic()``); periodic: ``busy_s`` of every ``every_s``.

    Each spinning process starts its own session, as separate services do (systemd gives each
    its own cgroup): with the kernel's autogroup scheduling, processes of one session share one
    fair share of the CPU, so N spinners in one session weigh like one neighbour, not N."""
    os.setsid()
    x = 0
    if not every_s:
        while time.monotonic() < until:
            x += 1
        return
    start = time.monotonic()
    while (now := time.monotonic()) < until:
        phase = (now - start) % every_s
        if phase < (busy_s or 0):
            x += 1
        else:
            time.sleep(min(every_s - phase, until - now))


def spin_on_cpu(cpu: int, seconds: float) -> None:
    """Spin on CPU ``cpu`` alone for ``seconds`` (a neighbour pinned to one core; run it in a
    process of its own). Raises OSError where ``cpu`` is not in this machine's affinity set."""
    os.sched_setaffinity(0, {cpu})
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def hog(procs: int, duration_s: float, every_s: float | None = None, busy_s: float | None = None):
    """Run ``procs`` spinning processes for ``duration_s`` seconds and wait for them.

    Raises:
        ValueError: ``procs`` < 1, ``duration_s`` <= 0, or ``busy_s`` outside (0, ``every_s``].
    """
    if procs < 1 or duration_s <= 0:
        raise ValueError("procs must be >= 1 and duration_s > 0")
    if every_s is not None and not (busy_s and 0 < busy_s <= every_s):
        raise ValueError("a periodic hog needs 0 < busy_s <= every_s")
    until = time.monotonic() + duration_s
    workers = [mp.Process(target=_burn, args=(until, every_s, busy_s)) for _ in range(procs)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=1, help="spinning processes")
    ap.add_argument("--duration", type=float, required=True, help="seconds")
    ap.add_argument("--every", type=float, default=None, help="period, s (periodic mode)")
    ap.add_argument("--busy", type=float, default=None, help="busy seconds per period")
    a = ap.parse_args(argv)
    try:
        hog(a.procs, a.duration, a.every, a.busy)
    except ValueError as exc:
        ap.error(str(exc))


if __name__ == "__main__":
    main()
