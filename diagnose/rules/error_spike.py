"""``error_spike``: errors up while throughput is normal."""

from __future__ import annotations

from ..signals import Signals, Window
from ._common import _BASE, Alert, Evidence, Param, Rule, _confidence, _ratio, _when, _worst

# requests.error_type codes of a refusal (HTTP 429) and the limit that refused
# (engine/api/gateway.py, engine/api/stations.py)
REFUSED_BY = {
    "rate_limit_exceeded": "the tenant rate limit (requests_per_minute)",
    "concurrency_limit_exceeded": "the tenant concurrency limit (max_concurrent)",
    "queue_full": "the admission queue (--max-queue-len)",
}
# a tenant's own limits: refused at the gateway, before the engine sees the request
TENANT_LIMITS = ("rate_limit_exceeded", "concurrency_limit_exceeded")
ABORTED = ("client_disconnected",)
NUMERICAL = ("nan_logits",)
# the engine's own failures: no share of them is a healthy level to compare a spike with (a
# client may disconnect or be refused; an engine should not fail a request)
ENGINE_FAILURES = (*NUMERICAL, "internal_error", "engine_error", "server_error")
# what `tokenmill proxy` records when the engine behind it fails (proxy/app.py, observe.py)
UPSTREAM = (
    "upstream_unreachable",
    "upstream_timeout",
    "upstream_error",
    "upstream_broken",
    "upstream_stream_cut",
    "upstream_malformed_stream",
    "upstream_malformed_response",
)
# the rule's causes, in RULE.causes order, each with the error types that point at it
_CAUSE_TYPES = (
    NUMERICAL,
    ABORTED,
    (*REFUSED_BY, "context_length_exceeded", "prompt_too_long"),
    UPSTREAM,
)


def _upstreams(sig: Signals, w: Window) -> list[str]:
    """The upstreams (``tokenmill proxy --upstream``) of the requests that failed upstream in
    the window, most failures first."""
    rows = sig.con.execute(
        "SELECT s.attributes->>'tokenmill.upstream' AS up, count(*) FROM requests r "
        "JOIN spans s ON s.trace_id = r.trace_id AND s.kind = 'SERVER' "
        "WHERE r.end_ns >= ? AND r.end_ns < ? AND r.error_type IN ? AND up IS NOT NULL "
        "GROUP BY up ORDER BY 2 DESC, 1",
        [w.start_ns, w.end_ns, list(UPSTREAM)],
    ).fetchall()
    return [r[0] for r in rows]


def _refusals(sig: Signals, w: Window) -> list[tuple[str, str, int]]:
    """``(error_type, tenant, count)`` of the refusals that ended in the window, most first."""
    return sig.con.execute(
        "SELECT error_type, coalesce(tenant, '?'), count(*) FROM requests "
        "WHERE end_ns >= ? AND end_ns < ? AND error_type IN ? GROUP BY ALL ORDER BY 3 DESC, 2",
        [w.start_ns, w.end_ns, list(REFUSED_BY)],
    ).fetchall()


def _refusal_text(rows: list[tuple[str, str, int]]) -> str:
    """Who was refused by which limit, e.g. ``refused by the admission queue
    (--max-queue-len): 12 (tenant 'a' 10, tenant 'b' 2)``; several limits joined by ``;``."""
    parts = []
    for code, limit in REFUSED_BY.items():
        mine = [(t, n) for c, t, n in rows if c == code]
        if mine:
            who = ", ".join(f"tenant {t!r} {n}" for t, n in mine[:5])
            parts.append(f"refused by {limit}: {sum(n for _, n in mine)} ({who})")
    return "; ".join(parts)


def _causes(by_type: dict[str, int]) -> tuple[str, ...]:
    """The rule's causes, the one whose error types the window holds most first."""
    counts = [sum(by_type.get(t, 0) for t in types) for types in _CAUSE_TYPES]
    order = sorted(range(len(RULE.causes)), key=lambda i: -counts[i])
    return tuple(RULE.causes[i] for i in order)


def _steady_engine_failures(sig: Signals, p: dict) -> Window | None:
    """The whole range as the incident when the engine's own failures
    (:data:`ENGINE_FAILURES`) are ``min_rate`` of its requests and ``min_engine_failures`` or
    more: a fault there from the start (a model that overflows on some inputs) has no healthy
    window to rise over, and none is needed."""
    errors = sum(sig.errors_by_type.values())
    fails = sum(n for t, n in sig.errors_by_type.items() if t in ENGINE_FAILURES)
    rate = (sig.overall.get("error_rate") or 0.0) * fails / errors if errors else 0.0
    if fails < p["min_engine_failures"] or rate < p["min_rate"]:
        return None
    return _whole_range(sig)


def _whole_range(sig: Signals) -> Window:
    """The range as one window: its overall values and its output tokens per second."""
    o = sig.overall
    seconds = max((sig.end_ns - sig.start_ns) / 1e9, 1e-9)
    w = Window(-1, sig.start_ns, sig.end_ns, values=dict(o))
    w.values["throughput_tok_s"] = (o.get("sampled_tokens") or 0) / seconds or None
    return w


def detect(sig: Signals, p: dict) -> Evidence | None:
    healthy = sig.healthy_baseline
    # without healthy windows only the absolute rate counts, and "normal throughput" has
    # nothing to be compared with
    base_rate = (sig.baseline.get("error_rate") or 0.0) if healthy else None
    base_tp = sig.baseline.get("throughput_tok_s") if healthy else None

    def threshold() -> float:
        if base_rate is None:
            return p["absolute_rate"]
        return min(max(p["min_rate"], p["rise"] * base_rate), p["absolute_rate"])

    def tenant_refusals(w: Window) -> bool:
        """Most of the window's errors are refusals by a tenant's own limit: the gateway
        refuses those before the engine, so the tokens the others' requests make say nothing
        about them (a refused tenant's tokens are not made either)."""
        by = sig.errors_by_window.get(w.index, {}) if w.index >= 0 else sig.errors_by_type
        refused = sum(n for t, n in by.items() if t in TENANT_LIMITS)
        return refused > 0 and 2 * refused >= sum(by.values())

    def hit(w: Window) -> bool:
        rate = w.get("error_rate")
        if rate is None or rate < threshold():
            return False
        if (w.get("errors") or 0) < p["min_errors"]:
            return False
        if tenant_refusals(w):
            return True
        tp = _ratio(w.get("throughput_tok_s"), base_tp)
        return tp is None or tp >= p["throughput_normal"]

    w = _worst(sig, "error_rate", hit)
    by_type = sig.errors_by_window.get(w.index, {}) if w is not None else {}
    if w is None and not healthy:
        # no window holds min_errors (a slow engine ends few requests a window): without a
        # healthy period the whole range is the incident, judged on the same absolute rate
        w = _whole_range(sig)
        if hit(w):
            by_type = dict(sig.errors_by_type)
        else:
            w = None
    if w is None:
        w = _steady_engine_failures(sig, p)
        if w is None:
            return None
        by_type = dict(sig.errors_by_type)
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(by_type.items(), key=lambda kv: -kv[1]))
    refused = _refusals(sig, w)
    tp = w.get("throughput_tok_s") or 0
    if w.get("throughput_tok_s") is None and not sig.overall.get("steps"):
        throughput = "(the store holds no engine steps to read throughput from)"
    elif tp > 0:
        throughput = f"while the engine still produced {tp:.0f} tok/s"
        if base_tp:
            throughput += f" ({tp / base_tp:.0%} of the healthiest windows')"
    else:  # no token in the window: not normal throughput, whatever the errors are
        throughput = "and the engine produced no tokens in that window"
    # severity and confidence scale: the rise over the baseline, or the absolute rate
    scale = p["absolute_rate"] if base_rate is None else max(p["min_rate"], p["rise"] * base_rate)
    base_text = f"baseline {base_rate:.0%}" if base_rate is not None else "no healthy baseline"
    refusal_text = _refusal_text(refused)
    by_tenant: dict[str, dict[str, int]] = {}
    for code, tenant, n in refused:
        by_tenant.setdefault(code, {})[tenant] = n
    causes = _causes(by_type)
    knob = None
    upstreams = _upstreams(sig, w) if causes[0] == RULE.causes[3] else []
    if upstreams:  # behind `tokenmill proxy`: the engine it fronts is the one failing
        causes = (f"the upstream engine {', '.join(upstreams)} ({RULE.causes[3]})", *causes[1:])
        knob = "the upstream engine: is it up, reachable from the proxy, answering in time?"
    if refused and causes[0] == RULE.causes[2]:
        top = max(REFUSED_BY, key=lambda c: sum(n for x, _, n in refused if x == c))
        # the window names the limit: the cause says it instead of "rate limits, context length"
        causes = (f"rejections by {REFUSED_BY[top]}", *causes[1:])
        knob = (
            "capacity (replicas, --max-num-seqs) or a longer --max-queue-len; clients honour "
            "Retry-After"
            if top == "queue_full"
            else "the refused tenants' requests_per_minute / max_concurrent in the tenants "
            "file, if their traffic is legitimate; else they are being throttled as intended"
        )
    return Evidence(
        f"{w.get('error_rate'):.0%} of requests ended in errors "
        f"{'over the whole range, ' if w.index < 0 else ''}in {_when(w)} ({base_text}) "
        f"{throughput}: {kinds}" + (f"; {refusal_text}" if refusal_text else ""),
        {
            "error_rate": w.get("error_rate"),
            "errors": w.get("errors"),
            "ended": w.get("ended"),
            "baseline_error_rate": base_rate,
            "errors_by_type": by_type,
            "refused_by_tenant": by_tenant,
            "upstreams": upstreams,
            "throughput_tok_s": w.get("throughput_tok_s") or 0.0,
            "baseline_throughput_tok_s": base_tp,
            "completions": w.get("completions") or 0,
            "healthy_baseline": healthy,
        },
        (w.start_ns, w.end_ns),
        "end_ns >= ? AND end_ns < ? AND error_type IS NOT NULL",
        [w.start_ns, w.end_ns],
        "critical" if w.get("error_rate") >= 2 * scale or tp <= 0 else "warning",
        _confidence(w.get("error_rate") / scale),
        causes=causes,
        knob=knob,
    )


RULE = Rule(
    id="error_spike",
    own_test="the error share of the requests ending in the window (absolute)",
    title="errors up while throughput is normal",
    symptom="the error rate jumps while tokens/s stays normal",
    causes=(
        "numerical failures (nan_logits)",
        "clients aborting (timeouts upstream)",
        "rejections (rate limits, context length)",
        "the engine behind the proxy unreachable, timing out or failing",
    ),
    checks=("errors by type in the window",),
    knob="depends on the type: dtype/model for nan_logits, client timeouts for aborts, tenant limits for 429",
    params={
        "min_rate": Param(
            0.05,
            "at least 5% of requests in the window; the engine's own failures (NaN logits, "
            "internal errors) at this share of the whole range whatever the baseline",
        ),
        "min_errors": Param(5, "errors in the window (a rate of 1 in 10 is noise)"),
        "absolute_rate": Param(
            0.2, "a fifth of requests failing is a spike even if the whole dump is like it"
        ),
        "rise": Param(3.0, "error rate vs the healthiest windows"),
        "min_engine_failures": Param(
            3,
            "the engine's own failures over the range, when judged without a spike (a healthy "
            "engine fails none; tune split: 4 NaN-logit failures of 28 requests went unnamed "
            "at min_errors)",
        ),
        "throughput_normal": Param(
            0.7,
            f"tokens/s {_BASE} still counted as normal (not asked where most errors are "
            "refusals by a tenant's own limit: the gateway refuses those before the engine)",
        ),
    },
    detect=detect,
    healthy_baseline="either",
    evidence_signals=("error_rate", "throughput_tok_s"),
    alert=Alert(
        name="TokenmillErrorSpike",
        expr=(
            "(\n"
            "  ($error_ratio >= clamp_min($rise * $error_ratio_base, $min_rate))\n"
            "  or ($error_ratio >= $absolute_rate)\n"
            ")\n"
            "and (sum by ($by) (increase(tokenmill_request_errors_total[$window])) >= $min_errors)\n"
            "unless (\n"
            "  ($tokens_per_s / $tokens_per_s_base < $throughput_normal)\n"
            "  unless (\n"
            "    2 * sum by ($by) (increase(tokenmill_request_errors_total{error_type=~"
            f'"{"|".join(TENANT_LIMITS)}"}}[$window]))\n'
            "    >= sum by ($by) (increase(tokenmill_request_errors_total[$window]))\n"
            "  )\n"
            ")"
        ),
        value="share of requests ending in an error",
        unit="%",
        severity="critical",  # requests fail here; the other alerts' requests are slow
    ),
    reads=("requests", "completions", "steps"),
    needs={"requests": ("tenant",)},
)
