"""What-ifs and SLOs as ``tokenmill plan`` takes them, parsed into values a replay uses.

A what-if is ``knob=value`` pairs joined by commas (``rate=2,max_num_seqs=4``); :class:`Knobs`
declares each knob once, as a field: what it changes, its value's grammar, bounds and unit, the
engine config field it sets (:data:`KNOBS` and :data:`CONFIG_FIELDS` are read from it, and so are
``--what-if``'s help and the console's What if page). An SLO is ``metric<bound`` pairs
joined by commas (``ttft_p99<2s,itl_p99<200ms``), over the metrics :data:`SLO_METRICS` names;
its TTFT, ITL and E2E bounds are also what makes a request good for goodput (the p99 or p50
bound of each, per request), the console's defaults where it names none. Anything else is a
``ValueError`` with a one-line reason naming the part.
"""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass, field, fields

from tokenmill.engine.durations import parse_duration
from tokenmill.engine.settings import setting
from tokenmill.telemetry.goodput import DEFAULT_GOODPUT, GoodputSlo

#: the step-time factors a replay takes: a host 100x slower or faster is another machine, and
#: far past that the replay's clock overflows
STEP_TIME_RANGE = (0.01, 100.0)


def whatif_knob(help: str, grammar: str, **meta) -> typing.Any:
    """A what-if knob (a :class:`Knobs` field, None: as recorded): what it changes (``help``),
    its value's grammar as error messages name it, and its shape in ``meta``: ``min``/``max``
    (inclusive; a factor's ``min`` of 0 is exclusive), ``unit`` (``x``: a factor, written
    ``2``, ``2x`` or ``1.5×``), ``choices``, ``config_field`` (the engine config field it
    sets), ``recorded`` (its value as recorded, where no config field holds it), ``refused``
    (why a replay cannot model it), ``console`` (the What if page's widget: label, bounds)."""
    return setting(None, help, grammar=grammar, **meta)


@dataclass(frozen=True)
class Knobs:
    """The what-if knobs, one field each: :func:`parse_whatif` parses ``knob=value`` by the
    field's type (a float is a factor, an int a count, a bool on/off, a str one of its
    ``choices``) and metadata; ``tokenmill plan --what-if``'s help and the console's What if
    page read them too."""

    rate: float | None = whatif_knob(
        "the recorded arrivals' rate, times this factor",
        "a factor > 0, e.g. 2, 2x or 1.5",
        unit="x",
        recorded=1.0,
    )
    requests: int | None = whatif_knob(
        "the recording tiled back to back to this many requests", "an integer >= 1", min=1
    )
    replicas: int | None = whatif_knob(
        "data-parallel replicas on the recorded host (they share its cores)",
        "an integer >= 1",
        min=1,
    )
    hosts: int | None = whatif_knob(
        "hosts like the recorded one, each with its replicas, behind one router",
        "an integer >= 1",
        min=1,
        recorded=1,
        console={"label": "hosts like this one", "min": 1, "max": 64},
    )
    max_num_seqs: int | None = whatif_knob(
        "requests running at once",
        "an integer >= 1",
        min=1,
        config_field="max_num_seqs",
        console={"label": "max_num_seqs", "min": 1, "max": 4096},
    )
    max_num_batched_tokens: int | None = whatif_knob(
        "one step's token budget",
        "an integer >= 1",
        min=1,
        config_field="max_num_batched_tokens",
        console={"label": "max_num_batched_tokens", "min": 16, "max": 1 << 20},
    )
    kv_blocks: int | None = whatif_knob(
        "KV blocks in each replica's pool", "an integer >= 1", min=1
    )
    chunked_prefill: bool | None = whatif_knob(
        "chunked prefill",
        "on | off",
        config_field="enable_chunked_prefill",
        console={"label": "chunked prefill"},
    )
    prefix_caching: bool | None = whatif_knob(
        "the prefix cache", "on | off", config_field="enable_prefix_caching"
    )
    long_prefill_token_threshold: int | None = whatif_knob(
        "one request's prefill chunk cap (0: none)",
        "integer >= 0",
        min=0,
        config_field="long_prefill_token_threshold",
    )
    admission_policy: str | None = whatif_knob(
        "admission past a request that does not fit",
        "strict | skip_ahead",
        choices=("strict", "skip_ahead"),
        config_field="admission_policy",
    )
    quantization: str | None = whatif_knob(
        "weight precision",
        "none | int8 | int4 (needs --cost-from)",
        choices=("none", "int8", "int4"),
    )
    step_time: float | None = whatif_knob(
        "every engine step's time, times this factor (a host whose steps run slower or faster "
        "than the recorded one's)",
        f"a factor from {STEP_TIME_RANGE[0]:g} to {STEP_TIME_RANGE[1]:g}, e.g. 1.2",
        unit="x",
        min=STEP_TIME_RANGE[0],
        max=STEP_TIME_RANGE[1],
        recorded=1.0,
        console={"label": "step time ×", "min": 0.1, "max": 10.0, "step": 0.05},
    )
    disaggregation: str | None = whatif_knob(
        "prefill/decode split",
        "not replayed",
        refused="prefill/decode disaggregation is not replayed (its KV hand-off and two pools "
        "are not modelled); plan replicas instead",
    )


def knob_fields() -> dict:
    """``{knob: dataclasses.Field}`` of :class:`Knobs`, in declaration order."""
    return {f.name: f for f in fields(Knobs)}


def knob_type(name: str) -> type:
    """The value type of knob ``name`` (``float``, ``int``, ``bool`` or ``str``)."""
    hint = _HINTS[name]
    return next(t for t in typing.get_args(hint) if t is not type(None))


_HINTS = typing.get_type_hints(Knobs)
#: knob → (what it changes, the value's grammar)
KNOBS: dict[str, tuple[str, str]] = {
    n: (f.metadata["help"], f.metadata["grammar"]) for n, f in knob_fields().items()
}
#: what-if knob → the engine config field it sets
CONFIG_FIELDS = {
    n: f.metadata["config_field"]
    for n, f in knob_fields().items()
    if f.metadata.get("config_field")
}


def whatif_help() -> str:
    """``--what-if``'s help: the knobs a replay takes, factors marked ``(x)``."""
    names = [
        n + (" (x)" if f.metadata.get("unit") == "x" else "")
        for n, f in knob_fields().items()
        if not f.metadata.get("refused")
    ]
    return f"knob=value[,knob=value...], repeatable: {', '.join(names)}."


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


def _bad(knob: str, value: str) -> ValueError:
    return ValueError(f"what-if {knob}={value}: {KNOBS[knob][1]}")


def _int(knob: str, value: str, minimum: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise _bad(knob, value) from None
    if n < minimum:
        raise _bad(knob, value)
    return n


def _factor(knob: str, value: str, lo: float, hi: float) -> float:
    try:  # a factor, written as operators write it too: 2, 2x, 1.5×
        v = float(value.removesuffix("x").removesuffix("X").removesuffix("×"))
    except ValueError:
        v = float("nan")
    if not (v > 0 and v != float("inf") and lo <= v <= hi):
        raise _bad(knob, value)
    return v


def _switch(knob: str, value: str) -> bool:
    v = value.lower()
    if v in ("on", "true", "1", "yes"):
        return True
    if v in ("off", "false", "0", "no"):
        return False
    raise _bad(knob, value)


def parse_knob(knob: str, value: str, part: str | None = None):
    """One knob's value as its :class:`Knobs` field declares it (``part``: the ``knob=value``
    as typed, for a choice's error).

    Raises:
        ValueError: a value out of the knob's grammar, or a knob a replay cannot model.
    """
    meta = knob_fields()[knob].metadata
    if meta.get("refused"):
        raise ValueError(f"what-if {knob}: {meta['refused']}")
    kind = knob_type(knob)
    if kind is float:
        lo, hi = meta.get("min") or 0.0, meta.get("max") or float("inf")
        return _factor(knob, value, lo, hi)
    if kind is bool:
        return _switch(knob, value)
    if kind is str:
        if value not in meta["choices"]:
            raise ValueError(f"what-if {part or f'{knob}={value}'}: {KNOBS[knob][1]}")
        return value
    return _int(knob, value, meta["min"])


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
        changes[knob] = parse_knob(knob, value, part)
    return WhatIf(text.strip(), changes)


@dataclass(frozen=True)
class SloBounds:
    """Upper bounds (ms) on summary metrics, and the per-request bounds goodput counts with
    (the p99, else the p50, bound of each latency the text names; the console's otherwise)."""

    text: str
    bounds: dict  # summary key → ms
    goodput: GoodputSlo = DEFAULT_GOODPUT

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


def parse_slo(text: str | None) -> SloBounds:
    """``metric<bound[,metric<bound...]`` → :class:`SloBounds` (None or ``""``: no bounds, the
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
        if SLO_METRICS[metric] in bounds:
            raise ValueError(f"SLO {part.strip()!r}: {metric} is bounded twice")
        bounds[SLO_METRICS[metric]] = ms
    per_request = {}
    for m in ("ttft", "itl", "e2e"):
        own = [bounds.get(f"{m}_{q}_ms") for q in ("p99", "p50")]
        own = [b for b in own if b is not None]
        if own:
            per_request[f"{m}_ms"] = own[0]
    return SloBounds((text or "").strip(), bounds, GoodputSlo(**per_request))
