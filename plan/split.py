"""A replay's replicas split over processes, with the router deciding exactly as in one.

The replicas of a fleet interact only through the data-parallel router: each arrival goes to
the replica with the fewest outstanding tokens (the lowest index on ties), counted at the
arrival's time. Between two arrivals every replica's steps are its own business. So P
processes each replay a block of consecutive replicas (their schedulers, pools, steps in
flight) and meet once per arrival: each brings its replicas' steps up to the arrival's time,
offers the least count among its own replicas, and all take the same winner (the least count,
then the lowest index). Only the winner's process admits the request. Every decision, step
and latency is the one-process replay's (the tests hold them to it); the work of the steps is
shared.

The meeting is one 64-bit word per process and arrival parity in shared memory (one aligned
store, so it is seen whole on any CPU): a sequence number, the replica and its count. A
process waits for the others' words by spinning, as the replay's steps between two arrivals
take microseconds. A process whose replay raises sets a shared flag and sends its traceback;
one that dies without a word (killed, out of memory) is seen by the first process through its
exit. Either way every process stops within a few thousand spins and the first raises
:class:`SplitError` with the reason.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import multiprocessing as mp
import os
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait

import numpy as np

#: bits of a meeting word: sequence number, replica index, its count (two's complement)
_SEQ_BITS, _REPLICA_BITS, _COUNT_BITS = 12, 12, 40
_COUNT_MASK = (1 << _COUNT_BITS) - 1
_REPLICA_MASK = (1 << _REPLICA_BITS) - 1
_SEQ_MASK = (1 << _SEQ_BITS) - 1
_COUNT_LIMIT = 1 << (_COUNT_BITS - 1)
#: the most replicas a meeting word can name
MAX_REPLICAS = 1 << _REPLICA_BITS
#: spins between two checks that the other processes are still there
_CHECK_EVERY = 4096


class SplitError(RuntimeError):
    """A process of a split replay failed (its traceback is the message)."""


class _Stopped(SplitError):
    """This process stopped because another one failed (that one says why)."""


def blocks(replicas: int, processes: int) -> list[range]:
    """The consecutive replicas each process replays, as even as the counts allow."""
    processes = max(1, min(processes, replicas))
    bounds = np.linspace(0, replicas, processes + 1).round().astype(int)
    return [range(int(a), int(b)) for a, b in itertools.pairwise(bounds)]


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def can_split() -> bool:
    """Whether this process may fork replay processes: on a platform with ``fork``, and with no
    other thread running (a thread holding a lock at the fork, as a web server's may, would
    leave it held in the child)."""
    return "fork" in mp.get_all_start_methods() and threading.active_count() == 1


_SEQ_SHIFT = _REPLICA_BITS + _COUNT_BITS


def pack(i: int, replica: int, count: int) -> int:
    """Arrival ``i``'s meeting word: ``replica`` with ``count`` outstanding tokens."""
    if not -_COUNT_LIMIT <= count < _COUNT_LIMIT:
        raise SplitError(f"an outstanding-token count of {count} does not fit a meeting word")
    return (((i + 1) & _SEQ_MASK) << _SEQ_SHIFT) | (replica << _COUNT_BITS) | (count & _COUNT_MASK)


def unpack(word: int) -> tuple[int, int]:
    """The replica and count of a meeting word."""
    count = word & _COUNT_MASK
    if count >= _COUNT_LIMIT:
        count -= 1 << _COUNT_BITS
    return (word >> _COUNT_BITS) & _REPLICA_MASK, count


class Meeting:
    """The shared words of P processes (create it before the processes start)."""

    def __init__(self, processes: int):
        self.processes = processes
        # words 0 .. 2P-1: process p's word for arrivals of parity q at 2p + q; word 2P: failed
        self._mem = mmap.mmap(-1, 8 * (2 * processes + 1))
        self.words = memoryview(self._mem).cast("Q")

    def fail(self) -> None:
        self.words[2 * self.processes] = 1

    @property
    def failed(self) -> bool:
        return bool(self.words[2 * self.processes])


class Seat:
    """Process ``me``'s place at the meeting. The first process watches the others' exits
    (``children``: their sentinels); the others watch the first (``parent_pid``)."""

    def __init__(self, meeting: Meeting, me: int, *, parent_pid: int | None = None, children=()):
        self.meeting, self.me = meeting, me
        self.others = [p for p in range(meeting.processes) if p != me]
        self.parent_pid = parent_pid
        self.children = list(children)

    def pick(self, i: int, *, count: int, replica: int, idle=None) -> int:
        """Arrival ``i``: offer this process's least ``count`` (at ``replica``); the winner by
        the router's rule (the least count, then the lowest replica index).
        ``idle()`` is called while the others' offers are missing (work that does not depend on
        the winner; it returns False when it has none)."""
        parity = i & 1
        words = self.meeting.words
        words[2 * self.me + parity] = pack(i, replica, count)
        seq = (i + 1) & _SEQ_MASK
        best, best_replica = count, replica
        for p in self.others:
            k = 2 * p + parity
            word = words[k]
            spins = 0
            while word >> _SEQ_SHIFT != seq:
                if idle is None or not idle():
                    idle = None
                    spins += 1
                    if spins % _CHECK_EVERY == 0:
                        self._check()
                word = words[k]
            their_replica, theirs = unpack(word)
            if (theirs, their_replica) < (best, best_replica):
                best, best_replica = theirs, their_replica
        return best_replica

    def _check(self) -> None:
        if self.meeting.failed:
            raise _Stopped("another process of the split replay failed")
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            raise _Stopped("the split replay's first process is gone")
        if self.children and wait(self.children, timeout=0):
            raise SplitError("a process of the split replay ended without a word (killed?)")
        os.sched_yield()


@dataclass
class Part:
    """What one process of a split replay hands back (see ``Simulation.part``)."""

    replicas: range
    arrays: dict
    tally: dict


def run_split(make_simulation, replicas: int, processes: int) -> tuple[list[Part], np.ndarray]:
    """Run ``make_simulation(block, seat)`` for a fleet of ``replicas`` in ``processes``
    processes (this one replays the first block); returns every process's :class:`Part` and
    the replica each arrival went to.

    Raises:
        SplitError: a process failed (with its traceback), or the meeting cannot name the
            fleet's replicas.
    """
    if replicas > MAX_REPLICAS:
        raise SplitError(f"a split replay names at most {MAX_REPLICAS} replicas, not {replicas}")
    parts_of = blocks(replicas, processes)
    meeting = Meeting(len(parts_of))
    ctx = mp.get_context("fork")
    parent = os.getpid()
    pipes, children = [], []
    try:
        for p in range(1, len(parts_of)):
            recv, send = ctx.Pipe(duplex=False)
            seat = Seat(meeting, p, parent_pid=parent)
            child = ctx.Process(
                target=_child, args=(make_simulation, parts_of[p], seat, send), daemon=True
            )
            child.start()
            send.close()
            pipes.append(recv)
            children.append(child)
        sim = make_simulation(
            parts_of[0], Seat(meeting, 0, children=[c.sentinel for c in children])
        )
        try:
            sim.run_events()
        except _Stopped:  # another process failed first: its reason
            meeting.fail()
            raise SplitError(_reason(pipes)) from None
        parts = [sim.part()]
        for recv in pipes:
            try:
                kind, payload = recv.recv()
            except EOFError:
                raise SplitError("a process of the split replay ended without its part") from None
            if kind != "part":
                meeting.fail()
                raise SplitError(payload if kind == "error" else _reason(pipes))
            parts.append(payload)
    except BaseException:
        meeting.fail()
        for child in children:
            child.kill()
        raise
    finally:
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
                child.join()
        for recv in pipes:
            recv.close()
    return parts, np.frombuffer(sim.route, dtype=np.int16)


def _reason(pipes, wait_s: float = 10.0) -> str:
    """The traceback the failed process sent (rather than another's note that it stopped)."""
    pending, stopped = list(pipes), None
    while pending:
        ready = wait(pending, timeout=wait_s)
        if not ready:
            break
        for recv in ready:
            pending.remove(recv)
            try:
                kind, payload = recv.recv()
            except (EOFError, OSError):
                continue
            if kind == "error":
                return payload
            stopped = stopped or payload
    return stopped or "a process of the split replay failed without a word (killed?)"


def _child(make_simulation, replicas: range, seat: Seat, send) -> None:
    try:
        sim = make_simulation(replicas, seat)
        sim.run_events()
        send.send(("part", sim.part()))
    except _Stopped as e:
        seat.meeting.fail()
        with contextlib.suppress(BrokenPipeError, OSError):
            send.send(("stopped", str(e)))
    except BaseException as e:  # the first process reports it: its first line says what
        seat.meeting.fail()
        reason = f"a replay process failed: {type(e).__name__}: {e}\n{traceback.format_exc()}"
        with contextlib.suppress(BrokenPipeError, OSError):
            send.send(("error", reason))
    finally:
        send.close()
