"""``DrainingServer``'s signal handling without a server: a stop sent to the process group brings
the API process a SIGTERM and, from its engine core, a drain request at the same moment, and
Python may run one handler inside the other."""

from __future__ import annotations

import asyncio
import signal

import uvicorn

from tokenmill.engine.api.shutdown import DrainingServer
from tokenmill.engine.messages import DRAIN_REQUEST_SIGNAL


def _server(calls: list[str]) -> DrainingServer:
    async def app(scope, receive, send):  # never served
        raise AssertionError

    return DrainingServer(
        uvicorn.Config(app),
        on_drain=lambda name: calls.append(f"drain {name}"),
        on_stop=lambda name: calls.append(f"stop {name}"),
        busy=lambda: 8,  # streams stay open: only a stop may end the drain
        drain_s=60.0,
    )


def _deliver(server: DrainingServer, nested: tuple[int, int] | None, then: list[int]) -> None:
    """Run ``server``'s loop; deliver ``nested[1]``'s handler inside ``nested[0]``'s (at the
    point where it decides), then the signals in ``then``, one by one."""

    async def main():
        server.loop = asyncio.get_running_loop()
        if nested:
            outer, inner = nested
            decide = server._drain_or_stop
            fired = []

            def decide_after_a_nested_handler(sig, frame):
                if not fired:
                    fired.append(1)
                    server.handle_exit(inner, None)  # the inner handler runs here
                decide(sig, frame)

            server._drain_or_stop = decide_after_a_nested_handler
            server.handle_exit(outer, None)
        for sig in then:
            await asyncio.sleep(0.01)
            server.handle_exit(sig, None)
        await asyncio.sleep(0.05)
        if server._drain_task:
            server._drain_task.cancel()

    asyncio.run(main())


def test_a_drain_request_inside_the_sigterm_handler_still_drains():
    """Before: the nested drain request began the drain mid-decision, and the SIGTERM that
    carried it then counted as a second signal: every stream was cut at once (1 run in 7 of the
    stop-signal drill's ``term_group``)."""
    for outer, inner in (
        (signal.SIGTERM, DRAIN_REQUEST_SIGNAL),
        (DRAIN_REQUEST_SIGNAL, signal.SIGTERM),
    ):
        calls: list[str] = []
        server = _server(calls)
        _deliver(server, (outer, inner), [])
        assert calls == ["drain SIGTERM"], (outer, inner, calls)
        assert not server.should_exit and server.signals_received == 1


def test_a_second_stop_signal_still_stops_at_once():
    calls: list[str] = []
    server = _server(calls)
    _deliver(server, (signal.SIGTERM, DRAIN_REQUEST_SIGNAL), [signal.SIGTERM])
    assert calls == ["drain SIGTERM", "stop SIGTERM"], calls
    assert server.should_exit and server.signals_received == 2


def test_a_drain_request_alone_drains_and_never_counts_as_a_signal():
    calls: list[str] = []
    server = _server(calls)
    _deliver(server, None, [DRAIN_REQUEST_SIGNAL, DRAIN_REQUEST_SIGNAL, signal.SIGINT])
    assert calls == ["drain SIGTERM"], calls
    assert server.signals_received == 1 and not server.should_exit
