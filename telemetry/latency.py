"""A request's latencies, defined once: from its time stamps to the ms columns of its
``requests`` row. The server (``spans.request_row``), the proxy (``proxy/observe.py``), the
OTLP receiver (another engine's spans) and the planner (``plan/simulate.py``, over arrays of a
whole replay) all derive them here.

The terms (README's Terms; the seed articles' and vLLM's definitions):

- **TTFT**: arrival at the gateway → the first output token (ms).
- **queue time**: the engine took it → first scheduled; **prefill time**: first scheduled →
  first token; **decode time**: first token → last token.
- **ITL**: the gaps between consecutive token arrivals (ms), as vLLM's benchmark counts them:
  tokens that arrive together (one engine step that accepted speculative draft tokens, one
  event the proxy read) are one arrival and add no zero gap.
- **TPOT**: decode time / (output tokens − 1): the mean time per output token after the first
  (below the mean ITL when steps produce several tokens).
- **E2E**: arrival → the end of the answer (the request span's end) (ms).

Each formula takes stamps in one unit and a ``scale`` to ms (:data:`NS` for wall-clock
nanoseconds, :data:`S` for seconds). With numbers, a missing stamp (None) gives None; with numpy
arrays (the planner) a missing stamp is NaN and stays NaN.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

#: ms per unit of the stamps: wall-clock nanoseconds, seconds
NS = 1e-6
S = 1e3

#: the ``requests`` columns :func:`request_latencies` fills
LATENCY_COLUMNS = (
    "ttft_ms",
    "queue_ms",
    "prefill_ms",
    "decode_ms",
    "tpot_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "itl_max_ms",
    "e2e_ms",
)


def elapsed_ms(start, end, scale: float = NS, before=0):
    """``end − start`` in ms, plus ``before``: time the stamps leave out ahead of ``start``
    (the planner replays from the engine's arrival and adds the gateway's time before it).
    None when either stamp is missing."""
    if start is None or end is None:
        return None
    return (end - start + before) * scale


def ttft_ms(arrival, first_token, scale: float = NS, before=0):
    """TTFT: arrival → the first output token (ms)."""
    return elapsed_ms(arrival, first_token, scale, before)


def e2e_ms(arrival, end, scale: float = NS, before=0, after=0):
    """E2E: arrival → the end of the answer (ms); ``before`` as in :func:`elapsed_ms`, and
    ``after``: time the stamps leave out past ``end`` (the planner's replay ends at the
    engine's finish, the answer's last bytes and metering after it)."""
    if arrival is None or end is None:
        return None
    return (end - arrival + before + after) * scale


def tpot_ms(first_token, last_token, output_tokens, scale: float = NS):
    """TPOT: decode time / (output tokens − 1) (ms); None (NaN in arrays) under two tokens."""
    if isinstance(output_tokens, np.ndarray):
        per = (last_token - first_token) / np.maximum(output_tokens - 1, 1) * scale
        return np.where(output_tokens > 1, per, np.nan)
    if first_token is None or last_token is None or not output_tokens or output_tokens < 2:
        return None
    return (last_token - first_token) / (output_tokens - 1) * scale


def arrivals(token_times: list) -> list:
    """The distinct arrivals among a request's token times, in order: tokens stamped alike
    (one step's accepted drafts, one event's text) arrive once."""
    return [t for i, t in enumerate(token_times) if i == 0 or t != token_times[i - 1]]


def itl_ms(token_times: list, scale: float = NS) -> list[float]:
    """ITL: the gaps between consecutive token arrivals (ms), never a zero gap."""
    return [(b - a) * scale for a, b in itertools.pairwise(arrivals(token_times))]


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by linear interpolation (numpy's default); None if empty."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def request_latencies(
    *,
    arrival,
    end,
    output_tokens: int,
    token_times: list | None = None,
    first_token=None,
    last_token=None,
    queued=None,
    scheduled=None,
    scale: float = NS,
    before=0,
    after=0,
) -> dict:
    """The latency columns of a ``requests`` row (:data:`LATENCY_COLUMNS`) from its stamps: a
    request's numbers, or numpy arrays of a whole replay's (then a column is an array).

    ``token_times``: when each output token arrived, where the producer saw them (the engine's
    per-token times, the proxy's events); ``first_token``/``last_token`` default to its ends.
    A producer that knows only the first and last token (another engine's spans, the planner)
    gives those, and its ITL columns are None. ``before``/``after``: time outside the stamps,
    as :func:`ttft_ms` and :func:`e2e_ms` take it."""
    times = token_times or []
    first = first_token if first_token is not None else (times[0] if times else None)
    last = last_token if last_token is not None else (times[-1] if times else None)
    itl = itl_ms(times, scale)
    return {
        "ttft_ms": ttft_ms(arrival, first, scale, before),
        "queue_ms": elapsed_ms(queued, scheduled, scale),
        "prefill_ms": elapsed_ms(scheduled, first, scale),
        "decode_ms": elapsed_ms(first, last, scale),
        "tpot_ms": tpot_ms(first, last, output_tokens, scale),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "itl_max_ms": max(itl) if itl else None,
        "e2e_ms": e2e_ms(arrival, end, scale, before, after),
    }
