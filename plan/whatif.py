"""What-ifs and SLOs as ``tokenmill plan`` takes them, parsed into values a replay uses.

A what-if is ``knob=value`` pairs joined by commas (``rate=2,max_num_seqs=4``); :data:`KNOBS`
names each knob, what it changes and its value's grammar. An SLO is ``metric<bound`` pairs
joined by commas (``ttft_p99<2s,itl_p99<200ms``), over the metrics :data:`SLO_METRICS` names;
its TTFT, ITL and E2E bounds are also what makes a request good for goodput (the p99 or p50
bound of each, per request), the console's defaults where it names none. Anything else is a
``ValueError`` with a one-line reason naming the part.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tokenmill.engine.durations import parse_duration

#: the step-time factors a replay takes: a host 100x slower or faster is another machine, and
#: far past that the replay's clock overflows
STEP_TIME_RANGE = (0.01, 100.0)
#: knob → (what it changes, the value's grammar)
KNOBS: dict[str, tuple[str, str]] = {
    "rate": ("the recorded arrivals' rate, times this factor", "a factor > 0, e.g. 2, 2x or 1.5"),
    "requests": ("the recording tiled back to back to this many requests", "an integer >= 1"),
    "replicas": (
        "data-parallel replicas on the recorded host (they share its cores)",
        "an integer >= 1",
    ),
    "hosts": (
        "hosts like the recorded one, each with its replicas, behind one router",
        "an integer >= 1",
    ),
    "max_num_seqs": ("requests running at once", "an integer >= 1"),
    "max_num_batched_tokens": ("one step's token budget", "an integer >= 1"),
    "kv_blocks": ("KV blocks in each replica's pool", "an integer >= 1"),
    "chunked_prefill": ("chunked prefill", "on | off"),
    "prefix_caching": ("the prefix cache", "on | off"),
    "long_prefill_token_threshold": ("one request's prefill chunk cap (0: none)", "integer >= 0"),
    "admission_policy": ("admission past a request that does not fit", "strict | skip_ahead"),
    "quantization": ("weight precision", "none | int8 | int4 (needs --cost-from)"),
    "step_time": (
        "every engine step's time, times this factor (a host whose steps run slower or faster "
        "than the recorded one's)",
        f"a factor from {STEP_TIME_RANGE[0]:g} to {STEP_TIME_RANGE[1]:g}, e.g. 1.2",
    ),
    "disaggregation": ("prefill/decode split", "not replayed"),
}
#: what-if knob → the engine config field it sets
CONFIG_FIELDS = {
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "chunked_prefill": "enable_chunked_prefill",
    "prefix_caching": "enable_prefix_caching",
    "long_prefill_token_threshold": "long_prefill_token_threshold",
    "admission_policy": "admission_policy",
}
#: SLO metric → the summary key it bounds
SLO_METRICS = {
    f"{m}_{q}": f"{m}_{q}_ms" for m in ("ttft", "itl", "tpot", "e2e") for q in ("p50", "p99")
}


@dataclass(frozen=True)
class WhatIf:
    """One what-if: its text and each knob's parsed value."""

    text: str
    changes: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.text or "as recorded"


def _int(knob: str, value: str, minimum: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"what-if {knob}={value}: {KNOBS[knob][1]}") from None
    if n < minimum:
        raise ValueError(f"what-if {knob}={value}: {KNOBS[knob][1]}")
    return n


def _switch(knob: str, value: str) -> bool:
    v = value.lower()
    if v in ("on", "true", "1", "yes"):
        return True
    if v in ("off", "false", "0", "no"):
        return False
    raise ValueError(f"what-if {knob}={value}: {KNOBS[knob][1]}")


def parse_whatif(text: str) -> WhatIf:
    """``knob=value[,knob=value...]`` → :class:`WhatIf` (``""``: as recorded).

    Raises:
        ValueError: an unknown knob (with the known ones), a value out of its grammar, a knob
            given twice, or a knob this replay cannot model.
    """
    changes: dict = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        knob, eq, value = part.partition("=")
        knob, value = knob.strip().replace("-", "_"), value.strip()
        if not eq or not value:
            raise ValueError(f"what-if {part!r}: expected knob=value")
        if knob not in KNOBS:
            raise ValueError(f"what-if {part!r}: unknown knob {knob!r} (known: {', '.join(KNOBS)})")
        if knob in changes:
            raise ValueError(f"what-if {knob} is given twice")
        if knob in ("rate", "step_time"):
            try:  # a factor, written as operators write it too: 2, 2x, 1.5×
                v = float(value.removesuffix("x").removesuffix("X").removesuffix("×"))
            except ValueError:
                v = float("nan")
            lo, hi = STEP_TIME_RANGE if knob == "step_time" else (0.0, float("inf"))
            if not (v > 0 and v != float("inf") and lo <= v <= hi):
                raise ValueError(f"what-if {knob}={value}: {KNOBS[knob][1]}")
            changes[knob] = v
        elif knob in ("chunked_prefill", "prefix_caching"):
            changes[knob] = _switch(knob, value)
        elif knob == "admission_policy":
            if value not in ("strict", "skip_ahead"):
                raise ValueError(f"what-if {part}: {KNOBS[knob][1]}")
            changes[knob] = value
        elif knob == "quantization":
            if value not in ("none", "int8", "int4"):
                raise ValueError(f"what-if {part}: {KNOBS[knob][1]}")
            changes[knob] = value
        elif knob == "disaggregation":
            raise ValueError(
                "what-if disaggregation: prefill/decode disaggregation is not replayed (its KV "
                "hand-off and two pools are not modelled); plan replicas instead"
            )
        else:
            minimum = 0 if knob == "long_prefill_token_threshold" else 1
            changes[knob] = _int(knob, value, minimum)
    return WhatIf(text.strip(), changes)


@dataclass(frozen=True)
class Slo:
    """Upper bounds (ms) on summary metrics, and the per-request bounds goodput counts with."""

    text: str
    bounds: dict  # summary key → ms
    ttft_ms: float = 2000.0
    itl_ms: float = 200.0
    e2e_ms: float = 60000.0

    def misses(self, summary: dict) -> dict:
        """``{metric: (value, bound)}`` for each bound the summary does not meet."""
        out = {}
        for key, bound in self.bounds.items():
            v = summary.get(key)
            if v is None or not v < bound:
                out[key] = (v, bound)
        return out

    def margin(self, summary: dict) -> float | None:
        """The smallest ``1 - value/bound`` over the bounds (how far inside the SLO; negative
        outside), None without bounds or values."""
        ms = [1.0 - summary[k] / b for k, b in self.bounds.items() if summary.get(k) is not None]
        return min(ms) if ms and len(ms) == len(self.bounds) else None


_SLO_RE = re.compile(r"^\s*([a-z0-9_]+)\s*(<=|<)\s*(\S+)\s*$")


def parse_slo(text: str | None) -> Slo:
    """``metric<bound[,metric<bound...]`` → :class:`Slo` (None or ``""``: no bounds, the
    console's goodput defaults).

    Raises:
        ValueError: a part that does not parse, an unknown metric, or a bound that is not a
            duration above 0.
    """
    bounds: dict[str, float] = {}
    for part in (p for p in (text or "").split(",") if p.strip()):
        m = _SLO_RE.match(part)
        if not m:
            raise ValueError(f"SLO {part.strip()!r}: expected metric<duration, e.g. ttft_p99<2s")
        metric, _, bound = m.groups()
        if metric not in SLO_METRICS:
            raise ValueError(
                f"SLO {part.strip()!r}: unknown metric {metric!r} (known: {', '.join(SLO_METRICS)})"
            )
        try:
            ms = parse_duration(bound) * 1e3
        except ValueError as exc:
            raise ValueError(f"SLO {part.strip()!r}: {exc}") from None
        bounds[SLO_METRICS[metric]] = ms
    per_request = {}
    for m in ("ttft", "itl", "e2e"):
        own = [bounds.get(f"{m}_{q}_ms") for q in ("p99", "p50")]
        own = [b for b in own if b is not None]
        if own:
            per_request[f"{m}_ms"] = own[0]
    return Slo((text or "").strip(), bounds, **per_request)
