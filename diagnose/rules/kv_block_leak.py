"""``kv_block_leak``: KV blocks are not returned."""

from __future__ import annotations

from tokenmill.telemetry.schema import IDLE_KV_LEAK_SHARE

from ..signals import Signals
from ._common import Alert, Evidence, Param, Rule, _confidence, _when


def detect(sig: Signals, p: dict) -> Evidence | None:
    idle = [w for w in sig.windows if (w.get("idle_steps") or 0) > 0]
    if not idle:
        return None
    last = idle[-1]
    use = last.get("idle_kv_usage_max") or 0
    if use < p["idle_usage"]:
        return None
    total = last.get("kv_blocks_total") or 0
    # another engine's scraped KV use says the share, not the pool's size in blocks
    held = f" (~{use * total:.0f} of {total:.0f} blocks)" if total else ""
    return Evidence(
        f"with nothing running or waiting, {use:.0%} of the KV cache{held} was still held in "
        f"{_when(last)}: blocks are not returned",
        {"idle_kv_usage": use, "kv_blocks_total": total, "idle_steps": last.get("idle_steps")},
        (last.start_ns, last.end_ns),
        "finish_reason = 'abort' OR error_type IS NOT NULL",
        [],
        "critical" if use >= 2 * p["idle_usage"] else "warning",
        _confidence(use / p["idle_usage"]),
    )


RULE = Rule(
    id="kv_block_leak",
    own_test="KV blocks held with nothing running (absolute)",
    title="KV blocks are not returned",
    symptom="KV use does not return to its idle level after traffic drains",
    causes=("blocks of aborted or failed requests are not freed",),
    checks=("idle KV usage after aborts vs after clean completions",),
    knob="restart the engine worker now; report the leak (symptom case C05)",
    params={
        "idle_usage": Param(
            IDLE_KV_LEAK_SHARE,
            "KV share still used with nothing running or waiting (the same share turns "
            "/health degraded)",
        )
    },
    detect=detect,
    healthy_baseline="absolute",
    explains=("oom_low_average_memory",),
    evidence_signals=("idle_kv_usage_max", "running_mean"),
    alert=Alert(
        name="TokenmillKVBlockLeak",
        expr=(
            "(max by ($by) (tokenmill_kv_cache_usage_perc) >= $idle_usage)\n"
            "and (sum by ($by) (tokenmill_num_requests_running)"
            " + sum by ($by) (tokenmill_num_requests_waiting) == 0)"
        ),
        value="KV-cache usage with nothing running or waiting",
        unit="%",
        for_="5m",
    ),
    reads=("steps", "kv"),
)
