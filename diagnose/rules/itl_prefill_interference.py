"""``itl_prefill_interference``: ITL spikes while prefills run."""

from __future__ import annotations

from ..signals import Signals, Window, open_step, recompute_steps, waiting_now
from ..stats import against_bound
from ._common import (
    _BASE,
    Evidence,
    Param,
    Rule,
    _confidence,
    _in_window,
    _ms,
    _ratio,
    _severity,
    _when,
)
from .host_contention import others_cpu_pct
from .periodic_itl_spikes import decode_stalls

# a prefill step within this many usual decode steps of a stall of decode-only steps shares its
# cause (a burst on the host slows the steps on both sides of it; a prefill only its own)
STALL_MARGIN_STEPS = 3

# Each step that carries prefill next to running decodes, or while streams are mid-answer (a
# scheduler without chunked prefill runs a prompt's prefill in a step of its own and the streams
# wait it out: their next token comes after it), with the slower of the decode-only steps just
# before and just after it (NULL where there is none in the range).
_MIXED_STEPS_SQL = """
WITH s AS (SELECT start_ns, (end_ns - start_ns) / 1e6 AS ms,
                  num_prefill_tokens / greatest(num_prefill_chunks, 1) AS prefill,
                  num_prefill_tokens > 0 AND (
                      num_running > num_prefill_chunks
                      OR EXISTS (SELECT 1 FROM requests r
                                 WHERE r.first_token_ns < engine_steps.start_ns
                                   AND r.last_token_ns > engine_steps.end_ns)) AS mixed,
                  CASE WHEN num_prefill_tokens = 0 AND num_decode_tokens > 0
                       THEN (end_ns - start_ns) / 1e6 END AS decode_ms
           FROM engine_steps WHERE start_ns >= ? AND start_ns < ?),
n AS (SELECT *,
        last_value(decode_ms IGNORE NULLS) OVER (
            ORDER BY start_ns ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before_ms,
        first_value(decode_ms IGNORE NULLS) OVER (
            ORDER BY start_ns ROWS BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING) AS after_ms
      FROM s)
SELECT start_ns, ms, greatest(before_ms, after_ms), prefill FROM n WHERE mixed ORDER BY start_ns
"""
# (prefill: the step's mean tokens per prefill chunk, so a step whose mean reaches a bound holds a
# chunk that does: six short prompts let in together are not one long prompt to chunk)


def _prefill_stretched(
    sig: Signals, p: dict, base_step: float | None
) -> list[tuple[int, float, float]]:
    """Steps carrying at least ``min_prefill_tokens`` of prefill that took ``local_spike`` x the
    decode-only steps on either side of them: ``(start_ns, ms, neighbour_ms)``. A host stall (a
    neighbour process, GC) slows the steps around a prefill as much as the prefill step itself;
    a prefill slows only its own. So a prefill step beside a stall of decode-only steps is left
    to the stall only when, slowed no more than the stall's slowest decode step was (that
    step over the usual one), it would not have been ``local_spike`` x the usual decode step:
    a 46-token prefill step inside a CPU burst is the burst's, an 8 s prefill of 1,500 tokens
    beside two decode steps slowed 2x (the load generator starting a client) is its own."""
    out = []
    usual = base_step or 50.0
    # decode-only steps stalled too around a slow prefill step: something outside the step's
    # work (a host job, a periodic disturbance) slowed it, not its prefill
    margin = int(STALL_MARGIN_STEPS * usual * 1e6)
    stalls = [
        (s - margin, e + margin, _slowest_decode_ms(sig, s, e) / usual)
        for s, _, _, e in decode_stalls(sig)
    ]
    # a step whose prefill is mostly preempted requests computed again is the KV pool's
    # (kv_pressure_preemption names it), not a prompt's prefill to chunk
    recompute = {r.start_ns for r in recompute_steps(sig) if r.mostly_recompute}
    for start, ms, near, prefill in sig.con.execute(
        _MIXED_STEPS_SQL, [sig.since_ns, sig.until_ns]
    ).fetchall():
        if start in recompute:
            continue
        near = near if near is not None else base_step
        if prefill >= p["min_prefill_tokens"] and near and ms >= p["local_spike"] * near:
            end = start + int(ms * 1e6)
            slowdown = max((f for a, b, f in stalls if a <= end and start <= b), default=None)
            if slowdown is not None and ms / max(slowdown, 1.0) < p["local_spike"] * usual:
                continue
            out.append((start, ms, near))
    return out


# the streams decoding across a step on its replica: a replica's prefill stalls only its own
# streams, and a disaggregated prefill pool's none (its requests' rows name no replica)
_DECODING_ACROSS_SQL = """
WITH step AS (SELECT any_value(replica) AS replica, any_value(role) AS role
              FROM engine_steps WHERE start_ns = ?)
SELECT count(*) FROM requests, step
WHERE first_token_ns < ? AND last_token_ns > ? AND step.role IS DISTINCT FROM 'prefill'
  AND (requests.replica IS NULL OR requests.replica = step.replica)
"""


def stall_share(sig: Signals, stretched: list[tuple[int, float, float]]) -> float | None:
    """The share of the streams' decode time spent waiting out the ``stretched`` prefill steps:
    each step's excess over the decode-only steps beside it, times the streams decoding across
    it on its replica, over the decode time of the requests that arrived in the range (the TPOT
    the prefills cost the streams)."""
    (decode_ms,) = sig.con.execute(
        "SELECT sum(decode_ms) FROM requests WHERE arrival_ns >= ? AND arrival_ns < ?",
        [sig.since_ns, sig.until_ns],
    ).fetchone()
    if not decode_ms:
        return None
    lost = 0.0
    for start, ms, near in stretched:
        end = start + int(ms * 1e6)
        (streams,) = sig.con.execute(_DECODING_ACROSS_SQL, [start, start, end]).fetchone()
        lost += max(ms - (near or 0.0), 0.0) * streams
    return lost / decode_ms


# the longest ITL of the requests decoding in a window: first token before its end, last after
# its start
_ITL_DURING_SQL = """
SELECT max(itl_max_ms) FROM requests WHERE first_token_ns < ? AND last_token_ns > ?
"""


def _slowest_decode_ms(sig: Signals, start_ns: int, end_ns: int) -> float:
    """The slowest decode-only step that started in ``[start_ns, end_ns]``, ms."""
    (ms,) = sig.con.execute(
        "SELECT max((end_ns - start_ns) / 1e6) FROM engine_steps WHERE start_ns >= ? "
        "AND start_ns <= ? AND num_prefill_tokens = 0 AND num_decode_tokens > 0",
        [start_ns, end_ns],
    ).fetchone()
    return ms or 0.0


def _stalled_now(sig: Signals, p: dict) -> Evidence | None:
    """The symptom while the prefill still runs (a live store, ``signals/queue_now.py``): the
    engine has been in one step ``itl_spike`` x its usual decode step (and x the steps just
    before it) or longer, with requests running beside it, and the step began while a prompt
    of ``min_prefill_tokens`` or more was waiting for its first token, with what other
    processes on the host could have slowed it taken out (that is ``host_contention``'s). The
    running requests have had no token since the step began."""
    step = open_step(sig)
    base = sig.baseline.get("decode_step_ms_p50") or sig.overall.get("decode_step_ms_p50")
    if step is None or not base:
        return None
    # requests still without their first token when the step began get none during it: of the
    # running requests, at least the others are decoding beside it
    waiting = [x for x in waiting_now(sig) if x.at_ns >= step.start_ns]
    decoding = step.running - len(waiting)
    long = [
        x
        for x in waiting
        if (x.prompt_tokens or 0) >= p["min_prefill_tokens"] and x.queued_ns <= step.start_ns
    ]
    if not long or decoding <= 0:
        return None  # no prompt to prefill, or nothing known to decode beside it
    # the host's share taken out: processes outside the server using X% of the CPUs slow a
    # step by up to 1 / (1 - X/100) (a fair share of the cores), not 10x; and against the
    # pace just before too: a step no slower than its predecessors is no spike (every step
    # carrying a prefill chunk is slow ITL all along, batch_too_large's)
    others = others_cpu_pct(sig, step.start_ns, step.now_ns)
    host = 1.0 / (1.0 - min(others or 0.0, 95.0) / 100.0)
    if step.lasted_ms / host < p["itl_spike"] * max(base, step.pace_ms):
        return None
    r = step.lasted_ms / base
    big = max(long, key=lambda x: x.prompt_tokens)
    cfg = sig.config
    return Evidence(
        f"the engine has been in one step for {_ms(step.lasted_ms)} (decode steps take "
        f"{_ms(base)}), begun while request {big.request_id} ({big.prompt_tokens} prompt "
        f"tokens) waited for its first token: at least {decoding} running request(s) have had "
        f"no token since; the step has not ended yet (chunked prefill "
        f"{'off' if cfg.enable_chunked_prefill is False else 'on'}, step budget "
        f"{'?' if cfg.max_num_batched_tokens is None else cfg.max_num_batched_tokens} tokens)",
        {
            "open_step_ms": step.lasted_ms,
            "decode_step_ms_p50": base,
            "prefill_request": big.request_id,
            "prefill_prompt_tokens": big.prompt_tokens,
            "decoding_requests": decoding,
            "host_others_cpu_pct": others,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "enable_chunked_prefill": cfg.enable_chunked_prefill,
        },
        (step.start_ns, step.now_ns),
        None,
        [],
        _severity(r, p["itl_spike"]),
        _confidence(r / p["itl_spike"]),
        support=against_bound(
            [r],
            p["itl_spike"],
            unit="steps",
            reference_name=f"the open step over the decode step p50, against {p['itl_spike']:g} "
            "(itl_spike)",
            min_n=1,
            why_one="one step with a long prompt's prefill stalls every stream decoding beside "
            "it: the step is the symptom",
        ),
    )


def detect(sig: Signals, p: dict) -> Evidence | None:
    return _stalled_steps(sig, p) or _stalled_now(sig, p)


def _stalled_steps(sig: Signals, p: dict) -> Evidence | None:
    base_itl = sig.baseline.get("itl_p50")
    base_step = sig.baseline.get("decode_step_ms_p50")
    stretched = _prefill_stretched(sig, p, base_step)

    def in_w(w: Window) -> list[tuple[int, float, float]]:
        return [r for r in stretched if w.start_ns <= r[0] < w.end_ns]

    def step_max(w: Window) -> float | None:
        return max((r[1] for r in in_w(w)), default=None)

    def itl_max(w: Window) -> float | None:
        # the streams decoding in the window, wherever they arrived: a long prompt that comes
        # a window after the streams it stalls is theirs to feel (the window's own itl_max
        # counts the requests that arrived in it)
        if not in_w(w):
            return None
        return sig.con.execute(_ITL_DURING_SQL, [w.end_ns, w.start_ns]).fetchone()[0]

    def spike(w: Window) -> float | None:
        # a gap longer than the slowest prefill step is not this rule's (preemption, stalls)
        if itl_max(w) is None or step_max(w) is None:
            return None
        return min(itl_max(w), step_max(w))

    def hit(w: Window) -> bool:
        step_r = _ratio(step_max(w), base_step)
        itl_r = _ratio(spike(w), base_itl)
        return (
            step_r is not None
            and step_r >= p["mixed_step_rise"]
            and itl_r is not None
            and itl_r >= p["itl_spike"]
        )

    # every window a stretched step began in, busy or not: one long step can leave a window
    # where no request arrives or ends
    w = max((x for x in sig.windows if hit(x)), key=spike, default=None)
    if w is None:
        return None
    r = _ratio(spike(w), base_itl)
    near = max(in_w(w), key=lambda row: row[1])[2]
    where = (
        f"first_token_ns < {w.end_ns} AND last_token_ns > {w.start_ns} "
        f"AND itl_max_ms >= {p['itl_spike']} * itl_p50_ms"
    )
    # each stalled stream against its own usual pace: its longest gap over its ITL p50
    gaps = sig.con.execute(
        "SELECT itl_max_ms / itl_p50_ms FROM requests WHERE arrival_ns >= ? AND arrival_ns < ? "
        f"AND itl_p50_ms > 0 AND ({where})",
        [sig.since_ns, sig.until_ns],
    ).fetchall()
    support = against_bound(
        [g for (g,) in gaps],
        p["itl_spike"],
        unit="requests",
        reference_name=f"each stream's own ITL p50 x {p['itl_spike']:g} (itl_spike)",
        min_n=2,
        why_one="a prefill step stalls every stream decoding beside it: one long prefill is "
        "the symptom",
    )
    share = stall_share(sig, stretched)
    if share is not None and share < p["min_stall_share"]:
        # spikes this rare are the ordinary cost of serving prompts of mixed lengths: named
        # with their numbers, not a finding
        support.verdict = "inconclusive"
        support.reason = (
            f"the streams lost {share:.1%} of their decode time waiting out prefill steps, "
            f"under the {p['min_stall_share']:.0%} (min_stall_share) worth tuning away"
        )
    cfg = sig.config
    _where, _params = _in_window(w)
    return Evidence(
        f"ITL spiked to {_ms(itl_max(w))} (baseline p50 {_ms(base_itl)}) in {_when(w)}; "
        f"steps carrying prefill took up to {_ms(step_max(w))} against {_ms(near)} for the "
        f"decode-only steps around them ({_ms(base_step)} baseline; largest prefill in a step: "
        f"{w.get('prefill_tokens_max') or 0:.0f} tokens; chunked prefill "
        f"{'off' if cfg.enable_chunked_prefill is False else 'on'}, step budget "
        f"{'?' if cfg.max_num_batched_tokens is None else cfg.max_num_batched_tokens} tokens)",
        {
            "itl_max_ms": itl_max(w),
            "baseline_itl_p50_ms": base_itl,
            "mixed_step_ms_max": step_max(w),
            "neighbour_decode_step_ms": near,
            "decode_step_ms_p50": base_step,
            "prefill_tokens_max_per_step": w.get("prefill_tokens_max"),
            "decode_time_lost_to_prefill_share": share,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "enable_chunked_prefill": cfg.enable_chunked_prefill,
        },
        (w.start_ns, w.end_ns),
        where,
        [],
        _severity(r, p["itl_spike"]),
        _confidence(r / p["itl_spike"]),
        support=support,
    )


RULE = Rule(
    id="itl_prefill_interference",
    test_metric="itl_max_ms",
    title="ITL spikes while prefills run",
    symptom="running streams' ITL jumps when steps carry prefill tokens",
    causes=(
        "chunked prefill off: a whole prompt's prefill shares one step with decodes",
        "max_num_batched_tokens too large: big prefill chunks per step",
    ),
    checks=(
        "enable_chunked_prefill and max_num_batched_tokens in the config event",
        "prefill tokens in the slow steps",
    ),
    knob="--enable-chunked-prefill with a smaller --max-num-batched-tokens or --long-prefill-token-threshold",
    params={
        "mixed_step_rise": Param(
            4.0, "steps with prefill vs decode-only steps (seed: PD interference)"
        ),
        "itl_spike": Param(8.0, f"max ITL {_BASE} of ITL p50 (case C02: an order of magnitude)"),
        "min_prefill_tokens": Param(
            256,
            "prefill tokens per chunk in the slow step (its prefill tokens over its chunks): "
            "an ordinary prompt's prefill, or several let in together, is not interference "
            "to tune away (case C02's prompt is ~1,500 tokens; on a 2-core CPU with the C "
            "kernels a 109-token prefill step is already 13x a decode step)",
        ),
        "min_stall_share": Param(
            0.10,
            "the streams' decode time lost waiting out prefill steps (each slow step's excess "
            "over the decode steps beside it, times the streams decoding across it), over their "
            "whole decode time: a prompt of a few hundred tokens now and then stalls the streams "
            "beside it for a moment on any engine without chunking; below this share the spikes "
            "are reported inconclusive with their numbers (healthy mixed-length chat loses "
            "1-6%, two or three 1,500-token prompts in a minute of chat 3-8%, a stream of "
            "them 13-64%): an effect that small moves no window's ITL p99",
        ),
        "local_spike": Param(
            8.0,
            "a step with prefill vs the slower decode-only step just before or after it, as "
            "itl_spike: a host stall slows those too (CI: a cron-like CPU burst met a 46-token "
            "prefill step and this rule outranked periodic_itl_spikes)",
        ),
    },
    detect=detect,
    healthy_baseline="needs",
    evidence_signals=("itl_max", "mixed_step_ms_max", "prefill_tokens_max"),
    reads=("requests", "steps"),
    needs={
        # decode_ms: the analysis reads the steps' alias of that name in the stall query
        "requests": ("first_token_ns", "last_token_ns", "request_id", "decode_ms", "replica"),
        "engine_steps": ("req_ids", "req_tokens", "req_prefill", "replica", "role"),
    },
)
