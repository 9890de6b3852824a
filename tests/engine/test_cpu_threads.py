"""Issue 19 item 12: the engine's CPU threads follow the cores other processes leave free.

The pure parts (the thread count for a reading, the governor's settling and its fixed mode)
run on fake readings; one test reads the real host while a spinning process holds a core."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from tokenmill.bench.cpu_hog import spin_on_cpu
from tokenmill.engine.cpu_threads import ThreadGovernor, pick_threads, process_cpu_s, read_proc


@pytest.mark.parametrize(
    ("others", "cores", "threads"),
    [
        (0.0, 2, 2),
        (0.2, 2, 2),  # the API process streaming: every thread stays
        (0.5, 2, 1),  # a neighbour on one core, as it reads while the engine fights it
        (1.0, 2, 1),
        (3.0, 2, 1),  # never below one
        (0.5, 1, 1),
        (2.6, 8, 5),
        (-0.1, 4, 4),  # a reading a tick off
    ],
)
def test_threads_for_a_reading(others, cores, threads):
    assert pick_threads(others, cores) == threads


class FakeHost:
    """Readings as the governor sees them: others' and own CPU seconds advance per wall second."""

    def __init__(self):
        self.now = 0.0
        self.busy = 0.0
        self.own = 0.0
        self.others_rate = 0.0
        self.own_rate = 1.9

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.own += self.own_rate * seconds
        self.busy += (self.own_rate + self.others_rate) * seconds

    def read(self):
        return self.busy, self.own


def _governor(host: FakeHost, applied: list, **kw) -> ThreadGovernor:
    return ThreadGovernor(
        cores=2, read=host.read, set_threads=applied.append, clock=lambda: host.now, **kw
    )


def test_a_neighbour_takes_a_thread_after_two_readings_and_gives_it_back_at_once():
    host, applied = FakeHost(), []
    gov = _governor(host, applied)
    assert applied == [2] and gov.threads == 2
    seen = []
    for second in range(12):
        host.others_rate, host.own_rate = (0.6, 1.4) if 3 <= second < 8 else (0.05, 1.9)
        host.advance(1.0)
        seen.append(gov.tick() or gov.threads)
    # the first reading only sets the baseline; two readings in a row must agree to drop a
    # thread, the first quiet reading gives it back (second 8, the neighbour gone)
    assert seen == [2, 2, 2, 2, 1, 1, 1, 1, 2, 2, 2, 2], seen
    assert applied == [2, 1, 2]
    assert gov.others_cores == pytest.approx(0.05)


def test_one_odd_reading_does_not_flap_the_pool():
    host, applied = FakeHost(), []
    gov = _governor(host, applied)
    for second in range(10):
        host.others_rate = 0.8 if second in (3, 6) else 0.0
        host.advance(1.0)
        gov.tick()
    assert applied == [2]


def test_fixed_count_and_long_gaps():
    host, applied = FakeHost(), []
    gov = _governor(host, applied, fixed=1)
    host.others_rate = 0.0
    for _ in range(5):
        host.advance(1.0)
        assert gov.tick() is None
    assert applied == [1] and gov.threads == 1
    # an engine idle for a minute: the reading after the gap starts over, decides nothing
    host2, applied2 = FakeHost(), []
    gov2 = _governor(host2, applied2)
    host2.advance(1.0)
    gov2.tick()
    host2.others_rate = 1.0
    host2.advance(60.0)
    assert gov2.tick() is None and gov2.others_cores is None
    with pytest.raises(ValueError):
        ThreadGovernor(fixed=-1, set_threads=lambda n: None)


@pytest.mark.skipif(
    read_proc() is None or len(os.sched_getaffinity(0)) < 2, reason="needs /proc and 2 CPUs"
)
def test_a_real_spinning_neighbour_on_one_core_takes_one_thread():
    """The real host: a process spinning on CPU 0 (outside this one) while this process works
    on both cores. The governor must drop to one thread; readings are taken until it does."""
    applied: list[int] = []
    gov = ThreadGovernor(cores=2, interval_s=0.25, set_threads=applied.append)
    hog = mp.get_context("spawn").Process(target=spin_on_cpu, args=(0, 60.0), daemon=True)
    hog.start()
    try:
        for _ in range(200):  # a liveness bound, not a speed bound
            end = time.monotonic() + 0.05
            while time.monotonic() < end:  # this process busy too, as an engine would be
                pass
            if gov.tick() == 1:
                break
        assert gov.threads == 1, (applied, gov.others_cores)
        assert gov.others_cores >= 0.3
    finally:
        hog.kill()
        hog.join(5)


def test_the_api_process_counts_as_the_servers_own_cpu():
    """read_proc with a server pid adds that process's CPU seconds to the server's own: a child
    that spins for a while shows in the reading with its pid, and not without it."""
    hog = mp.get_context("spawn").Process(target=spin_on_cpu, args=(0, 60.0), daemon=True)
    hog.start()
    try:
        spun = 0.0
        for _ in range(300):  # a liveness bound while the child starts and spins, not a timing
            time.sleep(0.1)
            with_child, alone = read_proc((hog.pid,)), read_proc()
            assert with_child is not None and alone is not None
            spun = with_child[1] - alone[1]
            if spun > 0.2:
                break
        # its CPU seconds are in the reading with its pid only
        assert spun > 0.2, spun
        # a pid that is gone reads as nothing, not an error
        assert process_cpu_s(2**22 + 12345) == 0.0
    finally:
        hog.kill()
        hog.join(5)
