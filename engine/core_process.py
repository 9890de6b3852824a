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

import logging
import os
import signal
import time

import zmq

from .config import EngineConfig
from .errors import RequestRejected
from .messages import (
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
            )
        )
    return info


def run_engine_core(config: EngineConfig, in_addr: str, out_addr: str) -> None:
    """Process entry point: build the :class:`EngineCore` and serve until :class:`Shutdown`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when we stop
    api_pid = os.getppid()
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
    running = True
    while running:
        if os.getppid() != api_pid:  # the API process is gone (killed): nobody to serve
            log.warning("engine core %d: API process %d is gone; exiting", os.getpid(), api_pid)
            break
        timeout = 0 if core.has_work() else IDLE_POLL_MS
        events = poller.poll(timeout)
        while events:
            msg = INPUT_DECODER.decode(pull.recv())
            if isinstance(msg, AddRequest):
                try:
                    core.add_request(
                        msg.request_id,
                        msg.prompt_token_ids,
                        msg.params,
                        priority=msg.priority,
                        tenant=msg.tenant,
                        arrival_ns=msg.arrival_ns,
                    )
                except (RequestRejected, ValueError) as exc:
                    send(RequestFailed(msg.request_id, rejection(exc)))
            elif isinstance(msg, AbortRequests):
                outs = core.abort(msg.request_ids)
                if outs:
                    send(EngineOutputs(outs))
            elif isinstance(msg, StatsQuery):
                send(StatsReply(core.stats()))
            elif isinstance(msg, Shutdown):
                running = False
                break
            events = poller.poll(0)
        if not running:
            break
        if core.has_work():
            outputs, record = core.step()
            send(EngineOutputs(outputs, record))
        elif not events:
            send(Heartbeat(core.stats(), core.idle_record()))
    core.close()
    push.close(linger=1000)
    pull.close(linger=0)
    ctx.term()
