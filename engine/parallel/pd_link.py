"""The engine core process's end of the prefill → decode KV link (issue 17,
``--disaggregation 'prefill=P,decode=D'``): every engine core of both sides is one rank of a
gloo group on ``127.0.0.1:port`` (prefill cores ranks ``0 .. P-1``, decode cores ``P ..
P+D-1``); on CUDA the KV itself crosses on an NCCL group of the same ranks, the headers on
the gloo one.

- :class:`PDLink` joins the group in a background thread (the core loads its model
  meanwhile). On a prefill core :meth:`PDLink.send` queues a :class:`KVHandoff` and the
  decode rank it goes to for a sender thread (``send_handoff``: blocking, so it stays off the
  step loop). On a decode core a receiver thread takes each hand-off from whichever prefill
  core sends (``recv_handoff(None)``) into :attr:`PDLink.arrived` and wakes the core loop
  through a ZeroMQ ``inproc`` socket the loop polls.
- :class:`AdoptionDesk` (decode side) matches the API's ``AddRequest(adopt=True)`` for a
  request with its hand-off, whichever comes first; a request waits at the desk while the
  decode pool has no room (back-pressure), and one cancelled (aborted) before its hand-off
  came has the hand-off dropped on arrival.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import threading
import time

import torch.distributed as dist
import zmq

from .kv_transfer import KVHandoff, recv_handoff, send_end, send_handoff
from .pd_spec import worker_name

log = logging.getLogger(__name__)

#: seconds the cores wait for each other to join, and a send for its receiver
LINK_TIMEOUT_S = 300
#: seconds a hand-off waits at the desk for its AddRequest (the API's stream gone meanwhile)
ORPHAN_S = 60.0


def pin(cpus: tuple[int, ...] | list[int] | None) -> None:
    """Pin this process to ``cpus`` (``os.sched_setaffinity``); None leaves it as it is."""
    if cpus:
        os.sched_setaffinity(0, set(cpus))


class PDLink:
    """One engine core's end of the link.

    Args:
        role: ``"prefill"`` or ``"decode"``.
        port: the group's TCP rendezvous port on ``master_addr``.
        ctx: the core loop's ZeroMQ context (the decode side's wake-up socket lives in it).
        delay_ms: the fault drill ``--fault-kv-transfer-delay-ms`` (prefill side).
        rank: this core's rank (default: 0 for prefill, 1 for decode: one core a side).
        world_size: every core of both sides (default 2).
        num_prefill: prefill cores, ranks ``0 .. num_prefill - 1`` (default 1).
        device: where the KV cache lives; ``cuda...`` moves the KV over NCCL.
        master_addr: the host of the group's rendezvous (the API's host; 127.0.0.1 when every
            core runs on one host).
        nccl: every core has a GPU of its own: the KV crosses on NCCL (else gloo).

    Raises:
        ValueError: a role, rank or size that does not fit together.
    """

    WAKE_ADDR = "inproc://pd-arrivals"

    def __init__(
        self,
        role: str,
        port: int,
        ctx: zmq.Context | None = None,
        delay_ms: float = 0.0,
        *,
        rank: int | None = None,
        world_size: int = 2,
        num_prefill: int = 1,
        device: str = "cpu",
        master_addr: str = "127.0.0.1",
        nccl: bool = False,
    ):
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        self.role, self.port, self.master_addr = role, port, master_addr
        self.delay_s = delay_ms / 1e3  # --fault-kv-transfer-delay-ms (prefill side)
        self.rank = rank if rank is not None else (0 if role == "prefill" else num_prefill)
        self.world_size, self.num_prefill = world_size, num_prefill
        if not 0 < num_prefill < world_size or (self.rank < num_prefill) != (role == "prefill"):
            raise ValueError(
                f"rank {self.rank} of {world_size} with {num_prefill} prefill core(s) is not a "
                f"{role} core"
            )
        self.name = worker_name(self.rank, num_prefill)
        self.device, self.use_nccl = device, nccl
        self.joined = threading.Event()
        self.error: str | None = None
        self.arrived: queue.Queue[KVHandoff] = queue.Queue()
        self._outbox: queue.Queue[tuple[KVHandoff, int] | None] = queue.Queue()
        self.sent_bytes = 0
        self.wake: zmq.Socket | None = None
        self._data = self._control = None  # the groups the KV and its headers cross on
        self.kv_device = "cpu"  # where a hand-off's KV crosses: the GPU with NCCL
        if role == "decode" and ctx is not None:
            self.wake = ctx.socket(zmq.PULL)
            self.wake.bind(self.WAKE_ADDR)
        self._ctx = ctx
        threading.Thread(target=self._run, name=f"pd-{self.name}", daemon=True).start()

    @property
    def decode_ranks(self) -> range:
        return range(self.num_prefill, self.world_size)

    def _run(self) -> None:
        # NCCL needs a GPU of its own per rank (the pool gives each core one under --device
        # cuda); cores that may share one (--device auto) move the KV through host memory
        # over gloo instead
        nccl = self.use_nccl and self.device.startswith("cuda") and dist.is_nccl_available()
        self.kv_device = self.device if nccl else "cpu"
        try:
            dist.init_process_group(
                "nccl" if nccl else "gloo",
                init_method=f"tcp://{self.master_addr}:{self.port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=datetime.timedelta(seconds=LINK_TIMEOUT_S),
            )
            if nccl:  # NCCL moves device tensors only: the headers go on a gloo group
                self._control = dist.new_group(backend="gloo")
        except Exception as exc:  # another core never came
            self.error = f"KV link did not form: {str(exc).splitlines()[0][:120]}"
            log.error("%s", self.error)
            return
        self.joined.set()
        if self.role == "prefill":
            self._send_loop()
        else:
            self._receive_loop()

    def _send_loop(self) -> None:
        try:
            while (item := self._outbox.get()) is not None:
                h, dst = item
                h.source = self.name
                if self.kv_device == "cpu" and h.kv.device.type != "cpu":
                    h.kv = h.kv.cpu()
                sent, _ = send_handoff(h, dst, self._data, self.delay_s, control=self._control)
                self.sent_bytes += sent
            for dst in self.decode_ranks:  # each decode side's receiver counts the ends
                send_end(dst, self._data, control=self._control)
        except Exception as exc:
            self.error = f"KV send failed: {str(exc).splitlines()[0][:120]}"
            log.error("%s", self.error)

    def _receive_loop(self) -> None:
        push = self._ctx.socket(zmq.PUSH) if self._ctx is not None else None
        if push is not None:
            push.connect(self.WAKE_ADDR)
        ended = 0
        try:
            while ended < self.num_prefill:
                h = recv_handoff(None, self._data, self.kv_device, control=self._control)
                if h is None:
                    ended += 1
                    continue
                h.dest = self.name
                self.arrived.put(h)
                if push is not None:
                    push.send(b"1")
        except Exception as exc:  # a prefill core went away
            self.error = f"KV receive failed: {str(exc).splitlines()[0][:120]}"
            log.error("%s", self.error)
        finally:
            if push is not None:
                push.close(linger=0)

    def send(self, handoff: KVHandoff, dst: int | None = None) -> None:
        """Queue a hand-off for decode rank ``dst`` (prefill side; None: the first decode
        core)."""
        self._outbox.put((handoff, self.num_prefill if dst is None else dst))

    def drain_wake(self) -> None:
        """Empty the wake-up socket (decode side, after the poller saw it)."""
        while self.wake is not None:
            try:
                self.wake.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def close(self) -> None:
        if self.wake is not None:
            self.wake.close(linger=0)
        self._outbox.put(None)


class AdoptionDesk:
    """Decode side: hand-offs and the API's adopt requests, matched by request id."""

    def __init__(self, clock=time.monotonic):
        self.expected: dict[str, float] = {}
        self.arrived: dict[str, tuple[KVHandoff, float]] = {}
        self.cancelled: dict[str, float] = {}
        self._clock = clock

    def expect(self, request_id: str) -> None:
        """The API opened the request's decode stream."""
        self.expected[request_id] = self._clock()

    def arrive(self, handoff: KVHandoff) -> None:
        """A hand-off came from the prefill core (dropped if its request was cancelled)."""
        if self.cancelled.pop(handoff.request_id, None) is not None:
            return
        self.arrived[handoff.request_id] = (handoff, self._clock())

    def cancel(self, request_id: str) -> bool:
        """The request was aborted before it was adopted; True if the desk held anything of it
        (a hand-off still on its way is dropped when it comes)."""
        had_arrived = self.arrived.pop(request_id, None) is not None
        was_expected = self.expected.pop(request_id, None) is not None
        if not had_arrived:
            self.cancelled[request_id] = self._clock()
        return had_arrived or was_expected

    def ready(self) -> list[KVHandoff]:
        """Hand-offs whose request the API expects, oldest arrival first."""
        both = [(t, h) for rid, (h, t) in self.arrived.items() if rid in self.expected]
        return [h for _, h in sorted(both, key=lambda x: x[0])]

    def adopted(self, request_id: str) -> None:
        self.expected.pop(request_id, None)
        self.arrived.pop(request_id, None)

    def expire(self) -> list[str]:
        """Drop hand-offs that waited :data:`ORPHAN_S` for their AddRequest, and old
        cancellations; the dropped hand-offs' request ids."""
        now = self._clock()
        old = [
            rid
            for rid, (_, t) in self.arrived.items()
            if rid not in self.expected and now - t > ORPHAN_S
        ]
        for rid in old:
            self.arrived.pop(rid)
        for rid in [r for r, t in self.cancelled.items() if now - t > ORPHAN_S]:
            self.cancelled.pop(rid)
        return old

    @property
    def waiting(self) -> int:
        """Hand-offs held here (waiting for room or for their AddRequest)."""
        return len(self.arrived)
