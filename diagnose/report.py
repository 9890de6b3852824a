"""Render a :class:`Report` as text (rich), Markdown or JSON."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from .findings import Report

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


def to_json(report: Report) -> str:
    return json.dumps(report.to_json(), indent=2, default=str)


def to_markdown(report: Report) -> str:
    lines = [
        "# tokenmill diagnosis",
        "",
        f"Range {_ts(report.start_ns)} – {_ts(report.end_ns)}, windows of {report.window_s:g} s.",
        "",
    ]
    if not report.findings:
        lines += ["**No problems found.**", ""]
    for i, f in enumerate(report.findings, 1):
        lines += [
            f"## {i}. `{f.rule_id}` — {f.title} ({f.severity}, confidence {f.confidence:.0%})",
            "",
            f.summary,
            "",
            f"- Window: {_ts(f.window_start_ns)} – {_ts(f.window_end_ns)}",
            "- Evidence: " + ", ".join(f"`{k}`={v}" for k, v in f.evidence.items()),
            "- Example traces: " + (", ".join(f"`{t}`" for t in f.example_trace_ids) or "none"),
            "- Likely causes: " + "; ".join(f.causes),
            "- Checks: " + "; ".join(f.checks),
            f"- Knob: {f.knob}",
            f"- Runbook: [{f.runbook}]({f.runbook})",
            "",
        ]
    if report.notes:
        lines += ["## Hints", ""]
    for n in report.notes:
        lines += [
            f"- **`{n.rule_id}`:** {n.summary}",
            "  Evidence: " + ", ".join(f"`{k}`={v}" for k, v in n.evidence.items()) + ".",
            f"  Knob: {n.knob}. Runbook: [{n.runbook}]({n.runbook})",
            "",
        ]
    lines += ["## Key numbers", ""]
    for key, label, fmt in _HEALTHY_KEYS:
        lines.append(f"- {label}: {_fmt(fmt, report.summary.get(key))}")
    return "\n".join(lines) + "\n"


def print_text(report: Report, console: Console) -> None:
    console.print(
        f"[bold]tokenmill diagnosis[/] {_ts(report.start_ns)} – {_ts(report.end_ns)} "
        f"(windows of {report.window_s:g} s)"
    )
    if not report.findings:
        console.print("[bold green]No problems found.[/]")
    for i, f in enumerate(report.findings, 1):
        color = "red" if f.severity == "critical" else "yellow"
        body = [
            escape(f.summary),
            "",
            f"[dim]window[/] {_ts(f.window_start_ns)} – {_ts(f.window_end_ns)}",
            "[dim]evidence[/] " + escape(", ".join(f"{k}={v}" for k, v in f.evidence.items())),
            "[dim]examples[/] " + escape(", ".join(f.example_trace_ids) or "none"),
            "[dim]causes[/] " + escape("; ".join(f"{n}. {c}" for n, c in enumerate(f.causes, 1))),
            "[dim]checks[/] " + escape("; ".join(f.checks)),
            "[dim]knob[/] " + escape(f.knob),
            "[dim]runbook[/] " + escape(f.runbook),
        ]
        console.print(
            Panel(
                "\n".join(body),
                title=f"{i}. [bold]{f.rule_id}[/] — {escape(f.title)}",
                subtitle=f"{f.severity}, confidence {f.confidence:.0%}",
                border_style=color,
            )
        )
    for n in report.notes:
        console.print(
            Panel(
                "\n".join(
                    [
                        escape(n.summary),
                        "",
                        "[dim]evidence[/] "
                        + escape(", ".join(f"{k}={v}" for k, v in n.evidence.items())),
                        "[dim]knob[/] " + escape(n.knob),
                        "[dim]runbook[/] " + escape(n.runbook),
                    ]
                ),
                title=f"hint: [bold]{n.rule_id}[/]",
                subtitle="a knob that would help, not a problem",
                border_style="cyan",
            )
        )
    table = Table(title="key numbers", show_header=False)
    for key, label, fmt in _HEALTHY_KEYS:
        table.add_row(label, _fmt(fmt, report.summary.get(key)))
    console.print(table)
    for rule_id, msg in report.rule_errors.items():
        console.print(f"[red]rule {rule_id} failed:[/] {escape(msg)}")
