"""The rule set: one table of declarative rules, from the seed articles' symptom tables.

Each :class:`Rule` names its symptom, its thresholds (named parameters with a default and the
reason for it), ranked causes, the checks that separate them, the knob to turn and its runbook.
Its ``detect`` function looks at :class:`~tokenmill.diagnose.signals.Signals` and returns
:class:`Evidence` (numbers, the window, a SQL filter for example traces) or None.

Thresholds are ratios to the dump's own healthy baseline (its best windows) or shares within
one window, never absolute milliseconds: the same rule must hold on a 2-core CPU and on an H200.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from .signals import Signals, Window, prefix_block_stats


@dataclass(frozen=True)
class Param:
    """A named threshold: its default and where the number comes from."""

    default: float
    source: str


@dataclass
class Evidence:
    """What a rule saw: a one-line statement, the numbers, the window, example traces."""

    summary: str
    numbers: dict
    window: tuple[int, int] | None
    example_where: str | None = None
    example_params: list = field(default_factory=list)
    severity: str = "warning"  # warning | critical
    confidence: float = 0.7


@dataclass(frozen=True)
class Rule:
    """One diagnosis rule (data + its detector)."""

    id: str
    title: str
    symptom: str
    causes: tuple[str, ...]
    checks: tuple[str, ...]
    knob: str
    params: dict[str, Param]
    detect: Callable[[Signals, dict], Evidence | None]
    # more general rules this one explains when both fire (they are ranked after it)
    explains: tuple[str, ...] = ()

    @property
    def runbook(self) -> str:
        return f"runbooks/{self.id}.md"


# ----- helpers -----


def _ratio(a, b) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _clock(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%H:%M:%S")


def _when(w: Window) -> str:
    return f"{_clock(w.start_ns)}–{_clock(w.end_ns)} UTC"


def _ms(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms"


def _worst(sig: Signals, key: str, pred: Callable[[Window], bool] | None = None) -> Window | None:
    cands = [w for w in sig.busy() if w.get(key) is not None and (pred is None or pred(w))]
    return max(cands, key=lambda w: w.get(key), default=None)


def _severity(ratio: float | None, threshold: float) -> str:
    return "critical" if ratio is not None and ratio >= 2 * threshold else "warning"


def _confidence(*margins: float | None) -> float:
    """0.5 at the thresholds, rising toward 0.95 as every margin (value/threshold) grows."""
    ms = [m for m in margins if m is not None]
    if not ms:
        return 0.5
    m = min(ms)
    return round(min(0.95, 0.5 + 0.45 * (1 - 1 / max(m, 1.0))), 2)


def _in_window(w: Window) -> tuple[str, list]:
    return "arrival_ns >= ? AND arrival_ns < ?", [w.start_ns, w.end_ns]


# ----- detectors -----


def ttft_queueing(sig: Signals, p: dict) -> Evidence | None:
    base, base_itl = sig.baseline.get("ttft_p99"), sig.baseline.get("itl_p99")

    def hit(w: Window) -> bool:
        r = _ratio(w.get("ttft_p99"), base)
        itl = _ratio(w.get("itl_p99"), base_itl)
        return (
            r is not None
            and r >= p["ttft_rise"]
            and (itl is None or itl <= p["itl_flat"])
            and (w.get("queue_share_of_ttft") or 0) >= p["queue_share"]
        )

    w = _worst(sig, "ttft_p99", hit)
    if w is None:
        return None
    r = _ratio(w.get("ttft_p99"), base)
    where, params = _in_window(w)
    return Evidence(
        f"TTFT p99 rose from {_ms(base)} to {_ms(w.get('ttft_p99'))} in {_when(w)} while ITL p99 "
        f"stayed at {_ms(w.get('itl_p99'))} (baseline {_ms(base_itl)}); "
        f"{w.get('queue_share_of_ttft'):.0%} of TTFT was queue time",
        {
            "ttft_p99_ms": w.get("ttft_p99"),
            "baseline_ttft_p99_ms": base,
            "itl_p99_ms": w.get("itl_p99"),
            "baseline_itl_p99_ms": base_itl,
            "queue_share_of_ttft": w.get("queue_share_of_ttft"),
            "queue_p99_ms": w.get("queue_p99"),
            "waiting_max": w.get("waiting_max"),
            "running_max": w.get("running_max"),
        },
        (w.start_ns, w.end_ns),
        where + " AND queue_ms > 0.5 * ttft_ms",
        params,
        _severity(r, p["ttft_rise"]),
        _confidence(r / p["ttft_rise"], (w.get("queue_share_of_ttft") or 0) / p["queue_share"]),
    )


def ttft_prefill_bound(sig: Signals, p: dict) -> Evidence | None:
    base = sig.baseline.get("ttft_p99")
    base_prefill = sig.baseline.get("prefill_p99")

    def hit(w: Window) -> bool:
        r = _ratio(w.get("ttft_p99"), base)
        return (
            r is not None
            and r >= p["ttft_rise"]
            and (w.get("prefill_share_of_ttft") or 0) >= p["prefill_share"]
            and (_ratio(w.get("prefill_p99"), base_prefill) or 0) >= p["prefill_rise"]
        )

    w = _worst(sig, "ttft_p99", hit)
    if w is None:
        return None
    r = _ratio(w.get("ttft_p99"), base)
    where, params = _in_window(w)
    hit_rate = w.get("prefix_hit_rate")
    return Evidence(
        f"TTFT p99 rose from {_ms(base)} to {_ms(w.get('ttft_p99'))} in {_when(w)}; "
        f"{w.get('prefill_share_of_ttft'):.0%} of it was prefill (prompt p50 "
        f"{w.get('input_p50') or 0:.0f}, p99 {w.get('input_p99') or 0:.0f} tokens; prefix-cache hit "
        f"rate {(hit_rate or 0):.0%})",
        {
            "ttft_p99_ms": w.get("ttft_p99"),
            "baseline_ttft_p99_ms": base,
            "prefill_p99_ms": w.get("prefill_p99"),
            "prefill_share_of_ttft": w.get("prefill_share_of_ttft"),
            "input_tokens_p50": w.get("input_p50"),
            "input_tokens_p99": w.get("input_p99"),
            "prefix_hit_rate": hit_rate,
        },
        (w.start_ns, w.end_ns),
        where + " AND prefill_ms > 0.5 * ttft_ms",
        params,
        _severity(r, p["ttft_rise"]),
        _confidence(r / p["ttft_rise"], (w.get("prefill_share_of_ttft") or 0) / p["prefill_share"]),
    )


def head_of_line_blocking(sig: Signals, p: dict) -> Evidence | None:
    base = sig.baseline.get("short_ttft_p99")
    base_itl = sig.baseline.get("itl_p99")
    short = sig.overall.get("short_prompt_tokens") or 0

    def hit(w: Window) -> bool:
        r = _ratio(w.get("short_ttft_p99"), base)
        itl = _ratio(w.get("itl_p99"), base_itl)
        return (
            r is not None
            and r >= p["short_ttft_rise"]
            and (w.get("long_n") or 0) >= 1
            and (w.get("kv_usage_max") or 0) < p["kv_free_below"]
            and (itl is None or itl <= p["itl_flat"])
        )

    w = _worst(sig, "short_ttft_p99", hit)
    if w is None:
        return None
    r = _ratio(w.get("short_ttft_p99"), base)
    where, params = _in_window(w)
    return Evidence(
        f"short prompts (≤ {short} tokens) waited: their TTFT p99 rose from {_ms(base)} to "
        f"{_ms(w.get('short_ttft_p99'))} in {_when(w)} behind {w.get('long_n')} long prompt(s) "
        f"(up to {w.get('input_max') or 0:.0f} tokens) while KV use peaked at "
        f"{(w.get('kv_usage_max') or 0):.0%} and ITL p99 stayed at {_ms(w.get('itl_p99'))}",
        {
            "short_ttft_p99_ms": w.get("short_ttft_p99"),
            "baseline_short_ttft_p99_ms": base,
            "short_prompt_tokens": short,
            "long_prompts": w.get("long_n"),
            "input_tokens_max": w.get("input_max"),
            "kv_usage_max": w.get("kv_usage_max"),
            "itl_p99_ms": w.get("itl_p99"),
            "waiting_max": w.get("waiting_max"),
        },
        (w.start_ns, w.end_ns),
        where + f" AND input_tokens <= {int(short)} AND queue_ms > 0.5 * ttft_ms",
        params,
        _severity(r, p["short_ttft_rise"]),
        _confidence(r / p["short_ttft_rise"]),
    )


def itl_prefill_interference(sig: Signals, p: dict) -> Evidence | None:
    base_itl = sig.baseline.get("itl_p50")
    base_step = sig.baseline.get("decode_step_ms_p50")

    def spike(w: Window) -> float | None:
        # a gap longer than the slowest prefill step is not this rule's (preemption, stalls)
        if w.get("itl_max") is None or w.get("mixed_step_ms_max") is None:
            return None
        return min(w.get("itl_max"), w.get("mixed_step_ms_max"))

    def hit(w: Window) -> bool:
        step_r = _ratio(w.get("mixed_step_ms_max"), base_step)
        itl_r = _ratio(spike(w), base_itl)
        return (
            step_r is not None
            and step_r >= p["mixed_step_rise"]
            and itl_r is not None
            and itl_r >= p["itl_spike"]
        )

    w = _worst(sig, "itl_max", hit)
    if w is None:
        return None
    r = _ratio(spike(w), base_itl)
    cfg = sig.config
    _where, _params = _in_window(w)
    return Evidence(
        f"ITL spiked to {_ms(w.get('itl_max'))} (baseline p50 {_ms(base_itl)}) in {_when(w)}; "
        f"steps carrying prefill took up to {_ms(w.get('mixed_step_ms_max'))} against "
        f"{_ms(base_step)} for decode-only steps (largest prefill in a step: "
        f"{w.get('prefill_tokens_max') or 0:.0f} tokens; chunked prefill "
        f"{'on' if cfg.get('enable_chunked_prefill', True) else 'off'}, step budget "
        f"{cfg.get('max_num_batched_tokens', '?')} tokens)",
        {
            "itl_max_ms": w.get("itl_max"),
            "baseline_itl_p50_ms": base_itl,
            "mixed_step_ms_max": w.get("mixed_step_ms_max"),
            "decode_step_ms_p50": base_step,
            "prefill_tokens_max_per_step": w.get("prefill_tokens_max"),
            "max_num_batched_tokens": cfg.get("max_num_batched_tokens"),
            "enable_chunked_prefill": cfg.get("enable_chunked_prefill"),
        },
        (w.start_ns, w.end_ns),
        f"first_token_ns < {w.end_ns} AND last_token_ns > {w.start_ns} "
        f"AND itl_max_ms >= {p['itl_spike']} * itl_p50_ms",
        [],
        _severity(r, p["itl_spike"]),
        _confidence(r / p["itl_spike"]),
    )


def itl_frontend_overhead(sig: Signals, p: dict) -> Evidence | None:
    w = _worst(sig, "stream_vs_engine_tpot", lambda w: w.get("stream_vs_engine_tpot") >= p["ratio"])
    if w is None:
        return None
    r = w.get("stream_vs_engine_tpot")
    where, params = _in_window(w)
    return Evidence(
        f"the stream delivered tokens {r:.1f}x slower than the engine produced them in {_when(w)} "
        f"(engine TPOT p50 {_ms(w.get('tpot_p50'))}): detokenize/serialize/write is the bottleneck",
        {
            "stream_vs_engine_tpot": r,
            "engine_tpot_p50_ms": w.get("tpot_p50"),
            "step_ms_p50": w.get("step_ms_p50"),
        },
        (w.start_ns, w.end_ns),
        where + " AND output_tokens >= 8",
        params,
        _severity(r, p["ratio"]),
        _confidence(r / p["ratio"]),
    )


def kv_pressure_preemption(sig: Signals, p: dict) -> Evidence | None:
    base_ttft, base_tpot = sig.baseline.get("ttft_p99"), sig.baseline.get("tpot_p99")

    def hit(w: Window) -> bool:
        return (
            (w.get("preemptions") or 0) >= p["min_preemptions"]
            and (w.get("kv_usage_max") or 0) >= p["kv_full"]
            and (_ratio(w.get("ttft_p99"), base_ttft) or 0) >= p["degrade"]
            and (_ratio(w.get("tpot_p99"), base_tpot) or 0) >= p["degrade"]
        )

    w = _worst(sig, "preemptions", hit)
    if w is None:
        return None
    r = min(_ratio(w.get("ttft_p99"), base_ttft), _ratio(w.get("tpot_p99"), base_tpot))
    where, params = _in_window(w)
    return Evidence(
        f"KV cache at {(w.get('kv_usage_max') or 0):.0%} with {w.get('preemptions'):.0f} preemptions "
        f"({w.get('recomputed_tokens') or 0:.0f} tokens recomputed) in {_when(w)}; TTFT p99 "
        f"{_ms(base_ttft)} → {_ms(w.get('ttft_p99'))}, TPOT p99 {_ms(base_tpot)} → "
        f"{_ms(w.get('tpot_p99'))}",
        {
            "kv_usage_max": w.get("kv_usage_max"),
            "preemptions": w.get("preemptions"),
            "recomputed_tokens": w.get("recomputed_tokens"),
            "ttft_p99_ms": w.get("ttft_p99"),
            "baseline_ttft_p99_ms": base_ttft,
            "tpot_p99_ms": w.get("tpot_p99"),
            "baseline_tpot_p99_ms": base_tpot,
            "allocation_failures": w.get("allocation_failures"),
        },
        (w.start_ns, w.end_ns),
        where + " AND preemptions > 0",
        params,
        _severity(r, p["degrade"]),
        _confidence(r / p["degrade"], (w.get("kv_usage_max") or 0) / p["kv_full"]),
    )


def overload(sig: Signals, p: dict) -> Evidence | None:
    ws = sig.busy()
    n = int(p["min_windows"])
    best = None
    for i in range(len(ws) - n + 1):
        run = ws[i : i + n]
        arr = sum(w.get("arrivals", 0) or 0 for w in run)
        done = sum(w.get("completions", 0) or 0 for w in run)
        waits = [w.get("waiting_mean") or 0 for w in run]
        ttfts = [w.get("ttft_p50") for w in run if w.get("ttft_p50") is not None]
        if (
            arr >= p["arrival_excess"] * max(done, 1)
            and waits[-1] - waits[0] >= p["min_queue_growth"]
            and len(ttfts) >= 2
            and ttfts[-1] >= p["ttft_trend"] * ttfts[0]
        ):
            # the largest backlog built, not the largest ratio: a ramp-up of 5 arrivals and
            # 2 completions has a higher ratio than a real overload of 40 and 20
            backlog = arr - done
            if best is None or backlog > best[0]:
                best = (backlog, arr / max(done, 1), run, ttfts)
    if best is None:
        return None
    _, ratio, run, ttfts = best
    first, last = run[0], run[-1]
    return Evidence(
        f"{sum(w.get('arrivals', 0) or 0 for w in run)} requests arrived but only "
        f"{sum(w.get('completions', 0) or 0 for w in run)} completed in "
        f"{_clock(first.start_ns)}–{_clock(last.end_ns)} UTC; the engine queue grew from "
        f"{first.get('waiting_mean') or 0:.1f} to {last.get('waiting_mean') or 0:.1f} and TTFT p50 "
        f"from {_ms(ttfts[0])} to {_ms(ttfts[-1])}",
        {
            "arrivals": sum(w.get("arrivals", 0) or 0 for w in run),
            "completions": sum(w.get("completions", 0) or 0 for w in run),
            "arrival_rate_per_s": statistics.mean(w.get("arrival_rate") or 0 for w in run),
            "completion_rate_per_s": statistics.mean(w.get("completion_rate") or 0 for w in run),
            "waiting_first": first.get("waiting_mean"),
            "waiting_last": last.get("waiting_mean"),
            "ttft_p50_first_ms": ttfts[0],
            "ttft_p50_last_ms": ttfts[-1],
        },
        (first.start_ns, last.end_ns),
        "arrival_ns >= ? AND arrival_ns < ? AND queue_ms > 0.5 * ttft_ms",
        [first.start_ns, last.end_ns],
        _severity(ratio, p["arrival_excess"]),
        _confidence(ratio / p["arrival_excess"], (ttfts[-1] / ttfts[0]) / p["ttft_trend"]),
    )


def oom_low_average_memory(sig: Signals, p: dict) -> Evidence | None:
    fails = sig.overall.get("allocation_failures") or 0
    oom_events = sig.con.execute(
        "SELECT count(*) FROM events WHERE kind IN ('oom', 'allocation_failure') "
        "AND time_ns >= ? AND time_ns < ?",
        [sig.since_ns, sig.until_ns],
    ).fetchone()[0]
    mean_use = sig.overall.get("kv_usage_mean")
    at_fail = sig.overall.get("kv_usage_at_failures")
    if (fails + oom_events) < p["min_failures"] or mean_use is None:
        return None
    if mean_use >= p["mean_usage_below"]:
        return None
    if at_fail is not None and at_fail >= p["mean_usage_below"]:
        return None  # the pool was busy when allocations failed: pressure, not one big request
    w = _worst(sig, "allocation_failures", lambda w: (w.get("allocation_failures") or 0) > 0)
    win = (w.start_ns, w.end_ns) if w else (sig.since_ns, sig.until_ns)
    return Evidence(
        f"{fails:.0f} KV allocation failures and {oom_events} OOM event(s) while mean KV use was "
        f"{mean_use:.0%} ({at_fail or 0:.0%} in the failing steps; peak {(sig.overall.get('kv_usage_max') or 0):.0%}; largest prompt "
        f"{sig.overall.get('input_max') or 0:.0f} tokens): one oversized request, fragmentation "
        f"or a leak, not steady pressure",
        {
            "allocation_failures": fails,
            "oom_events": oom_events,
            "kv_usage_mean": mean_use,
            "kv_usage_at_failures": at_fail,
            "kv_usage_max": sig.overall.get("kv_usage_max"),
            "input_tokens_max": sig.overall.get("input_max"),
        },
        win,
        "input_tokens >= (SELECT quantile_cont(input_tokens, 0.99) FROM requests)",
        [],
        "critical",
        _confidence(p["mean_usage_below"] / max(mean_use, 1e-3)),
    )


def kv_block_leak(sig: Signals, p: dict) -> Evidence | None:
    idle = [w for w in sig.windows if (w.get("idle_steps") or 0) > 0]
    if not idle:
        return None
    last = idle[-1]
    use = last.get("idle_kv_usage_max") or 0
    if use < p["idle_usage"]:
        return None
    total = last.get("kv_blocks_total") or 0
    return Evidence(
        f"with nothing running or waiting, {use:.0%} of the KV cache (~{use * total:.0f} of "
        f"{total:.0f} blocks) was still held in {_when(last)}: blocks are not returned",
        {"idle_kv_usage": use, "kv_blocks_total": total, "idle_steps": last.get("idle_steps")},
        (last.start_ns, last.end_ns),
        "finish_reason = 'abort' OR error_type IS NOT NULL",
        [],
        "critical" if use >= 2 * p["idle_usage"] else "warning",
        _confidence(use / p["idle_usage"]),
    )


def error_spike(sig: Signals, p: dict) -> Evidence | None:
    base_rate = sig.baseline.get("error_rate") or 0.0
    base_tp = sig.baseline.get("throughput_tok_s")

    def hit(w: Window) -> bool:
        rate = w.get("error_rate")
        if rate is None:
            return False
        if rate < max(p["min_rate"], p["rise"] * base_rate) and rate < p["absolute_rate"]:
            return False
        if (w.get("errors") or 0) < p["min_errors"]:
            return False
        tp = _ratio(w.get("throughput_tok_s"), base_tp)
        return tp is None or tp >= p["throughput_normal"]

    w = _worst(sig, "error_rate", hit)
    if w is None:
        return None
    by_type = sig.errors_by_window.get(w.index, {})
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(by_type.items(), key=lambda kv: -kv[1]))
    return Evidence(
        f"{w.get('error_rate'):.0%} of requests ended in errors in {_when(w)} (baseline "
        f"{base_rate:.0%}) while throughput stayed at {w.get('throughput_tok_s') or 0:.0f} tok/s: "
        f"{kinds}",
        {
            "error_rate": w.get("error_rate"),
            "baseline_error_rate": base_rate,
            "errors_by_type": by_type,
            "throughput_tok_s": w.get("throughput_tok_s"),
            "baseline_throughput_tok_s": base_tp,
        },
        (w.start_ns, w.end_ns),
        "end_ns >= ? AND end_ns < ? AND error_type IS NOT NULL",
        [w.start_ns, w.end_ns],
        "critical"
        if w.get("error_rate") >= 2 * max(p["min_rate"], base_rate * p["rise"])
        else "warning",
        _confidence(w.get("error_rate") / max(p["min_rate"], p["rise"] * base_rate)),
    )


def prefix_cache_miss(sig: Signals, p: dict) -> Evidence | None:
    hit_rate = sig.overall.get("prefix_hit_rate")
    if hit_rate is None or hit_rate >= p["hit_rate_below"]:
        return None
    stats = prefix_block_stats(sig.con, sig.since_ns, sig.until_ns, int(p["shared_blocks"]))
    if stats["prompts"] < p["min_prompts"] or stats["share"] < p["share"]:
        return None
    return Evidence(
        f"{stats['shared_tail_differs_first']} of {stats['prompts']} prompts share the "
        f"{int(p['shared_blocks'])} blocks after block {stats['block']} with another prompt but "
        f"differ in block {stats['block']} (tokens {16 * stats['block']}–"
        f"{16 * stats['block'] + 15}), and the prefix-cache hit rate is {hit_rate:.0%}: "
        f"something early in the prompt (a timestamp, a request id) changes every time",
        {
            "prefix_hit_rate": hit_rate,
            "prompts_with_shared_tail": stats["shared_tail_differs_first"],
            "prompts": stats["prompts"],
            "share": stats["share"],
            "differing_block": stats["block"],
            "ttft_p50_ms": sig.overall.get("ttft_p50"),
            "prefill_p50_ms": sig.overall.get("prefill_p50"),
        },
        (sig.since_ns, sig.until_ns),
        "cached_tokens = 0 AND len(prompt_block_hashes) > ?",
        [int(p["shared_blocks"])],
        "warning",
        _confidence(stats["share"] / p["share"], p["hit_rate_below"] / max(hit_rate, 1e-3)),
    )


def client_server_ttft_gap(sig: Signals, p: dict) -> Evidence | None:
    client, server = (
        sig.overall.get("client_ttft_p50"),
        sig.overall.get("server_ttft_p50_with_client"),
    )
    r = _ratio(client, server)
    if r is None or r < p["ratio"]:
        return None
    return Evidence(
        f"clients saw a TTFT p50 of {_ms(client)} where the server measured {_ms(server)} "
        f"({r:.1f}x): something between them (a proxy, a load balancer) buffers the stream",
        {"client_ttft_p50_ms": client, "server_ttft_p50_ms": server, "ratio": r},
        (sig.since_ns, sig.until_ns),
        "client_ttft_ms > ? * ttft_ms",
        [p["ratio"]],
        _severity(r, p["ratio"]),
        _confidence(r / p["ratio"]),
    )


def batching_ineffective(sig: Signals, p: dict) -> Evidence | None:
    cap = sig.config.get("max_num_seqs")
    if not cap:
        return None

    def hit(w: Window) -> bool:
        return (
            (w.get("running_max") or 0) >= cap
            and (w.get("waiting_mean") or 0) >= p["min_waiting"]
            and (w.get("kv_usage_max") or 1) < p["kv_usage_below"]
            and (w.get("queue_share_of_ttft") or 0) >= p["queue_share"]
        )

    w = _worst(sig, "waiting_mean", hit)
    if w is None:
        return None
    where, params = _in_window(w)
    return Evidence(
        f"the batch stayed at max_num_seqs={cap} with {w.get('waiting_mean'):.1f} requests waiting "
        f"on average in {_when(w)} while KV use peaked at only {(w.get('kv_usage_max') or 0):.0%}; "
        f"{w.get('queue_share_of_ttft'):.0%} of TTFT was queueing",
        {
            "max_num_seqs": cap,
            "running_max": w.get("running_max"),
            "waiting_mean": w.get("waiting_mean"),
            "kv_usage_max": w.get("kv_usage_max"),
            "queue_share_of_ttft": w.get("queue_share_of_ttft"),
            "ttft_p99_ms": w.get("ttft_p99"),
        },
        (w.start_ns, w.end_ns),
        where + " AND queue_ms > 0.5 * ttft_ms",
        params,
        "warning",
        _confidence(
            (w.get("waiting_mean") or 0) / p["min_waiting"],
            p["kv_usage_below"] / max(w.get("kv_usage_max") or 1e-3, 1e-3),
        ),
    )


def batch_too_large(sig: Signals, p: dict) -> Evidence | None:
    ws = [w for w in sig.busy() if w.get("throughput_tok_s") and w.get("running_mean") is not None]
    if len(ws) < p["min_windows"]:
        return None
    ws.sort(key=lambda w: w.get("running_mean"))
    peak = max(ws, key=lambda w: w.get("throughput_tok_s"))
    bigger = [
        w for w in ws if w.get("running_mean") >= p["batch_growth"] * peak.get("running_mean")
    ]
    if not bigger:
        return None
    worst = min(bigger, key=lambda w: w.get("throughput_tok_s"))
    drop = worst.get("throughput_tok_s") / peak.get("throughput_tok_s")
    if drop > 1 - p["throughput_drop"]:
        return None
    return Evidence(
        f"throughput fell from {peak.get('throughput_tok_s'):.0f} tok/s at a batch of "
        f"{peak.get('running_mean'):.1f} to {worst.get('throughput_tok_s'):.0f} tok/s at "
        f"{worst.get('running_mean'):.1f} ({_when(worst)}): past the knee, a bigger batch only "
        f"slows every step",
        {
            "peak_throughput_tok_s": peak.get("throughput_tok_s"),
            "peak_batch": peak.get("running_mean"),
            "throughput_tok_s": worst.get("throughput_tok_s"),
            "batch": worst.get("running_mean"),
            "step_ms_p50_at_peak": peak.get("step_ms_p50"),
            "step_ms_p50": worst.get("step_ms_p50"),
        },
        (worst.start_ns, worst.end_ns),
        *_in_window(worst),
        "warning",
        _confidence((1 - drop) / p["throughput_drop"]),
    )


def midstream_stall(sig: Signals, p: dict) -> Evidence | None:
    def hit(w: Window) -> bool:
        done = w.get("completed_arrivals") or 0
        stalled = w.get("stalled_n") or 0
        return (
            done > 0
            and stalled / done >= p["share"]
            and (w.get("stalled_preempted_n") or 0) >= p["preempted_share"] * stalled
        )

    w = _worst(sig, "stalled_n", hit)
    if w is None:
        return None
    share = (w.get("stalled_n") or 0) / (w.get("completed_arrivals") or 1)
    pre = w.get("stalled_preempted_n") or 0
    where, params = _in_window(w)
    return Evidence(
        f"{w.get('stalled_n')} requests got their first token fast, then stalled (largest gap "
        f"{_ms(w.get('itl_max'))}, ≥ 10x their own ITL p50) in {_when(w)}; {pre} of them were "
        f"preempted and recomputed",
        {
            "stalled_requests": w.get("stalled_n"),
            "stalled_share": share,
            "stalled_and_preempted": pre,
            "itl_max_ms": w.get("itl_max"),
            "itl_p50_ms": w.get("itl_p50"),
        },
        (w.start_ns, w.end_ns),
        where + " AND itl_max_ms >= 10 * itl_p50_ms",
        params,
        "warning",
        _confidence(share / p["share"], 1.5 if pre else 1.0),
    )


def periodic_itl_spikes(sig: Signals, p: dict) -> Evidence | None:
    rows = sig.con.execute(
        """
        WITH s AS (SELECT start_ns, (end_ns - start_ns) / 1e6 AS ms, num_running
                   FROM engine_steps WHERE start_ns >= ? AND start_ns < ?
                     AND num_prefill_tokens = 0 AND num_decode_tokens > 0)
        SELECT start_ns, ms, num_running FROM s
        WHERE ms >= ? * (SELECT quantile_cont(ms, 0.5) FROM s) ORDER BY start_ns
        """,
        [sig.since_ns, sig.until_ns, p["spike"]],
    ).fetchall()
    if len(rows) < p["min_spikes"]:
        return None
    times = [r[0] for r in rows]
    gaps = [(b - a) / 1e9 for a, b in itertools.pairwise(times)]
    period = statistics.median(gaps)
    if period <= 0:
        return None
    # a spike can be missed (it fell on a prefill step): gaps at 2x or 3x the period still count
    off = [abs(g / period - round(g / period)) for g in gaps if round(g / period) >= 1]
    regular = sum(1 for o in off if o <= p["max_cv"]) / len(gaps)
    on_period = [g for g in gaps if abs(g / period - 1) <= p["max_cv"]]
    cv = statistics.pstdev(on_period) / period if len(on_period) > 1 else 1.0
    if regular < p["min_regular"] or cv > p["max_cv"]:
        return None
    mean = statistics.mean(on_period)
    running = [r[2] for r in rows]
    return Evidence(
        f"{len(rows)} decode steps took ≥ {p['spike']:.0f}x the median step, every "
        f"{mean:.2f} s (period varies by {cv:.0%}), without a load change (running "
        f"{min(running)}–{max(running)}): something periodic (GC, a sampler, a cron, a checkpoint) "
        f"stalls the loop",
        {
            "spikes": len(rows),
            "period_s": mean,
            "period_cv": cv,
            "spike_ms_max": max(r[1] for r in rows),
        },
        (times[0], times[-1]),
        "first_token_ns < ? AND last_token_ns > ?",
        [times[-1], times[0]],
        "warning",
        _confidence(p["max_cv"] / max(cv, 1e-3), len(rows) / p["min_spikes"]),
    )


def gpu_throttling(sig: Signals, p: dict) -> Evidence | None:
    if sig.device_kind != "gpu":
        return None
    base_clock, base_itl = sig.baseline.get("sm_clock_mean"), sig.baseline.get("itl_p99")

    def hit(w: Window) -> bool:
        drop = _ratio(w.get("sm_clock_mean"), base_clock)
        return (
            drop is not None
            and drop <= p["clock_drop"]
            and (w.get("throttled_samples") or 0) > 0
            and (_ratio(w.get("itl_p99"), base_itl) or 0) >= p["itl_rise"]
        )

    cands = [w for w in sig.busy() if hit(w)]
    if not cands:
        return None
    w = min(cands, key=lambda w: w.get("sm_clock_mean"))
    reasons = sig.con.execute(
        "SELECT list_distinct(flatten(list(clock_event_reasons))) FROM device_samples "
        "WHERE kind = 'gpu' AND time_ns >= ? AND time_ns < ?",
        [w.start_ns, w.end_ns],
    ).fetchone()[0]
    return Evidence(
        f"SM clock fell from {base_clock:.0f} to {w.get('sm_clock_mean'):.0f} MHz in {_when(w)} "
        f"(reasons: {', '.join(sorted(reasons or []))}; max temperature "
        f"{w.get('temperature_max') or 0:.0f} C, power {w.get('power_w_mean') or 0:.0f} W) while ITL "
        f"p99 rose from {_ms(base_itl)} to {_ms(w.get('itl_p99'))}",
        {
            "sm_clock_mhz": w.get("sm_clock_mean"),
            "baseline_sm_clock_mhz": base_clock,
            "clock_event_reasons": sorted(reasons or []),
            "temperature_max_c": w.get("temperature_max"),
            "power_w_mean": w.get("power_w_mean"),
            "itl_p99_ms": w.get("itl_p99"),
            "baseline_itl_p99_ms": base_itl,
        },
        (w.start_ns, w.end_ns),
        *_in_window(w),
        "critical",
        _confidence(p["clock_drop"] / w.get("sm_clock_mean") * base_clock),
    )


def host_bound_steps(sig: Signals, p: dict) -> Evidence | None:
    base_step = sig.baseline.get("step_ms_p50")

    def hit(w: Window) -> bool:
        share = w.get("host_share_of_step") or 0
        slow = _ratio(w.get("step_ms_p50"), base_step) or 0
        gpu_idle = (
            sig.device_kind == "gpu" and (w.get("gpu_util_mean") or 100) < p["gpu_busy_below"]
        )
        return share >= p["host_share"] and (slow >= p["step_slowdown"] or gpu_idle)

    w = _worst(sig, "host_share_of_step", hit)
    if w is None:
        return None
    share = w.get("host_share_of_step")
    util = w.get("gpu_util_mean")
    return Evidence(
        f"{share:.0%} of each engine step went to scheduling and sampling on the host in "
        f"{_when(w)} (schedule {_ms(w.get('schedule_ms_mean'))}, sample "
        f"{_ms(w.get('sample_ms_mean'))}, forward {_ms(w.get('forward_ms_mean'))}"
        + (f"; GPU busy {util:.0f}%" if util is not None and sig.device_kind == "gpu" else "")
        + ")",
        {
            "host_share_of_step": share,
            "schedule_ms_mean": w.get("schedule_ms_mean"),
            "sample_ms_mean": w.get("sample_ms_mean"),
            "forward_ms_mean": w.get("forward_ms_mean"),
            "step_ms_p50": w.get("step_ms_p50"),
            "baseline_step_ms_p50": base_step,
            "gpu_util_mean": util,
        },
        (w.start_ns, w.end_ns),
        *_in_window(w),
        "warning",
        _confidence(share / p["host_share"]),
    )


# ----- the table -----

_BASE = "ratio to the dump's healthiest windows (its 25th-percentile window)"

RULES: tuple[Rule, ...] = (
    Rule(
        "ttft_queueing",
        "TTFT up, ITL flat: requests wait in the queue",
        "TTFT rises while ITL stays flat and queue time dominates TTFT",
        (
            "offered load above what the engine can admit (arrivals > completions)",
            "max_num_seqs or the KV pool caps the running batch",
            "one tenant floods the queue",
        ),
        (
            "arrival vs completion rate in the window (overload if arrivals win)",
            "running_max vs max_num_seqs and KV usage (cap vs memory)",
            "requests per tenant in the window",
        ),
        "--max-num-seqs up (if KV allows), more replicas, or tenant max_concurrent / --max-queue-len to shed load early",
        {
            "ttft_rise": Param(3.0, f"TTFT p99 {_BASE}; seed article: TTFT up with ITL flat"),
            "itl_flat": Param(1.5, f"ITL p99 {_BASE} still counted as flat"),
            "queue_share": Param(0.5, "queue time is the larger part of TTFT"),
        },
        ttft_queueing,
    ),
    Rule(
        "ttft_prefill_bound",
        "TTFT up because prefill is slow",
        "TTFT rises and prefill time, not queueing, is most of it",
        (
            "longer prompts than usual (input length mix shifted)",
            "low prefix-cache hit rate for prompts that share a system prompt",
            "prefill competes with decode in the same steps (budget too small)",
        ),
        (
            "input_tokens p50/p99 against the baseline windows",
            "prefix_hit_rate, and prefix_cache_miss's evidence",
            "prefill tokens per step vs max_num_batched_tokens",
        ),
        "--enable-prefix-caching, --max-num-batched-tokens up for prefill throughput, tenant max_prompt_tokens",
        {
            "ttft_rise": Param(3.0, f"TTFT p99 {_BASE}"),
            "prefill_share": Param(0.5, "prefill time is the larger part of TTFT"),
            "prefill_rise": Param(2.0, f"prefill time p99 {_BASE}: prefill itself got slower"),
        },
        ttft_prefill_bound,
    ),
    Rule(
        "head_of_line_blocking",
        "short requests stuck behind a long prompt",
        "short prompts' TTFT jumps while a long prompt is admitted or prefilled, with KV free",
        (
            "strict FCFS admission stops at a long prompt that does not fit yet",
            "a long prefill takes whole steps (no chunking or a large chunk)",
        ),
        (
            "queue time of the short requests (admission) vs their prefill time (steps)",
            "prefill tokens per step while the short requests waited",
        ),
        "--long-prefill-token-threshold (cap one request's chunk), --max-num-batched-tokens down, --scheduling-policy priority",
        {
            "short_ttft_rise": Param(5.0, f"short-prompt TTFT p99 {_BASE} (symptom case C01)"),
            "kv_free_below": Param(0.95, "KV not full: the wait is not memory pressure"),
            "itl_flat": Param(2.0, f"running decodes' ITL p99 {_BASE} still flat"),
        },
        head_of_line_blocking,
        explains=("ttft_queueing", "ttft_prefill_bound"),
    ),
    Rule(
        "itl_prefill_interference",
        "ITL spikes while prefills run",
        "running streams' ITL jumps when steps carry prefill tokens",
        (
            "chunked prefill off: a whole prompt's prefill shares one step with decodes",
            "max_num_batched_tokens too large: big prefill chunks per step",
        ),
        (
            "enable_chunked_prefill and max_num_batched_tokens in the config event",
            "prefill tokens in the slow steps",
        ),
        "--enable-chunked-prefill with a smaller --max-num-batched-tokens or --long-prefill-token-threshold",
        {
            "mixed_step_rise": Param(
                4.0, "steps with prefill vs decode-only steps (seed: PD interference)"
            ),
            "itl_spike": Param(
                8.0, f"max ITL {_BASE} of ITL p50 (case C02: an order of magnitude)"
            ),
        },
        itl_prefill_interference,
        explains=("periodic_itl_spikes",),
    ),
    Rule(
        "itl_frontend_overhead",
        "the output path is slower than the engine",
        "stream-side time per token well above the engine's TPOT",
        (
            "detokenization cost growing with length",
            "JSON/SSE serialization or a slow client socket",
            "the API event loop is saturated (too many streams per process)",
        ),
        (
            "stream vs engine TPOT per request length (growing = detokenizer)",
            "API process CPU in the host samples",
        ),
        "more API processes / fewer streams per process; check the detokenizer (symptom case C03)",
        {"ratio": Param(1.5, "stream-side TPOT / engine TPOT; 1.0 when the output path keeps up")},
        itl_frontend_overhead,
    ),
    Rule(
        "kv_pressure_preemption",
        "KV cache full: preemptions slow everything",
        "TTFT and ITL both degrade with the KV cache near full and preemptions/recompute",
        (
            "too many concurrent long sequences for the KV pool",
            "greedy admission without headroom (watermark too low)",
        ),
        (
            "kv_usage_max and preemptions per window",
            "recomputed tokens vs generated tokens",
        ),
        "--max-num-seqs down, --kv-watermark up, more KV memory (--kv-cache-memory / --gpu-memory-utilization)",
        {
            "kv_full": Param(0.9, "KV use counted as near full"),
            "min_preemptions": Param(1, "at least one preemption in the window"),
            "degrade": Param(1.5, f"TTFT p99 and TPOT p99 {_BASE} (seed: both degrade)"),
        },
        kv_pressure_preemption,
        explains=("midstream_stall", "ttft_queueing", "overload"),
    ),
    Rule(
        "overload",
        "arrivals exceed completions",
        "arrivals outpace completions while the queue and TTFT trend up together",
        (
            "offered load above capacity",
            "capacity dropped (fewer workers, throttling, restart)",
        ),
        ("completion rate vs its baseline (capacity loss) vs arrival rate (load growth)",),
        "scale out, rate-limit tenants (requests_per_minute), --max-queue-len to fail fast with 429",
        {
            "min_windows": Param(3, "consecutive windows to call it a trend"),
            "arrival_excess": Param(1.2, "arrivals / completions over those windows"),
            "ttft_trend": Param(2.0, "TTFT p50 at the end / at the start of the run"),
            "min_queue_growth": Param(
                1.0, "mean requests waiting in the engine grows by at least one over the run"
            ),
        },
        overload,
        explains=("ttft_queueing",),
    ),
    Rule(
        "oom_low_average_memory",
        "allocation failures with memory mostly free",
        "allocation failures or OOM while average KV/HBM use is low",
        (
            "one oversized request (prompt + max_tokens near the context)",
            "fragmentation",
            "a leak (see kv_block_leak)",
        ),
        ("the largest prompts at the failure times", "idle KV usage after traffic"),
        "tenant max_prompt_tokens / max_output_tokens, --max-model-len down, --num-gpu-blocks-override",
        {
            "min_failures": Param(1, "any allocation failure or OOM event"),
            "mean_usage_below": Param(
                0.5,
                "mean KV use, and KV use in the failing steps, counted as low "
                "(seed: OOM with low average memory)",
            ),
        },
        oom_low_average_memory,
    ),
    Rule(
        "kv_block_leak",
        "KV blocks are not returned",
        "KV use does not return to its idle level after traffic drains",
        ("blocks of aborted or failed requests are not freed",),
        ("idle KV usage after aborts vs after clean completions",),
        "restart the engine worker now; report the leak (symptom case C05)",
        {"idle_usage": Param(0.05, "KV share still used with nothing running or waiting")},
        kv_block_leak,
        explains=("oom_low_average_memory",),
    ),
    Rule(
        "error_spike",
        "errors up while throughput is normal",
        "the error rate jumps while tokens/s stays normal",
        (
            "numerical failures (nan_logits)",
            "clients aborting (timeouts upstream)",
            "rejections (rate limits, context length)",
        ),
        ("errors by type in the window",),
        "depends on the type: dtype/model for nan_logits, client timeouts for aborts, tenant limits for 429",
        {
            "min_rate": Param(0.05, "at least 5% of requests in the window"),
            "min_errors": Param(5, "errors in the window (a rate of 1 in 10 is noise)"),
            "absolute_rate": Param(
                0.2, "a fifth of requests failing is a spike even if the whole dump is like it"
            ),
            "rise": Param(3.0, "error rate vs the healthiest windows"),
            "throughput_normal": Param(0.7, f"tokens/s {_BASE} still counted as normal"),
        },
        error_spike,
    ),
    Rule(
        "prefix_cache_miss",
        "shared prompts miss the prefix cache",
        "prompts share a long prefix but the hit rate is low: they differ near the start",
        (
            "a timestamp or id at the top of the system prompt",
            "prefix_cache_scope=tenant with the same prompt across tenants",
        ),
        ("prompts with identical blocks 2..k but a different first block",),
        "move the changing part to the end of the prompt; --prefix-cache-scope global if tenants may share",
        {
            "hit_rate_below": Param(0.2, "prefix-cache hit rate counted as low"),
            "shared_blocks": Param(4, "blocks after the first that must match (64 tokens)"),
            "share": Param(0.5, "share of prompts with a shared tail but a different first block"),
            "min_prompts": Param(5, "prompts needed to call it a pattern"),
        },
        prefix_cache_miss,
        explains=("ttft_prefill_bound",),
    ),
    Rule(
        "client_server_ttft_gap",
        "clients see a much later first token than the server",
        "client TTFT far above server TTFT",
        ("a proxy or load balancer that buffers the stream", "client-side queueing"),
        ("client ITL near zero inside bursts (buffering)",),
        "turn off response buffering in the proxy (e.g. X-Accel-Buffering: no, proxy_buffering off)",
        {"ratio": Param(2.0, "client TTFT p50 / server TTFT p50 (symptom case C08)")},
        client_server_ttft_gap,
    ),
    Rule(
        "batching_ineffective",
        "the batch is capped while memory is free",
        "requests wait although KV is mostly free: the batch is stuck at max_num_seqs",
        ("max_num_seqs too low for this traffic",),
        ("running_max == max_num_seqs with KV usage low",),
        "--max-num-seqs up",
        {
            "min_waiting": Param(1.0, "mean requests waiting in the engine"),
            "kv_usage_below": Param(0.5, "KV counted as mostly free"),
            "queue_share": Param(0.5, "queue time is the larger part of TTFT"),
        },
        batching_ineffective,
        explains=("ttft_queueing",),
    ),
    Rule(
        "batch_too_large",
        "throughput falls as the batch grows",
        "tokens/s drops at larger batches: each step slows more than the batch grows",
        ("max_num_seqs past the knee", "memory-bandwidth bound decode at large batch"),
        ("step time vs batch across windows",),
        "--max-num-seqs down to the batch with the peak tokens/s",
        {
            "min_windows": Param(4, "windows with traffic needed"),
            "batch_growth": Param(1.5, "batch vs the peak-throughput batch"),
            "throughput_drop": Param(0.15, "tokens/s below the peak"),
        },
        batch_too_large,
    ),
    Rule(
        "midstream_stall",
        "fast first token, then a long stall",
        "first token fast, then a gap far above the request's own ITL",
        ("preemption and recompute of running requests", "a long prefill in between"),
        ("preemptions of the stalled requests",),
        "--kv-watermark up or --max-num-seqs down to avoid preemption",
        {
            "share": Param(0.05, "share of completed requests in the window that stalled"),
            "preempted_share": Param(
                0.5, "share of the stalled ones that were preempted (else: interference)"
            ),
        },
        midstream_stall,
    ),
    Rule(
        "periodic_itl_spikes",
        "ITL spikes at a steady period",
        "decode steps spike at a regular interval without a load change",
        (
            "garbage collection",
            "a periodic job on the host (sampler, logrotate, cron)",
            "checkpoints",
        ),
        ("spike period vs known periodic jobs",),
        "find the periodic job; pin the engine to its own cores",
        {
            "spike": Param(5.0, "decode step vs the median decode step"),
            "min_spikes": Param(5, "spikes needed"),
            "max_cv": Param(0.2, "coefficient of variation of the spike period"),
            "min_regular": Param(0.8, "share of spike gaps that are a multiple of the period"),
        },
        periodic_itl_spikes,
    ),
    Rule(
        "gpu_throttling",
        "GPU clocks down",
        "SM clocks drop with thermal or power reasons while ITL rises",
        ("thermal throttling", "power cap"),
        ("clock_event_reasons and temperature in device_samples",),
        "fix cooling or the power cap; outside the engine",
        {
            "clock_drop": Param(0.85, "SM clock vs the baseline's"),
            "itl_rise": Param(1.2, f"ITL p99 {_BASE}"),
        },
        gpu_throttling,
        explains=("host_bound_steps",),
    ),
    Rule(
        "host_bound_steps",
        "steps wait on the host",
        "the host side of each step (schedule, sample) is a large share while steps are slow",
        (
            "Python scheduling overhead at large batch",
            "sampling on the host",
            "kernel launch overhead",
        ),
        ("schedule_ms and sample_ms vs forward_ms",),
        "--max-num-seqs down; CUDA graphs where available",
        {
            "host_share": Param(0.3, "(schedule + sample) / step time"),
            "step_slowdown": Param(1.5, f"step time {_BASE}"),
            "gpu_busy_below": Param(50.0, "GPU utilization % counted as low"),
        },
        host_bound_steps,
    ),
)

RULES_BY_ID = {r.id: r for r in RULES}
