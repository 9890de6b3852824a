"""A TCP endpoint that accepts connections and never answers: a hung collector or upstream
for fault drills (``benchmarks/otlp_blackhole.py``, the OTLP export's tests)."""

from __future__ import annotations

import contextlib
import socket
import threading


class BlackHole:
    """Listens on ``127.0.0.1``, accepts every connection, reads what arrives and never writes
    a byte; every connection stays open until :meth:`close`.

    Attributes:
        url: ``http://127.0.0.1:<port>``.
        connections: connections accepted so far.
        bytes_in: bytes received so far (requests that were sent, and never answered).
    """

    def __init__(self):
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        self.bytes_in = 0
        self._open: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name="black-hole", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            self.connections += 1
            self._open.append(conn)
            threading.Thread(target=self._swallow, args=(conn,), daemon=True).start()

    def _swallow(self, conn: socket.socket) -> None:
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                return
            if not data:
                return
            self.bytes_in += len(data)

    def close(self) -> None:
        self._closed = True
        for s in (self._sock, *self._open):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked on it
            s.close()

    def __enter__(self) -> BlackHole:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["BlackHole"]
