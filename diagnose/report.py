"""Render a :class:`Report` as text (rich), Markdown or JSON."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from .findings import Report
from .signals import ran_from_requests

# arrivals and endings are counted over the same range but different requests (a request
# that arrived before the range can end in it), so each label says which it counts
_HEALTHY_KEYS = (
    ("requests", "requests arrived", "{:.0f}"),
    ("completed_of_arrived", "arrived and completed", "{:.0f}"),
    ("completed", "completed in range (by end time)", "{:.0f}"),
    ("errors", "errors in range (by end time)", "{:.0f}"),
    ("ttft_p50_ms", "TTFT p50", "{:.0f} ms"),
    ("ttft_p99_ms", "TTFT p99", "{:.0f} ms"),
    ("itl_p50_ms", "ITL p50", "{:.1f} ms"),
    ("itl_p99_ms", "ITL p99", "{:.1f} ms"),
    ("tpot_p50_ms", "TPOT p50", "{:.1f} ms"),
    ("e2e_p99_ms", "E2E p99", "{:.0f} ms"),
    ("prefix_hit_rate", "prefix-cache hit rate", "{:.0%}"),
    ("kv_usage_max", "KV use peak", "{:.0%}"),
    ("preemptions", "preemptions", "{:.0f}"),
)
# shown only where a source has them (speculative decoding on)
_OPTIONAL_KEYS = (
    ("spec_acceptance_rate", "draft tokens accepted (speculative decoding)", "{:.0%}"),
    ("spec_accepted_per_draft", "accepted tokens per draft", "{:.2f}"),
)


#: what a store without steps compares for ``host_contention`` (``signals/same_work.py``)
SAME_WORK_FROM_REQUESTS = (
    "The same-work comparison (host_contention) reads the requests' time per output token "
    "at the same number of streams, not engine steps."
)


def scraped_families(sources: dict[str, str]) -> list[str]:
    """The signal families that ran from the engine's scraped metrics (``*_from_samples``)."""
    return sorted(f for f, alt in sources.items() if alt.endswith("_from_samples"))


def _keys(summaries: list[dict]) -> tuple:
    """The key-number rows for these summaries: every healthy key, and the optional ones that
    at least one summary has."""
    extra = tuple(k for k in _OPTIONAL_KEYS if any(s.get(k[0]) is not None for s in summaries))
    return _HEALTHY_KEYS + extra


def _ts(ns: int | None) -> str:
    if ns is None:
        return "?"
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _fmt(fmt: str, v) -> str:
    if v is None:
        return "n/a"
    try:
        return fmt.format(v)
    except (ValueError, TypeError):
        return str(v)


def _fleet(report: Report) -> bool:
    """Two or more sources: name each finding's source (one dump reads as it always did)."""
    return len(report.sources) > 1


def _where(report: Report, f) -> str:
    """``" on SOURCE"`` (or ``" on SOURCE, fleet-wide"``) for a fleet's finding, else ``""``."""
    if not _fleet(report) or f.source is None:
        return ""
    wide = (
        f", fleet-wide: all {len(report.sources)} sources" if f.rule_id in report.fleet_wide else ""
    )
    return f" on {f.source}{wide}"


def _fleet_lines(report: Report) -> list[str]:
    """One line per source: its status and the rules that fired on it."""
    return [
        f"{s['name']} ({s['dump']}): "
        + (", ".join(s["rules_fired"]) if s["rules_fired"] else "no problems found")
        for s in report.sources
    ]


def to_json(report: Report) -> str:
    """The report as strict JSON (RFC 8259): a NaN or ±Inf anywhere is written as null (msgspec
    does), never as Python's invalid ``NaN``/``Infinity``; a value JSON has no type for is
    written as its string."""
    return msgspec.json.format(
        msgspec.json.encode(report.to_json(), enc_hook=str), indent=2
    ).decode()


def baseline_lines(report: Report) -> list[str]:
    """What the windows were compared with: no healthy baseline (why, and the rules not
    judged), the signal families read from scraped metrics, the warm-up requests set apart;
    empty when none applies."""
    lines = []
    base = report.healthy_baseline or {}
    if base.get("available") is False:
        skipped = ", ".join(base.get("not_judged") or []) or "none"
        lines.append(
            f"No healthy baseline in this dump: {base.get('reason')}. Rules that compare with "
            f"the healthiest windows were not judged ({skipped}); findings stand on absolute "
            "evidence."
        )
    if scraped := scraped_families(report.signal_sources):
        lines.append(
            "No per-step records in this store: the engine's queue and KV-cache signals come "
            "from its scraped /metrics (engine_samples), one reading per scrape, for "
            + ", ".join(scraped)
            + "."
        )
    if ran_from_requests(report.signal_sources):
        lines.append(SAME_WORK_FROM_REQUESTS)
    warm = report.warmup or {}
    if warm.get("requests"):
        lines.append(
            f"Warm-up set apart: {warm['requests']} requests that arrived after a server start "
            "or engine restart before the first one completed (left out of the windows, kept "
            "in the key numbers)."
        )
    return lines


def _nothing_found(report: Report) -> str:
    if report.not_assessed:
        return (
            f"No problems found among the rules this store lets us assess; "
            f"{len(report.not_assessed)} not assessed (listed below)."
        )
    if (report.healthy_baseline or {}).get("available") is False:
        return "No problems found among the rules that could be judged."
    return "No problems found."


def _chain(rule_ids: list[str]) -> str:
    """Findings linked to one through the rules' declared causes (``Rule.explains``)."""
    return ", ".join(rule_ids)


def to_markdown(report: Report) -> str:
    lines = [
        "# tokenmill diagnosis",
        "",
        f"Range {_ts(report.start_ns)} – {_ts(report.end_ns)}, windows of {report.window_s:g} s.",
        "",
    ]
    if _fleet(report):
        lines += [f"Fleet of {len(report.sources)} sources (each diagnosed on its own):", ""]
        lines += [f"- {line}" for line in _fleet_lines(report)] + [""]
    lines += [line for b in baseline_lines(report) for line in (b, "")]
    if not report.findings:
        lines += [f"**{_nothing_found(report)}**", ""]
    for i, f in enumerate(report.findings, 1):
        lines += [
            f"## {i}. `{f.rule_id}`{_where(report, f)} — {f.title} "
            f"({f.severity}, confidence {f.confidence:.0%})",
            "",
            f.summary,
            "",
            f"- Window: {_ts(f.window_start_ns)} – {_ts(f.window_end_ns)}",
            "- Evidence: " + format_evidence(f.evidence, code=True),
            *([f"- Leads to: {_chain(f.leads_to)}"] if f.leads_to else []),
            *([f"- Explained by: {_chain(f.explained_by)}"] if f.explained_by else []),
            *([f"- Test: {f.support['line']}"] if f.support else []),
            "- Example traces: " + (", ".join(f"`{t}`" for t in f.example_trace_ids) or "none"),
            "- Likely causes: " + "; ".join(f.causes),
            "- Checks: " + "; ".join(f.checks),
            f"- Knob: {f.knob}",
            f"- Runbook: [{f.runbook}]({f.runbook})",
            "",
        ]
    if report.inconclusive:
        lines += ["## Inconclusive (not findings: too little evidence)", ""]
    for f in report.inconclusive:
        lines += [f"- `{f.rule_id}`: {f.summary} ({f.support['reason']}; {f.support['line']})", ""]
    if report.not_assessed:
        lines += ["## Not assessed (this store lacks what they read)", ""]
    for rid, why in sorted(report.not_assessed.items()):
        lines += [f"- `{rid}`: {why}"]
    if report.not_assessed:
        lines += [""]
    if report.notes:
        lines += ["## Hints", ""]
    for n in report.notes:
        lines += [
            f"- **`{n.rule_id}`{_where(report, n)}:** {n.summary}",
            "  Evidence: " + format_evidence(n.evidence, code=True) + ".",
            f"  Knob: {n.knob}. Runbook: [{n.runbook}]({n.runbook})",
            "",
        ]
    lines += ["## Key numbers", ""]
    if _fleet(report):
        names = [s["name"] for s in report.sources]
        lines += ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for key, label, fmt in _keys([s["summary"] for s in report.sources]):
            row = [_fmt(fmt, s["summary"].get(key)) for s in report.sources]
            lines.append(f"| {label} | " + " | ".join(row) + " |")
        return "\n".join(lines) + "\n"
    for key, label, fmt in _keys([report.summary]):
        lines.append(f"- {label}: {_fmt(fmt, report.summary.get(key))}")
    return "\n".join(lines) + "\n"


def print_text(report: Report, console: Console) -> None:
    console.print(
        f"[bold]tokenmill diagnosis[/] {_ts(report.start_ns)} – {_ts(report.end_ns)} "
        f"(windows of {report.window_s:g} s)"
    )
    if _fleet(report):
        console.print(f"fleet of {len(report.sources)} sources (each diagnosed on its own):")
        for line in _fleet_lines(report):
            console.print("  " + escape(line), highlight=False)
    for line in baseline_lines(report):
        console.print("[yellow]" + escape(line) + "[/]")
    if not report.findings:
        console.print(f"[bold green]{_nothing_found(report)}[/]")
    for i, f in enumerate(report.findings, 1):
        color = "red" if f.severity == "critical" else "yellow"
        body = [
            escape(f.summary),
            "",
            f"[dim]window[/] {_ts(f.window_start_ns)} – {_ts(f.window_end_ns)}",
            "[dim]evidence[/] " + escape(format_evidence(f.evidence)),
            *(["[dim]leads to[/] " + escape(_chain(f.leads_to))] if f.leads_to else []),
            *(["[dim]explained by[/] " + escape(_chain(f.explained_by))] if f.explained_by else []),
            *(["[dim]test[/] " + escape(f.support["line"])] if f.support else []),
            "[dim]examples[/] " + escape(", ".join(f.example_trace_ids) or "none"),
            "[dim]causes[/] " + escape("; ".join(f"{n}. {c}" for n, c in enumerate(f.causes, 1))),
            "[dim]checks[/] " + escape("; ".join(f.checks)),
            "[dim]knob[/] " + escape(f.knob),
            "[dim]runbook[/] " + escape(f.runbook),
        ]
        console.print(
            Panel(
                "\n".join(body),
                title=f"{i}. [bold]{f.rule_id}[/]{escape(_where(report, f))} — {escape(f.title)}",
                subtitle=f"{f.severity}, confidence {f.confidence:.0%}",
                border_style=color,
            )
        )
    for f in report.inconclusive:
        console.print(
            f"[dim]inconclusive[/] [bold]{f.rule_id}[/]: "
            + escape(f"{f.summary} ({f.support['reason']}; {f.support['line']})"),
            highlight=False,
        )
    if report.not_assessed:
        console.print(
            f"[dim]not assessed ({len(report.not_assessed)} rules: this store lacks what "
            "they read)[/]",
            highlight=False,
        )
    for rid, why in sorted(report.not_assessed.items()):
        console.print(f"  [dim]{rid}[/]: " + escape(why), highlight=False)
    for n in report.notes:
        console.print(
            Panel(
                "\n".join(
                    [
                        escape(n.summary),
                        "",
                        "[dim]evidence[/] " + escape(format_evidence(n.evidence)),
                        "[dim]knob[/] " + escape(n.knob),
                        "[dim]runbook[/] " + escape(n.runbook),
                    ]
                ),
                title=f"hint: [bold]{n.rule_id}[/]{escape(_where(report, n))}",
                subtitle="a knob that would help, not a problem",
                border_style="cyan",
            )
        )
    if _fleet(report):
        table = Table(title="key numbers")
        table.add_column("")
        for s in report.sources:
            table.add_column(escape(s["name"]))
        for key, label, fmt in _keys([s["summary"] for s in report.sources]):
            table.add_row(label, *(_fmt(fmt, s["summary"].get(key)) for s in report.sources))
    else:
        table = Table(title="key numbers", show_header=False)
        for key, label, fmt in _keys([report.summary]):
            table.add_row(label, _fmt(fmt, report.summary.get(key)))
    console.print(table)
    for rule_id, msg in report.rule_errors.items():
        console.print(f"[red]rule {rule_id} failed:[/] {escape(msg)}")


# ----- evidence values with their units (the reports and the console's Diagnosis page) -----

_RATIO_ENDINGS = (
    "rise", "slowdown", "ratio", "growth", "trend", "excess", "spike", "degrade", "margin",
    "stream_vs_engine_tpot", "_cost", "_gain",
)  # fmt: skip
_UNIT_ENDINGS = (
    ("_gbps", "GB/s"),
    ("_gflops", "GFLOP/s"),
    ("_mhz", "MHz"),
    ("_util", "%"),
    ("_w", "W"),
    ("_c", "°C"),
    ("flop_per_byte", "FLOP/byte"),
)
_IEC = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def _number(v: float) -> str:
    """About three significant digits, thousands separated: 0.0123, 1.23, 12.3, 1,234."""
    a = abs(v)
    if a == 0 or a >= 100:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:,.1f}"
    if a >= 1:
        return f"{v:,.2f}"
    return f"{v:.3g}"


def _ms(v: float) -> str:
    return f"{_number(v)} ms"


def _bytes(v: float) -> str:
    for unit, size in _IEC:
        if abs(v) >= size:
            return f"{v / size:,.2f} {unit}" if abs(v) < 100 * size else f"{v / size:,.0f} {unit}"
    return f"{v:,.0f} B"


def format_value(key: str, value) -> str:
    """One evidence number with its unit and a sensible precision, the unit read from the key:
    ``*_ms`` (also ``step_ms_p50``, ``spike_ms_max``) → ``5,398 ms``; ``*_s`` → seconds;
    ``*_bytes`` (also the ``*_bytes_by_dtype`` dicts) → KiB/MiB/GiB; ``*_pct`` (already 0..100)
    → ``64.6 %``; shares 0..1 (``*share*``, ``*usage*``, ``hit_rate``, ``error_rate``,
    ``acceptance_rate``) → ``42.3 %``; ``*_per_s``, ``*_tok_s``, ``*_gbps``, ``*_gflops``,
    ``*_mhz``, ``*_util`` (0..100), ``*_w``, ``*_c`` with those units (read before a
    ``_p50``/``_mean``/``_max`` suffix); ratios to a baseline or between two costs (``*rise``,
    ``*slowdown``, ``*ratio``, ``*_cost``, ``*_gain``, …)
    → ``3.21×``; other integers as counts (``1,234``), other floats to about three significant
    digits. A value that is no number (a dtype, a list, a dict) is shown as it is, a dict's
    numbers each with the key's unit; None is ``n/a``."""
    if value is None:
        return "n/a"
    k = key.lower()
    if isinstance(value, dict):
        return "{" + ", ".join(f"{n}: {format_value(k, v)}" for n, v in value.items()) + "}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float) and value != value:  # NaN
        return "n/a"
    # the unit is the name's before a statistic's suffix: decode_gbps_p50 is in GB/s
    k = re.sub(r"(_(p\d+|mean|max|min|at_peak|first|last))+$", "", k) or k
    if k.endswith("_ms") or "_ms_" in k:
        return _ms(value)
    if k.endswith("_s") and not k.endswith(("_per_s", "_tok_s")):
        return f"{_number(value)} s"
    if "bytes" in k and "share" not in k:
        return _bytes(value)
    if k.endswith("_pct"):
        return f"{value:.1f} %"
    if k.endswith(("_per_s", "_tok_s", "arrival_rate", "completion_rate")):
        unit = "tok/s" if k.endswith("_tok_s") else "/s"
        return f"{_number(value)} {unit}"
    if any(s in k for s in ("share", "hit_rate", "error_rate", "acceptance_rate", "usage")):
        return f"{100 * value:.1f} %"
    for ending, unit in _UNIT_ENDINGS:
        if k.endswith(ending):
            return f"{_number(value)} {unit}"
    if k.endswith(_RATIO_ENDINGS):
        return f"{value:.2f}×"
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    return _number(value)


def format_evidence(evidence: dict, *, code: bool = False) -> str:
    """``key = value unit, …`` for a finding's or note's evidence (:func:`format_value` per
    value); ``code`` puts each key in Markdown backticks."""
    return ", ".join(
        f"{f'`{k}`' if code else k} = {format_value(k, v)}" for k, v in evidence.items()
    )
