"""The last part of a step's time: the API process writing its outputs to the streams.

:class:`StreamWriteClock` holds each step's :class:`StepRecord` from the moment the API process
read the step's outputs off the engine socket until every stream given one of them has written
it, then sets ``StepRecord.stream_write_ms`` and hands the record on. "Written" is the moment a
stream asks :meth:`AsyncEngine.generate` for its next output: the route has then turned the
previous one into SSE chunks (or a JSON body's text) and its ASGI ``send`` has returned, i.e.
the bytes are with the socket (uvicorn waits there while a slow client's socket buffer is
full). The time spent waiting for the event loop to run each stream's task is part of it: that
is the API process's share of a token's latency that no engine-side timer sees (issue 20's
"API-side stream write").
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .messages import RequestOutput, StepRecord

STREAM_WRITE_WAIT_S = 10.0
"""A step whose streams have not all written after this long is handed on anyway, with
``stream_write_ms`` NULL: a client that stopped reading must not hold the step's record back
for good, nor put its stall on every step it lived through as the API's write time."""


class _Step:
    __slots__ = ("last_written_ns", "outputs", "received_ns", "record", "waiting")

    def __init__(self, record: StepRecord, received_ns: int, outputs: list[int]):
        self.record = record
        self.received_ns = received_ns  # time.monotonic_ns()
        self.outputs = outputs  # id() of each output given to a stream
        self.waiting = len(outputs)  # outputs not yet written or dropped
        self.last_written_ns: int | None = None


class StreamWriteClock:
    """Per step, the ms from the API holding its outputs to the last of them written.

    Args:
        emit: called with each finished record (in the event loop; it must not raise into the
            caller: :meth:`AsyncEngine._to_listeners` catches per listener).
        wait_s: see :data:`STREAM_WRITE_WAIT_S`.

    A step with nothing to write (every output's stream gone, or none sampled) is handed on
    at once with ``stream_write_ms = 0.0``. An output a stream took but never asked past (it
    ended on it: an error chunk, a client gone) counts as dropped, so a step whose only output
    was that one reads 0 even though its chunk may have been sent. A step still waited on
    after ``wait_s``, or when the engine stops, is handed on with ``stream_write_ms`` None.
    """

    def __init__(self, emit: Callable[[StepRecord], None], wait_s: float = STREAM_WRITE_WAIT_S):
        self._emit = emit
        self._wait_ns = int(wait_s * 1e9)
        self._steps: dict[int, _Step] = {}  # id(step) -> step still being written
        self._of_output: dict[int, _Step] = {}  # id(RequestOutput) -> its step

    def received(self, record: StepRecord, delivered: list[RequestOutput]) -> None:
        """The step's outputs were just put on their streams' queues (``delivered``: those a
        stream will read; outputs of streams already gone are not in it)."""
        now = time.monotonic_ns()
        if not delivered:
            record.stream_write_ms = 0.0
            self._emit(record)
            return
        step = _Step(record, now, [id(out) for out in delivered])
        self._steps[id(step)] = step
        for key in step.outputs:
            self._of_output[key] = step

    def written(self, out: RequestOutput) -> None:
        """A stream took ``out`` and has written it (it asked for the next output)."""
        step = self._of_output.pop(id(out), None)
        if step is not None:
            step.last_written_ns = time.monotonic_ns()
            self._settle(step)

    def dropped(self, out: RequestOutput) -> None:
        """``out`` will never be written (its stream ended first)."""
        step = self._of_output.pop(id(out), None)
        if step is not None:
            self._settle(step)

    def expire(self) -> None:
        """Hand on the steps waited on longer than ``wait_s`` (``stream_write_ms`` None)."""
        now = time.monotonic_ns()
        # oldest first (dict order is arrival order): stop at the first step still in time, so
        # the read loop's call per message costs one look in the common case
        while self._steps:
            step = next(iter(self._steps.values()))
            if now - step.received_ns <= self._wait_ns:
                break
            self._finish(step, None)

    def flush(self) -> None:
        """Hand on every step still waited on (the engine stopped or died; None as above)."""
        for step in list(self._steps.values()):
            self._finish(step, None)

    def _settle(self, step: _Step) -> None:
        step.waiting -= 1
        if step.waiting <= 0 and id(step) in self._steps:
            self._finish(step, step.last_written_ns or step.received_ns)

    def _finish(self, step: _Step, end_ns: int | None) -> None:
        """``end_ns`` None: not all written (expired, flushed)."""
        del self._steps[id(step)]
        if end_ns is None:
            step.record.stream_write_ms = None
            for key in step.outputs:  # forget its outputs still unwritten
                if self._of_output.get(key) is step:
                    del self._of_output[key]
        else:
            step.record.stream_write_ms = max(0.0, (end_ns - step.received_ns) / 1e6)
        self._emit(step.record)
