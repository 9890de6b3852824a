"""The engine core's own process: a loop that takes requests and aborts from the API process and
sends back each step's outputs and step record, over two ZeroMQ sockets.

Messages (pickled tuples). In: ``("add", dict)``, ``("abort", [ids])``, ``("stats", None)``,
``("shutdown", None)``. Out: ``("ready", info)``, ``("outputs", [RequestOutput], StepRecord|None)``,
``("rejected", request_id, kind, message)``, ``("stats", dict)``, ``("fatal", message)``.
While idle it sends ``("stats", dict)`` and an idle heartbeat ``("outputs", [], record)`` (see
:meth:`EngineCore.idle_record`) at least every ``IDLE_POLL_MS``.
"""

from __future__ import annotations

import os
import signal
import time

import zmq

from .config import EngineConfig
from .errors import RequestRejected

IDLE_POLL_MS = 500  # while idle, wake this often to report stats


def run_engine_core(config: EngineConfig, in_addr: str, out_addr: str) -> None:
    """Process entry point: build the :class:`EngineCore` and serve until ``shutdown``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when we stop
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(out_addr)
    try:
        from .core import EngineCore

        core = EngineCore(config)
    except Exception as exc:  # report why we could not start, then exit
        push.send_pyobj(("fatal", f"{type(exc).__name__}: {exc}".splitlines()[0]))
        pull.close(linger=0)
        push.close(linger=2000)
        ctx.term()
        return
    push.send_pyobj(
        (
            "ready",
            {
                "pid": os.getpid(),
                "started_ns": time.time_ns(),
                "num_blocks": core.block_manager.num_blocks,
                "max_model_len": core.max_model_len,
                "vocab_size": core.runner.model_config.vocab_size,
                "config": config.to_dict(),
                "stats": core.stats(),
            },
        )
    )
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    running = True
    while running:
        timeout = 0 if core.has_work() else IDLE_POLL_MS
        events = poller.poll(timeout)
        while events:
            kind, payload = pull.recv_pyobj()
            if kind == "add":
                try:
                    core.add_request(**payload)
                except (RequestRejected, ValueError) as exc:
                    push.send_pyobj(
                        ("rejected", payload["request_id"], type(exc).__name__, str(exc))
                    )
            elif kind == "abort":
                outs = core.abort(payload)
                if outs:
                    push.send_pyobj(("outputs", outs, None))
            elif kind == "stats":
                push.send_pyobj(("stats", core.stats()))
            elif kind == "shutdown":
                running = False
                break
            events = poller.poll(0)
        if not running:
            break
        if core.has_work():
            outputs, record = core.step()
            push.send_pyobj(("outputs", outputs, record))
        elif not events:
            push.send_pyobj(("stats", core.stats()))
            push.send_pyobj(("outputs", [], core.idle_record()))
    push.close(linger=1000)
    pull.close(linger=0)
    ctx.term()
