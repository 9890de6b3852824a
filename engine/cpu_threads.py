"""How many CPU threads the engine's forward uses: the cores nobody else is using.

Why: torch's OpenMP threads spin and meet at a barrier after every parallel region, hundreds of
times a step. When a neighbour (the API process, a bench client, a sidecar, another engine)
holds one of the cores, the thread that shares that core runs only part of the time, and every
other thread waits for it at each barrier. On the 2-core VM one busy process pinned to a core cut
decode with two threads to ~35% of its quiet speed, while one thread on the free core kept
~95% (``benchmarks/cpu_contention.py``). Making the threads sleep instead of spin
(``OMP_WAIT_POLICY=PASSIVE``) also survives the neighbour but costs 25-35% of decode speed
on a quiet machine, so the engine keeps spinning and changes the thread count instead.

:class:`ThreadGovernor` reads the host's busy time (``/proc/stat``) and the server's own CPU
time (the engine process's and the API process's that feeds it) twice a second, takes the
difference as the cores other processes use, and sets
``torch.set_num_threads`` to the allowed cores (``os.sched_getaffinity``) minus the cores
they take (:data:`TAKEN_SHARE`), at least one. Fewer threads must hold for ``settle`` readings
in a row before they are applied, so one odd reading does not make the pool flap; more threads
(the neighbour left) apply at the first reading that shows it. The asymmetry is measured: in the
``periodic_itl_spikes`` drill (1.5 s of two spinning processes every 6 s), one-second readings
that had to agree twice in both directions dropped to one thread just as the burst ended and
kept it two more seconds, at 1.7-2.2x the median decode step, longer than the burst itself.
The API process counts as the server's own because its work comes and goes with each step
(it streams the tokens the engine just made) rather than holding a core: counted as a
neighbour, one stream of int8 decode (~60 tok/s) took the engine to one thread, 58.2 tok/s
against 70.3 with two threads fixed (``benchmarks/vs_llamacpp.py``, 2026-12-01).
``--cpu-threads N`` fixes the count instead.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# (host busy seconds summed over all CPUs, this process's CPU seconds), both monotonic
Reading = tuple[float, float]


def cores_allowed() -> int:
    """CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# a core counts as taken once other processes keep it this busy. Measured from inside a
# saturated host, a neighbour's use reads low: a spinning process pinned to one core showed as
# ~0.5 of a core while the engine's two threads fought it, so half a core must already count.
# Below it (the API process streaming: 0.1-0.2 of a core) the engine keeps every thread.
TAKEN_SHARE = 0.3


def pick_threads(others_cores: float, cores: int) -> int:
    """Threads for ``cores`` allowed CPUs when other processes keep ``others_cores`` CPUs busy
    (a float: 0.5 = half a core): one fewer for each core they take (``TAKEN_SHARE`` of a core
    counts as taken), between 1 and ``cores``."""
    taken = math.ceil(max(0.0, others_cores) - TAKEN_SHARE)
    return max(1, min(cores, cores - max(0, taken)))


def proc_stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (field 3, the state, first);
    None where it cannot be read (the process is gone, not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the command name (field 2) may hold spaces: count fields after its closing ")"
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used, from
    ``/proc/PID/stat``; 0.0 where it cannot be read (the process is gone, not Linux)."""
    fields = proc_stat_fields(pid)
    if fields is None:
        return 0.0
    # utime and stime are fields 14 and 15 of the line (man 5 proc), 12 and 13 after ")"
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_proc(server_pids: tuple[int, ...] = ()) -> Reading | None:
    """The host's busy CPU seconds (user + nice + system + irq + softirq + steal over all CPUs,
    from ``/proc/stat``) and the server's own CPU seconds: this process's (``os.times``, all its
    threads) plus those of ``server_pids`` (the API process that feeds this engine: its work
    is the serving itself, not a neighbour's); None where ``/proc/stat`` cannot be read (not
    Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    # user nice system idle iowait irq softirq steal (guest time is inside user already)
    busy = sum(ticks[:8]) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)
    t = os.times()
    own = t.user + t.system + sum(process_cpu_s(pid) for pid in server_pids)
    return busy / os.sysconf("SC_CLK_TCK"), own


class ThreadGovernor:
    """Keeps torch's intra-op thread count at the cores other processes leave free.

    Args:
        cores: CPUs the engine may use (default: its affinity mask).
        fixed: a thread count to set once and keep (``--cpu-threads``); 0 = follow the host.
        interval_s: seconds between readings (0.5 s: a reading is one small file read).
        settle: readings in a row that must agree before the count drops; a rise applies
            at once.
        read: the reading source (tests pass fakes); returns None when there is nothing to read.
        set_threads: applies a count (``torch.set_num_threads``).
        clock: monotonic seconds.

    Raises:
        ValueError: ``fixed`` below 0, ``interval_s`` not above 0 or ``settle`` below 1.
    """

    def __init__(
        self,
        *,
        cores: int | None = None,
        fixed: int = 0,
        interval_s: float = 0.5,
        settle: int = 2,
        read: Callable[[], Reading | None] = read_proc,
        set_threads: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if fixed < 0 or not interval_s > 0 or settle < 1:
            raise ValueError("cpu threads: fixed >= 0, interval_s > 0 and settle >= 1")
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.cores = cores or cores_allowed()
        self.fixed = fixed
        self.interval_s = interval_s
        self.settle = settle
        self._read, self._set, self._clock = read, set_threads, clock
        self.threads = fixed or self.cores
        self._set(self.threads)
        self.others_cores: float | None = None  # the last reading's figure
        self._last: tuple[float, Reading] | None = None
        self._candidate, self._agree = self.threads, 0

    def tick(self) -> int | None:
        """Read the host if ``interval_s`` has passed; returns the new thread count when it
        changed, else None. Cheap to call every engine step."""
        if self.fixed:
            return None
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.interval_s:
            return None
        reading = self._read()
        if reading is None:
            return None
        last, self._last = self._last, (now, reading)
        # a long gap (the engine sat idle) averages over too much: start over from here
        if last is None or now - last[0] > 5 * self.interval_s:
            return None
        wall = now - last[0]
        others = ((reading[0] - last[1][0]) - (reading[1] - last[1][1])) / wall
        self.others_cores = max(0.0, others)
        want = pick_threads(self.others_cores, self.cores)
        self._agree = self._agree + 1 if want == self._candidate else 1
        self._candidate = want
        if want == self.threads or (want < self.threads and self._agree < self.settle):
            return None
        log.info(
            "cpu threads %d -> %d: other processes use %.1f of %d cores",
            self.threads,
            want,
            self.others_cores,
            self.cores,
        )
        self.threads = want
        self._set(want)
        return want
