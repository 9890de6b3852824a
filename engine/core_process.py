"""The engine core's own process: a loop that takes requests and aborts from the API process and
sends back each step's outputs and step record, over two ZeroMQ sockets.

Every message is a typed Struct of :mod:`tokenmill.engine.messages`, msgpack-encoded. In:
:class:`AddRequest`, :class:`AbortRequests`, :class:`StatsQuery`, :class:`Shutdown`. Out:
:class:`EngineReady` once the model is loaded (with its weight bytes and the device's roofline
peaks), :class:`EngineOutputs` per step (and for aborts), :class:`RequestFailed` for a refused
add, :class:`StatsReply`, and :class:`EngineFatal` when it cannot start. While idle it sends a :class:`Heartbeat` (stats and an idle step record, see
:meth:`EngineCore.idle_record`) at least every ``IDLE_POLL_MS``.

The process ends with its API process: when that one dies without sending :class:`Shutdown`
(SIGKILL, an OOM kill, a crash), the loop sees itself re-parented and exits within
``IDLE_POLL_MS``, instead of holding the model and KV cache (GBs) with nobody to serve.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import time

import zmq

from .config import EngineConfig
from .errors import RequestRejected
from .messages import (
    DRAIN_REQUEST_SIGNAL,
    INPUT_DECODER,
    AbortRequests,
    AddRequest,
    EngineError,
    EngineFatal,
    EngineOutputs,
    EngineReady,
    Heartbeat,
    RequestFailed,
    Shutdown,
    StatsQuery,
    StatsReply,
    encode,
)

log = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # while idle, wake this often to report stats

#: the stable ``error_type`` of each exception ``EngineCore.add_request`` refuses a request with
REJECTION_TYPES = {RequestRejected: "context_length_exceeded", ValueError: "invalid_request"}


def rejection(exc: Exception) -> EngineError:
    """The typed value of an ``add_request`` refusal (see :data:`REJECTION_TYPES`)."""
    kind = next(code for cls, code in REJECTION_TYPES.items() if isinstance(exc, cls))
    return EngineError(kind, str(exc))


def ready_model_info(core, config: EngineConfig) -> dict:
    """``EngineReady.model_info``: the core's memory facts (``EngineCore.model_info``) and the
    device's roofline peaks (``device_peaks.resolve_peaks``: the flags, the GPU table or a
    cached probe of this machine)."""
    info = dict(core.model_info)
    if info:
        from .device_peaks import resolve_peaks

        info.update(
            resolve_peaks(
                info["engine_device"],
                info["model_dtype"],
                config.peak_bandwidth_gbps,
                config.peak_gflops,
                info.get("int8_compute_path"),
            )
        )
    return info


def _adopt_arrivals(core, link, desk, send) -> None:
    """Decode side: take the hand-offs that arrived, adopt those the API expects while the
    pool has room (the rest wait at the desk: back-pressure), drop orphans."""
    import queue

    while True:
        try:
            desk.arrive(link.arrived.get_nowait())
        except queue.Empty:
            break
    for h in desk.ready():
        try:
            request = core.adopt(h)
        except (RequestRejected, ValueError) as exc:
            desk.adopted(h.request_id)
            send(RequestFailed(h.request_id, rejection(exc)))
            continue
        if request is None:
            break  # no room: later ones wait too (first come, first adopted)
        desk.adopted(h.request_id)
    desk.expire()


def ignore_stop_signals(api_pid: int | None) -> None:
    """An engine process's stop signals: SIGINT is ignored (Ctrl-C reaches the whole group; the
    API process drains), SIGTERM asks the API process ``api_pid`` to drain
    (:data:`DRAIN_REQUEST_SIGNAL`) instead of ending this process mid-step. A stop sent to the
    server's process group (systemd's ``KillMode=control-group``, ``kill -TERM -PGID``) thus
    drains as a SIGTERM to the API alone does; the API stops its cores once its streams end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def ask_api_to_drain(signum, frame) -> None:
        if api_pid is not None and os.getppid() == api_pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(api_pid, DRAIN_REQUEST_SIGNAL)

    signal.signal(signal.SIGTERM, ask_api_to_drain)


def run_engine_core(
    config: EngineConfig, in_addr: str, out_addr: str, pd: dict | None = None
) -> None:
    """Process entry point: build the :class:`EngineCore` and serve until :class:`Shutdown`.

    ``pd``: this core's part in ``--disaggregation``: ``{"role": "prefill" | "decode",
    "port": rendezvous port, "cpus": cores to pin to or None, "rank", "world_size",
    "num_prefill": its place in the KV link's group}`` (``engine/parallel/pd_link.py``).
    """
    api_pid = os.getppid()
    ignore_stop_signals(api_pid)  # the API process decides when we stop
    from .logs import configure_from_env

    configure_from_env()  # the server's --log-level and --log-format
    link = desk = None
    if pd is not None:
        from .parallel.pd_link import pin

        pin(pd.get("cpus"))
        if pd.get("cpus") and not config.cpu_threads:
            config = dataclasses.replace(config, cpu_threads=len(pd["cpus"]))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(out_addr)

    def send(msg) -> None:
        push.send(encode(msg))

    try:
        from .core import EngineCore

        core = EngineCore(config, server_pids=(api_pid,))
    except Exception as exc:  # report why we could not start, then exit
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        send(EngineFatal(EngineError("engine_start_failed", reason)))
        pull.close(linger=0)
        push.close(linger=2000)
        ctx.term()
        return
    send(
        EngineReady(
            pid=os.getpid(),
            started_ns=time.time_ns(),
            num_blocks=core.block_manager.num_blocks,
            max_model_len=core.max_model_len,
            vocab_size=core.runner.model_config.vocab_size,
            config=config.to_dict(),
            stats=core.stats(),
            model_info=ready_model_info(core, config),
        )
    )
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    if pd is not None:
        from .parallel.pd_link import AdoptionDesk, PDLink

        link = PDLink(
            pd["role"],
            pd["port"],
            ctx,
            delay_ms=config.fault_kv_transfer_delay_ms,
            rank=pd.get("rank"),
            world_size=pd.get("world_size", 2),
            num_prefill=pd.get("num_prefill", 1),
            device=str(core.runner.device),
            master_addr=pd.get("master_addr", "127.0.0.1"),
            nccl=bool(pd.get("nccl")),
        )
        if link.wake is not None:
            poller.register(link.wake, zmq.POLLIN)
            desk = AdoptionDesk()
    handoff_to: dict[str, int | None] = {}  # prefill side: request id -> its decode rank
    running = True
    steps = 0  # working steps (the crash drill counts them)
    while running:
        if os.getppid() != api_pid:  # the API process is gone (killed): nobody to serve
            log.warning("engine core %d: API process %d is gone; exiting", os.getpid(), api_pid)
            break
        if link is not None and link.error and pd.get("remote"):
            # a core on another host: its API may be gone with the link (a local core's API
            # restarts every core when one dies; this host's pd-worker waits for the next start)
            log.warning("engine core %d: %s; exiting", os.getpid(), link.error)
            break
        timeout = 0 if core.has_work() else IDLE_POLL_MS
        events = poller.poll(timeout)
        if link is not None and link.wake is not None:
            link.drain_wake()
            events = [e for e in events if e[0] is pull]
        while events:
            msg = INPUT_DECODER.decode(pull.recv())
            if isinstance(msg, AddRequest) and msg.adopt and desk is not None:
                desk.expect(msg.request_id)
            elif isinstance(msg, AddRequest):
                try:
                    core.add_request(
                        msg.request_id,
                        msg.prompt_token_ids,
                        msg.params,
                        priority=msg.priority,
                        tenant=msg.tenant,
                        arrival_ns=msg.arrival_ns,
                        hand_off=msg.hand_off,
                    )
                    if msg.hand_off:
                        handoff_to[msg.request_id] = msg.decode_rank
                except (RequestRejected, ValueError) as exc:
                    send(RequestFailed(msg.request_id, rejection(exc)))
            elif isinstance(msg, AbortRequests):
                if desk is not None:  # not adopted yet: drop its hand-off, now or on arrival
                    for rid in msg.request_ids:
                        desk.cancel(rid)
                for rid in msg.request_ids:
                    handoff_to.pop(rid, None)
                outs = core.abort(msg.request_ids)
                if outs:
                    send(EngineOutputs(outs))
            elif isinstance(msg, StatsQuery):
                send(StatsReply(core.stats()))
            elif isinstance(msg, Shutdown):
                running = False
                break
            # more input only: the poller also watches a KV link's wake-up socket, and a wake
            # that came meanwhile would send this loop into a blocking recv on an empty input
            # (the decode core hung there, its heartbeat stale, while hand-offs waited)
            events = pull.poll(0)
        if not running:
            break
        if desk is not None:
            _adopt_arrivals(core, link, desk, send)
        if core.has_work():
            outputs, record = core.step()
            steps += 1
            if config.fault_crash_after_steps and steps >= config.fault_crash_after_steps:
                os._exit(70)  # fault drill: a crash, no goodbye (the worker restarts us)
            if desk is not None and record is not None:  # held, and arrived but not read
                record.num_kv_waiting = desk.waiting + link.arrived.qsize()
            send(EngineOutputs(outputs, record))
            if link is not None and link.role == "prefill":
                for out in outputs:
                    if not out.finished:
                        continue
                    dst = handoff_to.pop(out.request_id, None)
                    if out.finish_reason == "handoff":
                        link.send(core.take_handoff(out.request_id), dst)
        elif not events:
            idle = core.idle_record()
            if desk is not None:
                idle.num_kv_waiting = desk.waiting + link.arrived.qsize()
            send(Heartbeat(core.stats(), idle))
    if link is not None:
        link.close()
    core.close()
    push.close(linger=1000)
    pull.close(linger=0)
    ctx.term()
