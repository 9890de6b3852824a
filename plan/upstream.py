"""Step costs of another engine, fitted on what ``tokenmill proxy`` saw in front of it.

A proxy's store (llama.cpp's ``llama-server``, vLLM or SGLang behind ``tokenmill proxy``)
holds no engine step: only each request as the client saw it (arrival, first and last token,
end, prompt and output tokens) and the upstream's scraped gauges (running, waiting, KV usage).
The plan prices that engine's steps with the same terms as our own (:mod:`.step_cost`: a fixed
cost per step, per decode row, per prompt token, per prompt chunk, per million attended
(query, key) pairs) and replays the traffic through our scheduler set to the upstream's
limits. A continuous-batching engine runs one forward per step over every running request's
next token and the prompt tokens admitted with it, so each answered request gives up to three
equations in those five costs:

* **its decode stretch** (first to last token): ``output - 1`` steps; their decode rows are its
  own plus the tokens every other request produced in that stretch (each request's tokens
  taken as evenly spread over its own stretch), and they carried the prompts of the requests
  whose first token came inside it (not out of its own first step: more than
  :data:`SAME_STEP_MS` after its first token);
* **its TTFT**, where it arrived with a slot free (fewer than ``slots`` requests in flight):
  one step per prompt chunk (``batch_tokens`` each) beside the requests decoding when it
  arrived, and the prompts of the others whose first token came in the same wait (or out of
  the same step: up to :data:`SAME_STEP_MS` after its own);
* **its ITL p50** (the median gap between its tokens): one decode step of its stretch's mean
  decode rows. The decode stretch alone cannot tell a dear decode row from a dear prompt
  token when both grow with the traffic; the typical gap, a step with no prompt in it, can.

Attention is what makes a long prompt dearer per token than a short one and a decode row at
a long context dearer than one at a short context: a prompt of ``p`` tokens attends
``p (p + 1) / 2`` pairs, a decode row as many as its context (taken at its request's mean).

The five costs are the non-negative least-squares solution over the equations, each error
relative to the duration the costs predict (:func:`_solve`; :func:`scipy.optimize.nnls`), with
bootstrap 95% intervals. Every fifth request is held out and its equations scored, by kind; the costs are
then fitted on all of them. The TTFT equation absorbs what the upstream spends per request
outside its steps (its HTTP handling, tokenization): it lands in the per-chunk cost.

The upstream's limits: ``slots`` (its parallel sequences: llama.cpp's ``-np``, vLLM's
``max_num_seqs``), ``batch_tokens`` (the prompt tokens one step takes: llama.cpp's ``-b``,
2048 by default) and ``kv_tokens`` (its KV cache). Given (``--upstream-limits``) they are
taken as given; else ``slots`` is the highest running gauge scraped (a floor: the upstream may
have more), ``batch_tokens`` llama.cpp's default, and the KV cache as large as the busiest
moment needed twice over; the plan says which.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import duckdb
import numpy as np
from scipy.optimize import nnls

from .step_cost import TERMS, Fit, ModelShape, PathFit, StepCostModel

#: the prompt tokens llama.cpp's server takes in one step by default (``-b``)
DEFAULT_BATCH_TOKENS = 2048
#: every this-many-th request (in arrival order) is held out to score the fit
HOLDOUT_EVERY = 5
#: rounds of reweighting each equation by its predicted duration (:func:`_solve`)
REWEIGHT = 3
#: bootstrap resamples for the costs' intervals
BOOTSTRAP = 100
#: the fewest equations of a kind a fit leans on without saying so
MIN_EQUATIONS = 20
#: first tokens this close (ms) came out of one step: its answers leave one after another
#: (llama-server's four first tokens of one step reached the proxy over up to 2.8 ms)
SAME_STEP_MS = 5.0
#: the equations' kinds, named as the step-cost model's held-out kinds are (a decode stretch's
#: steps are decode steps with prompts among them; a TTFT's, prefill steps; an ITL p50 is one
#: decode step)
KINDS = ("eager_decode", "with_prefill", "itl")
#: the limits ``--upstream-limits`` takes
LIMITS = ("slots", "batch_tokens", "kv_tokens")
#: the fit's terms: :data:`TERMS`' first five (the attention term counts attended pairs, in
#: millions: :data:`_SHAPE`); the KV-read term stays zero (a decode row reads as many KV tokens
#: as it attends, so the two cannot be told apart from the outside)
FITTED = 5
#: a shape whose attention term is a million attended (query, key) pairs (the simulator's
#: ``attn_flop_per_pair * layers / 1e9`` per pair) and whose KV term is never priced
_SHAPE = ModelShape(
    linear_params=0, lm_head_params=0, attn_flop_per_pair=1000, layers=1, kv_bytes_per_token=1
)

_REQUESTS_SQL = """
SELECT arrival_ns, first_token_ns, coalesce(last_token_ns, first_token_ns), end_ns,
    input_tokens, output_tokens, itl_p50_ms
FROM requests
WHERE first_token_ns IS NOT NULL AND end_ns IS NOT NULL AND input_tokens > 0
    AND output_tokens > 0 AND error_type IS NULL
ORDER BY arrival_ns
"""


class UpstreamError(ValueError):
    """A proxy's store a plan cannot stand on, or bad limits (one line)."""


@dataclass(frozen=True)
class UpstreamLimits:
    """The upstream's limits the replay takes, and where each came from."""

    slots: int
    batch_tokens: int
    kv_tokens: int
    sources: dict

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def is_upstream_store(con: duckdb.DuckDBPyConnection) -> bool:
    """A store of another engine: no engine step of ours, requests with a first token."""
    try:
        ((steps,),) = con.execute("SELECT count(*) FROM engine_steps").fetchall()
        ((answered,),) = con.execute(
            "SELECT count(*) FROM requests WHERE first_token_ns IS NOT NULL"
        ).fetchall()
    except duckdb.Error:
        return False
    return steps == 0 and answered > 0


def parse_limits(text: str | None) -> dict[str, int]:
    """``slots=4,batch_tokens=2048,kv_tokens=16384`` as a dict (any of them).

    Raises:
        UpstreamError: an unknown limit, one given twice, or a value that is not a whole
            number >= 1.
    """
    out: dict[str, int] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if key not in LIMITS or not sep:
            raise UpstreamError(
                f"--upstream-limits: {part.strip()!r} is not one of "
                f"{', '.join(k + '=N' for k in LIMITS)}"
            )
        try:
            n = int(value.strip())
        except ValueError:
            n = 0
        if n < 1:
            raise UpstreamError(
                f"--upstream-limits: {key} must be a whole number >= 1, not {value.strip()!r}"
            )
        if key in out:
            raise UpstreamError(f"--upstream-limits: {key} is given twice")
        out[key] = n
    return out


def _requests(con, until_ns: int | None) -> np.ndarray:
    rows = [r for r in con.execute(_REQUESTS_SQL).fetchall() if until_ns is None or r[0] < until_ns]
    return np.array(rows, dtype=float).reshape(-1, 7)


def read_limits(con: duckdb.DuckDBPyConnection, given: dict[str, int]) -> UpstreamLimits:
    """The limits a replay of this store takes: those ``given``, else read from the store.

    Raises:
        UpstreamError: no slot count given and no running gauge scraped.
    """
    sources = {k: "given" for k in given}
    slots = given.get("slots")
    if slots is None:
        try:
            ((peak,),) = con.execute("SELECT max(running) FROM engine_samples").fetchall()
        except duckdb.Error:
            peak = None
        if not peak or peak < 1:
            raise UpstreamError(
                "the store holds neither engine steps nor an upstream's scraped running gauge: "
                "record through `tokenmill proxy` with its scrape on, or give "
                "--upstream-limits slots=N"
            )
        slots = int(peak)
        sources["slots"] = "the highest running gauge scraped; the upstream may have more"
    batch = given.get("batch_tokens")
    if batch is None:
        batch = DEFAULT_BATCH_TOKENS
        sources["batch_tokens"] = "llama.cpp's default -b"
    kv = given.get("kv_tokens")
    if kv is None:
        a = _requests(con, None)
        longest = int((a[:, 4] + a[:, 5]).max()) if len(a) else 1
        kv = 2 * slots * longest
        sources["kv_tokens"] = "twice every slot holding the longest request (not limiting)"
    return UpstreamLimits(int(slots), int(batch), int(kv), sources)


def _overlap(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``[i, j]``: how long ``[lo_i, hi_i]`` and ``[lo_j, hi_j]`` overlap (0 on the diagonal)."""
    out = np.clip(
        np.minimum(hi[:, None], hi[None, :]) - np.maximum(lo[:, None], lo[None, :]), 0, None
    )
    np.fill_diagonal(out, 0.0)
    return out


def equations(
    a: np.ndarray, limits: UpstreamLimits
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fit's equations of requests ``a`` (rows of :data:`_REQUESTS_SQL`, ns): feature rows
    in :data:`TERMS`' first :data:`FITTED` terms, durations (ms), each row's request and its
    kind (:data:`KINDS`' index: a decode stretch, a TTFT, an ITL p50). Attended pairs: a prompt
    of ``p`` tokens attends ``p (p + 1) / 2``, a decode row as many as its context, taken at
    its request's mean (its prompt and half its output)."""
    arrival, first, last, end = ((a[:, k] - a[0, 0]) / 1e6 for k in range(4))
    prompt, out, itl = a[:, 4], a[:, 5], a[:, 6]
    chunks = np.ceil(prompt / limits.batch_tokens)
    prompt_pairs = prompt * (prompt + 1) / 2 / 1e6
    context = (prompt + out / 2) / 1e6  # a decode row's attended pairs, in millions
    decoding = (out >= 2) & (last > first)
    rate = np.where(decoding, (out - 1) / np.maximum(last - first, 1e-9), 0.0)
    # decode stretches: own steps, everyone's rows, the prompts admitted inside
    overlap = _overlap(np.where(decoding, first, 0), np.where(decoding, last, 0))
    others = overlap @ rate
    others_pairs = overlap @ (rate * context)
    inside = (first[None, :] > first[:, None] + SAME_STEP_MS) & (first[None, :] <= last[:, None])
    np.fill_diagonal(inside, False)
    rows = out - 1 + others
    row_pairs = (out - 1) * context + others_pairs
    x_dec = np.stack(
        [out - 1, rows, inside @ prompt, inside @ chunks, row_pairs + inside @ prompt_pairs], axis=1
    )
    y_dec = last - first
    # TTFTs of requests that found a slot free: their chunks' steps beside the decoders
    in_flight = ((arrival[None, :] <= arrival[:, None]) & (end[None, :] > arrival[:, None])).sum(
        1
    ) - 1
    beside = (first[None, :] <= arrival[:, None]) & (last[None, :] > arrival[:, None])
    decoders = beside.sum(1)
    same = (first[None, :] > arrival[:, None]) & (first[None, :] < first[:, None] + SAME_STEP_MS)
    np.fill_diagonal(same, False)
    x_ttft = np.stack(
        [chunks, chunks * decoders, prompt + same @ prompt, chunks + same @ chunks,
         prompt_pairs + same @ prompt_pairs + chunks * (beside @ context)],
        axis=1,
    )  # fmt: skip
    y_ttft = first - arrival
    # ITL p50s: the typical gap of a decode stretch is one step of its mean decode rows
    per_step = 1 / np.maximum(out - 1, 1)
    x_itl = np.stack(
        [np.ones(len(a)), rows * per_step, 0 * out, 0 * out, row_pairs * per_step], axis=1
    )
    idx = np.arange(len(a))
    uses = (
        (x_dec, y_dec, decoding & (y_dec > 0)),
        (x_ttft, y_ttft, (in_flight < limits.slots) & (y_ttft > 0)),
        (x_itl, itl, (out >= 3) & decoding & np.isfinite(itl) & (itl > 0)),
    )
    x = np.vstack([xs[use] for xs, _, use in uses])
    y = np.concatenate([ys[use] for _, ys, use in uses])
    req = np.concatenate([idx[use] for _, _, use in uses])
    kind = np.concatenate([np.full(use.sum(), k) for k, (_, _, use) in enumerate(uses)])
    return x, y, req, kind


def _busiest(a: np.ndarray) -> int:
    """The most requests of ``a`` decoding at once (each counted from its first token)."""
    first, last = a[:, 1], a[:, 2]
    return int(((first[None, :] <= first[:, None]) & (last[None, :] > first[:, None])).sum(1).max())


def _solve(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative costs minimising each equation's error relative to its predicted duration
    (iteratively reweighted: :data:`REWEIGHT` rounds after one relative to the measured one).
    Errors relative to the measured durations alone pull every cost low: a duration measured
    long by chance counts for less than one measured short."""
    weight = y
    for _ in range(REWEIGHT + 1):
        coef, _ = nnls(x / weight[:, None], y / weight)
        weight = np.maximum(x @ coef, 0.25 * y)
    return coef


def _score(pred: np.ndarray, y: np.ndarray) -> dict:
    e = np.abs(pred - y) / y * 100
    return {
        "steps": len(e),
        "median_abs_err_pct": float(np.median(e)) if len(e) else None,
        "p90_abs_err_pct": float(np.percentile(e, 90)) if len(e) else None,
    }


def _model(con: duckdb.DuckDBPyConnection) -> str | None:
    """The model most of a store's answered requests named."""
    rows = con.execute(
        "SELECT model FROM requests WHERE model IS NOT NULL AND first_token_ns IS NOT NULL "
        "GROUP BY model ORDER BY count(*) DESC, model LIMIT 1"
    ).fetchall()
    return rows[0][0] if rows else None


def check_upstream_profile(
    recording: duckdb.DuckDBPyConnection, profile: duckdb.DuckDBPyConnection, label: str
) -> None:
    """Refuse a sweep of another engine that is not the recording's: another model named in
    the answers, or requests that ran while the recording's did (a copy of it).

    Raises:
        UpstreamError: one line naming what differs.
    """
    mine, theirs = _model(recording), _model(profile)
    if mine is not None and theirs is not None and mine != theirs:
        raise UpstreamError(
            f"{label}: the profile's answers came from model {theirs!r}, the recording's from "
            f"{mine!r}: a profile prices steps only for the engine it swept"
        )
    span = "SELECT min(arrival_ns), max(end_ns) FROM requests WHERE first_token_ns IS NOT NULL"
    ((lo, hi),), ((r_lo, r_hi),) = (
        profile.execute(span).fetchall(),
        recording.execute(span).fetchall(),
    )
    if lo is None:
        raise UpstreamError(f"{label}: the profile holds no answered request")
    if r_lo is not None and lo <= r_hi and hi >= r_lo:
        raise UpstreamError(
            f"{label}: its requests ran while the recording's did (a copy of it?): a profile "
            "is a sweep made apart from the recording"
        )


def fit_upstream(
    con: duckdb.DuckDBPyConnection, limits: UpstreamLimits, *, until_ns: int | None = None,
    seed: int = 0, extra: tuple = (),
) -> StepCostModel:  # fmt: skip
    """The upstream's step costs from the requests that arrived before ``until_ns`` (all: None),
    and every request of the stores in ``extra`` (a sweep of the same engine,
    :func:`~tokenmill.plan.profile.sweep_upstream`: fitted on, never held out).

    Raises:
        UpstreamError: too few answered requests to fit the costs.
    """
    a = _requests(con, until_ns)
    x, y, req, kind = equations(a, limits) if len(a) else (np.empty((0, FITTED)),) * 4
    if len(y) < 2 * MIN_EQUATIONS:
        raise UpstreamError(
            f"the store holds {len(a)} answered requests ({len(y)} usable equations); fitting "
            f"the upstream's step costs needs {2 * MIN_EQUATIONS}"
        )
    held = req % HOLDOUT_EVERY == HOLDOUT_EVERY - 1
    swept = [_requests(c, None) for c in extra]
    for b in swept:
        if len(b):
            xb, yb, _, kb = equations(b, limits)
            x, y, kind = np.vstack([x, xb]), np.concatenate([y, yb]), np.concatenate([kind, kb])
            held = np.concatenate([held, np.zeros(len(yb), dtype=bool)])
    test_coef = _solve(x[~held], y[~held])
    pred = x[held] @ test_coef
    holdout = {
        name: _score(pred[kind[held] == k], y[held][kind[held] == k])
        for k, name in enumerate(KINDS)
    }
    holdout["all"] = _score(pred, y[held])
    coef = _solve(x, y)
    rng = np.random.default_rng(seed)
    boot = np.array([_solve(x[i], y[i]) for i in rng.integers(0, len(y), (BOOTSTRAP, len(y)))])
    pad = np.zeros(len(TERMS) - FITTED)
    fit = Fit(
        np.concatenate([coef, pad]),
        np.concatenate([np.percentile(boot, 2.5, axis=0), pad]),
        np.concatenate([np.percentile(boot, 97.5, axis=0), pad]),
    )
    zero = Fit(np.zeros(len(TERMS)), np.zeros(len(TERMS)), np.zeros(len(TERMS)))
    busy = max(_busiest(b) for b in [a, *swept] if len(b))
    return StepCostModel(
        shape=_SHAPE,
        paths={"eager": PathFit(fit, zero)},
        native_rows=None,
        gap_ms=0.0,
        threads=0,
        holdout=holdout,
        steps={name: int((kind == k).sum()) for k, name in enumerate(KINDS)} | {"all": len(y)},
        ranges={
            "max_decode_batch": busy,
            "max_eager_decode_batch": busy,
            "max_prefill_tokens": int(max(b[:, 4].max() for b in [a, *swept] if len(b))),
        },
        upstream=limits.to_dict() | {"requests": len(a), "swept": sum(len(b) for b in swept)},
    )


__all__ = [
    "DEFAULT_BATCH_TOKENS",
    "LIMITS",
    "UpstreamError",
    "UpstreamLimits",
    "check_upstream_profile",
    "equations",
    "fit_upstream",
    "is_upstream_store",
    "parse_limits",
    "read_limits",
]
