"""``oom_low_average_memory``: allocation failures with memory mostly free."""

from __future__ import annotations

from ..signals import Signals
from ._common import Evidence, Param, Rule, _confidence, _worst


def detect(sig: Signals, p: dict) -> Evidence | None:
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


RULE = Rule(
    id="oom_low_average_memory",
    own_test="block allocation failures counted in the steps (absolute)",
    title="allocation failures with memory mostly free",
    symptom="allocation failures or OOM while average KV/HBM use is low",
    causes=(
        "one oversized request (prompt + max_tokens near the context)",
        "fragmentation",
        "a leak (see kv_block_leak)",
    ),
    checks=("the largest prompts at the failure times", "idle KV usage after traffic"),
    knob="tenant max_prompt_tokens / max_output_tokens, --max-model-len down, --num-gpu-blocks-override",
    params={
        "min_failures": Param(1, "any allocation failure or OOM event"),
        "mean_usage_below": Param(
            0.5,
            "mean KV use, and KV use in the failing steps, counted as low "
            "(seed: OOM with low average memory)",
        ),
    },
    detect=detect,
    healthy_baseline="absolute",
    evidence_signals=("kv_usage_mean", "allocation_failures"),
    reads=("requests", "completions", "kv"),
)
