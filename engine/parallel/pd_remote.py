"""An engine core of a disaggregated server that runs on another host (``tokenmill pd-worker
--connect HOST:PORT``, issue 17's host-to-host recipe).

The API (``tokenmill serve --disaggregation ... --remote-decode-listen HOST:PORT``) binds two
ZeroMQ sockets per remote core, ``tcp://HOST:PORT+2j`` (to decode core ``j``) and
``tcp://HOST:PORT+2j+1`` (from it), and sends a :class:`~..messages.RemoteStart` each time it
(re)starts that core. This host's loop (:func:`run_pd_worker`) waits for it, starts the engine
core (``core_process.run_engine_core``, the same loop a local core runs) with this host's copy
of the model, and when the core exits waits for the next start: the API restarts every core of
the link when one dies. A core that exits with an error is reported to the API
(``EngineFatal``), so its streams end at once instead of after the silence timeout.

The KV itself crosses on the link's torch.distributed group, whose rendezvous is on the API's
host (``pd["master_addr"]``), as for a local core.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import signal
import time

import zmq

from ..config import EngineConfig
from ..messages import (
    DRAIN_REQUEST_SIGNAL,
    INPUT_DECODER,
    EngineError,
    EngineFatal,
    RemoteStart,
    encode,
)
from .pd_spec import core_addresses

log = logging.getLogger(__name__)

#: seconds between checks for a start message (and for Ctrl-C)
POLL_S = 0.5


def addresses(connect: str) -> tuple[str, str]:
    """``HOST:PORT`` → the core's input and output ZeroMQ addresses (``PORT``, ``PORT + 1``).

    Raises:
        ValueError: not ``HOST:PORT`` (one line).
    """
    try:
        return core_addresses(connect)
    except ValueError as exc:
        raise ValueError(f"--connect: {exc}") from None


def wait_for_start(in_addr: str, timeout_s: float | None = None) -> RemoteStart | None:
    """Connect to the API's socket and return its next :class:`RemoteStart` (other messages,
    left from a core that is gone, are dropped); None after ``timeout_s``. The socket is
    closed before returning, so the engine core that follows is the socket's only reader."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(in_addr)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while deadline is None or time.monotonic() < deadline:
            if pull.poll(int(POLL_S * 1000)):
                msg = INPUT_DECODER.decode(pull.recv())
                if isinstance(msg, RemoteStart):
                    return msg
        return None
    finally:
        pull.close(linger=0)
        ctx.term()


def start_config(msg: RemoteStart, model: str | None) -> EngineConfig:
    """The engine configuration a :class:`RemoteStart` carries, with this host's model folder
    (``model``) when given.

    Raises:
        ValueError: a configuration this version does not know (another version's API).
    """
    fields = set(EngineConfig.field_names())
    unknown = sorted(set(msg.config) - fields)
    if unknown:
        raise ValueError(f"the API sent engine settings this version lacks: {unknown}")
    config = EngineConfig(**msg.config)
    return dataclasses.replace(config, model=model) if model is not None else config


def report_exit(out_addr: str, exitcode: int | None) -> None:
    """Tell the API the engine core exited with an error (its streams end now)."""
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(out_addr)
    reason = f"remote engine core exited with code {exitcode}"
    push.send(encode(EngineFatal(EngineError("engine_died", reason))))
    push.close(linger=2000)
    ctx.term()


def run_pd_worker(connect: str, model: str | None = None, *, once: bool = False) -> None:
    """Serve one engine core of a disaggregated server on this host, for an API elsewhere:
    start it on each :class:`RemoteStart`, until interrupted (``once``: after one core).

    Raises:
        ValueError: ``connect`` is not ``HOST:PORT``.
    """
    from ..core_process import run_engine_core

    in_addr, out_addr = addresses(connect)
    mp = multiprocessing.get_context("spawn")
    # a SIGTERM to the core asks its parent to drain; the API that drains is on another host
    signal.signal(DRAIN_REQUEST_SIGNAL, signal.SIG_IGN)
    log.warning("pd-worker: waiting for the API at %s", connect)
    while True:
        msg = wait_for_start(in_addr)
        config = start_config(msg, model)
        log.warning(
            "pd-worker: starting %s core (rank %s of %s)",
            msg.pd.get("role"),
            msg.pd.get("rank"),
            msg.pd.get("world_size"),
        )
        proc = mp.Process(
            target=run_engine_core,
            args=(config, in_addr, out_addr, msg.pd),
            name="tokenmill-engine-core",
        )
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            log.warning("pd-worker: engine core exited with code %s", proc.exitcode)
            report_exit(out_addr, proc.exitcode)
        if once:
            return
