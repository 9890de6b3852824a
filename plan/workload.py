"""A recorded run's traffic as a replayable workload, and what the recording itself measured.

:func:`read_workload` takes the requests the engine took (``queued_ns`` set; another engine's,
seen through ``tokenmill proxy``: a first token) from a store or dump: arrival offsets, prompt and output lengths, ``max_tokens``, tenant and the prompt's
per-block content hashes (``prompt_block_hashes``, the first 32 blocks). A replay needs prompt
token ids only for the prefix cache, so :meth:`ReplayWorkload.prompt` makes them up from those
hashes: a block whose hash more than one recorded prompt holds gets the same made-up tokens in
each (the cache hits they had are possible again). A prompt's first block that no other holds
gets tokens of the request's own, and the tokens after it are filler, the same in every
prompt: a block's identity in the prefix cache chains every block before it, so once a prompt
has a block of its own, none of its later blocks can match another prompt's. The API's own
time around the engine (gateway to the engine's queue, less the wait for the step in progress,
which the replay makes itself; last token to the response's end) is carried over as the
recording's medians.

:meth:`ReplayWorkload.scaled` and :meth:`ReplayWorkload.repeated` make the "same traffic" what-ifs: arrivals
at ``k`` times the rate, and a recording tiled back to back to any number of requests (each
request's own block is its own in every tile, so a tile does not hit the cache on its
predecessor's private blocks).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np

from tokenmill.telemetry.recorded_config import read_recorded_config

#: the made-up token ids: blocks from a content hash lie below this, a request's own tokens above
_OWN_BASE = 1 << 40
#: room for one request's own tokens (prompt and output) in the made-up id space
_OWN_SPAN = 1 << 20


#: where a shared block's made-up token ids start, in block units: its hash's low bits
_BASE_MASK = (1 << 34) - 1
#: the made-up tokens after a prompt's first own block: the same in every prompt
_FILLER_BASE = 1 << 39
_FILLER: list[int] = []


def _filler(n: int) -> list[int]:
    """The first ``n`` filler tokens."""
    if len(_FILLER) < n:
        _FILLER.extend(range(_FILLER_BASE + len(_FILLER), _FILLER_BASE + n))
    return _FILLER[:n]


# the replay's clock is int64 nanoseconds: arrivals (s) must stay well inside it
MAX_SPAN_S = 2**62 / 1e9


class RecordingError(ValueError):
    """The store cannot be replayed (one line: what is missing)."""


@dataclass
class ReplayWorkload:
    """Requests in arrival order (arrays of equal length) and the recording's API overheads.

    Attributes:
        arrival_s: seconds from the first arrival.
        input_tokens, output_tokens: prompt tokens; output tokens produced (a replayed request
            stops there).
        max_tokens: the request's own ``max_tokens`` (the router counts with it).
        tenants: each request's tenant ('' when none).
        block_hashes: per request, the content hashes of its first full prompt blocks.
        pre_engine_s: the API's own time from arrival to the engine's queue (recorded median,
            less the wait for the engine step in progress, which the replay makes itself).
        post_engine_s: from the last token to the response's end (recorded median).
        block_size: the recording's KV block size (the hashes' granularity).
        start_ns: the first arrival's wall-clock time in the recording.
    """

    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    max_tokens: np.ndarray
    tenants: list[str]
    block_hashes: list[list[int]]
    pre_engine_s: float
    post_engine_s: float
    block_size: int
    start_ns: int = 0
    """the first arrival's wall-clock time in the recording"""
    _shared: frozenset = field(default=frozenset(), repr=False)

    def __post_init__(self) -> None:
        if not self._shared:
            counts = Counter(h for hashes in self.block_hashes for h in set(hashes))
            self._shared = frozenset(h for h, c in counts.items() if c > 1)

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1]) if len(self) else 0.0

    @property
    def rate_per_s(self) -> float | None:
        """Arrivals per second over the arrival span (None for one request)."""
        return (len(self) - 1) / self.duration_s if len(self) > 1 and self.duration_s else None

    def shared_blocks(self, i: int) -> int:
        """How many of request ``i``'s first prompt blocks hold made-up tokens another prompt
        may hold too: those up to its first block of its own. Its later blocks can match no
        other prompt (see the module docstring)."""
        n, shared = 0, self._shared
        for h in self.block_hashes[i][: int(self.input_tokens[i]) // self.block_size]:
            if h not in shared:
                break
            n += 1
        return n

    def prompt(self, i: int, shared_blocks: int | None = None) -> list[int]:
        """Request ``i``'s made-up prompt token ids (see the module docstring);
        ``shared_blocks``: :meth:`shared_blocks`, when known."""
        bs, n = self.block_size, int(self.input_tokens[i])
        if shared_blocks is None:
            shared_blocks = self.shared_blocks(i)
        out: list[int] = []
        for h in self.block_hashes[i][:shared_blocks]:
            start = (h & _BASE_MASK) * bs
            out.extend(range(start, start + bs))
        own = _OWN_BASE + i * _OWN_SPAN
        out.extend(range(own, own + min(bs, n - len(out))))
        rest = n - len(out)
        if rest:
            out.extend(_filler(rest))
        return out

    def output_token(self, i: int) -> int:
        """A made-up output token id of request ``i`` (its own, after its prompt's)."""
        return _OWN_BASE + i * _OWN_SPAN + _OWN_SPAN // 2

    def scaled(self, rate_factor: float) -> ReplayWorkload:
        """The same requests arriving ``rate_factor`` times as fast (gaps divided by it)."""
        if not rate_factor > 0:
            raise RecordingError(f"a rate factor must be > 0, not {rate_factor}")
        with np.errstate(over="ignore"):  # a tiny factor: refused below, not warned about
            arrival_s = self.arrival_s / rate_factor
        if len(arrival_s) and not float(arrival_s.max()) < MAX_SPAN_S:
            raise RecordingError(
                f"rate={rate_factor:g} stretches the recording's arrivals to "
                f"{float(arrival_s.max()):.3g} s, past the {MAX_SPAN_S:.3g} s a nanosecond "
                "clock holds: choose a larger rate"
            )
        return replace(self, arrival_s=arrival_s)

    def repeated(self, num_requests: int) -> ReplayWorkload:
        """The recording tiled back to back (each tile one mean gap after the last) until
        ``num_requests`` requests."""
        n = len(self)
        if num_requests < 1:
            raise RecordingError(f"a replay needs at least 1 request, not {num_requests}")
        tiles = -(-num_requests // n)
        gap = self.duration_s / (n - 1) if n > 1 else 1.0
        period = self.duration_s + gap
        idx = np.tile(np.arange(n), tiles)[:num_requests]
        tile = np.repeat(np.arange(tiles), n)[:num_requests]
        return replace(
            self,
            arrival_s=self.arrival_s[idx] + tile * period,
            input_tokens=self.input_tokens[idx],
            output_tokens=self.output_tokens[idx],
            max_tokens=self.max_tokens[idx],
            tenants=[self.tenants[i] for i in idx],
            block_hashes=[self.block_hashes[i] for i in idx],
        )


_REQUESTS_SQL = """
SELECT arrival_ns, queued_ns, input_tokens, output_tokens, max_tokens, coalesce(tenant, ''),
    prompt_block_hashes, last_token_ns, end_ns
FROM requests
WHERE coalesce(queued_ns, first_token_ns) IS NOT NULL AND input_tokens > 0 AND output_tokens > 0
ORDER BY arrival_ns
"""


# a request reaches the engine's queue at the end of the step in progress when it arrived (the
# engine core reads its input between steps): that wait is the replay's to make, not the API's
_API_BEFORE_ENGINE_SQL = """
SELECT median((r.queued_ns - r.arrival_ns)
              - greatest(least(coalesce(s.end_ns, 0), r.queued_ns) - r.arrival_ns, 0)) / 1e9
FROM (SELECT arrival_ns, queued_ns FROM requests
      WHERE queued_ns IS NOT NULL AND input_tokens > 0 AND output_tokens > 0) r
ASOF LEFT JOIN (SELECT start_ns, end_ns FROM engine_steps
                WHERE num_prefill_tokens + num_decode_tokens > 0) s
    ON r.arrival_ns >= s.start_ns
"""


def _api_time_before_engine(con) -> float:
    """The API's own median time from a request's arrival to the engine's queue, less the wait
    for the engine step that was running when it arrived."""
    (pre,) = con.execute(_API_BEFORE_ENGINE_SQL).fetchone()
    return float(pre or 0.0)


def read_workload(
    con, *, since_ns: int | None = None, until_ns: int | None = None
) -> ReplayWorkload:
    """The requests of a store or dump (by arrival, ``[since_ns, until_ns)``) as a workload.

    Raises:
        RecordingError: no request the engine took and that produced a token.
    """
    rows = [
        r
        for r in con.execute(_REQUESTS_SQL).fetchall()
        if (since_ns is None or r[0] >= since_ns) and (until_ns is None or r[0] < until_ns)
    ]
    if not rows:
        raise RecordingError("the store holds no request the engine took and answered")
    arrival = np.array([r[0] for r in rows], dtype=np.int64)
    outputs = np.array([r[3] for r in rows], dtype=np.int64)
    pre = _api_time_before_engine(con)
    post = [(r[8] - r[7]) / 1e9 for r in rows if r[7] is not None]
    return ReplayWorkload(
        arrival_s=(arrival - arrival[0]) / 1e9,
        input_tokens=np.array([r[2] for r in rows], dtype=np.int64),
        output_tokens=outputs,
        max_tokens=np.array([max(r[4] or 0, o) for r, o in zip(rows, outputs, strict=True)]),
        tenants=[r[5] for r in rows],
        block_hashes=[list(r[6] or []) for r in rows],
        pre_engine_s=float(max(pre, 0.0)),
        post_engine_s=float(max(np.median(post), 0.0)) if post else 0.0,
        block_size=read_recorded_config(con).block_size,
        start_ns=int(arrival[0]),
    )
