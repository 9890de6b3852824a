"""A buffering HTTP proxy for the ``client_server_ttft_gap`` scenario (symptom case C08).

It forwards each connection's bytes to the server, but holds the server's response until it has
``hold_bytes`` (16 KB by default) or the response ends, the way a proxy with response buffering
on would. The client then sees a first token far later than the server sent it, and tokens in
bursts. Raw TCP (asyncio streams), so it is protocol-agnostic and keeps keep-alive intact.
"""

from __future__ import annotations

import asyncio
import contextlib


class BufferingProxy:
    """Listen on ``listen_port`` (0 = any free port) and forward to ``target_host:target_port``.

    Args:
        hold_bytes: bytes of response held before anything is forwarded (then again for the
            next ``hold_bytes``), flushed when the server closes or goes quiet.
        idle_flush_s: a held buffer is flushed after the server has been silent this long (s),
            so a short response still arrives.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        hold_bytes: int = 16 * 1024,
        idle_flush_s: float = 2.0,
    ):
        self.target = (target_host, target_port)
        self.listen = (listen_host, listen_port)
        self.hold_bytes = hold_bytes
        self.idle_flush_s = idle_flush_s
        self._server: asyncio.AbstractServer | None = None

    @property
    def port(self) -> int:
        assert self._server is not None, "proxy not started"
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, *self.listen)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, c_reader, c_writer) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection(*self.target)
        except OSError:
            c_writer.close()
            return

        async def upstream():
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                while data := await c_reader.read(65536):
                    s_writer.write(data)
                    await s_writer.drain()
            with contextlib.suppress(OSError):
                s_writer.write_eof()

        async def downstream():
            held = bytearray()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                while True:
                    try:
                        data = await asyncio.wait_for(s_reader.read(65536), self.idle_flush_s)
                    except TimeoutError:
                        data = None
                    if data == b"":
                        break
                    if data:
                        held += data
                    if held and (data is None or len(held) >= self.hold_bytes):
                        c_writer.write(bytes(held))
                        held.clear()
                        await c_writer.drain()
                if held:
                    c_writer.write(bytes(held))
                    await c_writer.drain()
            with contextlib.suppress(OSError):
                c_writer.close()

        up = asyncio.ensure_future(upstream())
        await downstream()
        up.cancel()
        with contextlib.suppress(OSError):
            s_writer.close()
