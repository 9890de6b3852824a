"""Render a :class:`~tokenmill.diagnose.compare.Comparison` as text (rich), Markdown or JSON;
:func:`headline` is the one-line verdict the console shows too. Numbers carry their units
(``report.format_value``)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .compare import GATED, LABELS, MEDIAN_OF, Check, Comparison, Run, Shift
from .report import format_value

_MARK = {"regressed": "REGRESSED", "improved": "improved", "worse": "worse", "better": "better"}


def _ts(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def pct(v: float | None) -> str:
    """A change relative to BEFORE: ``+245 %``, ``−38 %``, ``×205`` from ten times up; ``n/a``
    when unknown."""
    if v is None:
        return "n/a"
    if v == 0:
        return "0 %"
    sign = "+" if v > 0 else "−"
    if v >= 900:  # ten times or more: a factor reads better than +20,518,449 %
        return f"×{1 + v / 100:,.0f}"
    return f"{sign}{abs(v):,.0f} %" if abs(v) >= 10 else f"{sign}{abs(v):.1f} %"


def fmt(key: str, v) -> str:
    """A figure with its unit (``report.format_value``; station keys read as ms)."""
    return format_value(key, v)


def _shift_text(s: Shift, c: Comparison | None = None) -> str:
    text = f"{s.label} {pct(s.change_pct)} ({fmt(s.key, s.before)} → {fmt(s.key, s.after)})"
    median = MEDIAN_OF.get(s.key)
    if c is not None and median:
        m = next(x for x in c.latency if x.key == median)
        text += f", p50 {pct(m.change_pct)}"
    return text


def _check_text(c: Check) -> str:
    return (
        f"{c.label} {fmt(c.key, c.before)} → {fmt(c.key, c.after)} "
        f"({pct(c.change)}, tolerance {c.tolerance:g} %)"
    )


def gated_text(c: Comparison) -> str:
    ups = [LABELS[k] for k, d in GATED.items() if d == "up"]
    downs = [LABELS[k] for k, d in GATED.items() if d == "down"]
    return (
        f"{', '.join(ups)} up (with its p50) or {', '.join(downs)} down by more than "
        f"{c.threshold_pct:g} %"
    )


def headline(c: Comparison) -> str:
    """The verdict in one line, with the figures behind it."""
    if c.verdict == "not_comparable":
        bad = [_check_text(x) for x in c.checks if not x.ok]
        return (
            "NOT COMPARABLE: " + "; ".join(bad) + ". The shifts below are not evidence "
            "against the engine."
        )
    if c.verdict == "regression":
        return f"REGRESSION ({gated_text(c)}): " + "; ".join(
            _shift_text(s, c) for s in c.regressions
        )
    return f"No regression: nothing gated moved that far ({gated_text(c)})."


def _run_line(name: str, r: Run) -> str:
    t = r.traffic
    return (
        f"{name} {r.label}: {t['requests']:,} requests ({t['completed']:,} completed, "
        f"{t['errors']:,} errors), {_ts(r.start_ns)} – {_ts(r.end_ns)} ({r.duration_s:,.1f} s)"
    )


def _value(v) -> str:
    return "(absent)" if v is None else str(v)


def _config_rows(c: Comparison) -> list[tuple[str, str, str, str]]:
    return [(x.name, x.kind, _value(x.before), _value(x.after)) for x in c.config_diff]


def _traffic_rows(c: Comparison) -> list[tuple[str, ...]]:
    return [
        (
            x.label,
            fmt(x.key, x.before),
            fmt(x.key, x.after),
            pct(x.change),
            f"{x.tolerance:g} %",
            "ok" if x.ok else "differs",
        )
        for x in c.checks
    ]


def _shift_rows(shifts: list[Shift]) -> list[tuple[str, ...]]:
    return [
        (
            s.label + (" (gated)" if s.key in GATED else ""),
            fmt(s.key, s.before),
            fmt(s.key, s.after),
            pct(s.change_pct),
            _MARK.get(s.status, ""),
        )
        for s in shifts
    ]


def _station_rows(c: Comparison) -> list[tuple[str, ...]]:
    rows = []
    for st, qs in c.stations.items():
        p50, p99 = qs["p50"], qs["p99"]
        rows.append(
            (
                st,
                fmt(p50.key, p50.before),
                fmt(p50.key, p50.after),
                pct(p50.change_pct),
                fmt(p99.key, p99.before),
                fmt(p99.key, p99.after),
                pct(p99.change_pct),
            )
        )
    return rows


def _rule_rows(c: Comparison) -> list[tuple[str, ...]]:
    rows = []
    for m in c.rules:
        moved = "; ".join(
            f"{s.key} {fmt(s.key, s.before)} → {fmt(s.key, s.after)} ({pct(s.change_pct)})"
            for s in m.moved
        )
        ev = m.evidence_after or m.evidence_before
        evidence = ", ".join(f"{k} = {format_value(k, v)}" for k, v in list(ev.items())[:4])
        rows.append(
            (
                m.rule_id,
                m.change,
                m.before or "—",
                m.after or "—",
                moved or "—",
                evidence or "—",
                ", ".join(m.example_trace_ids[:3]) or "—",
            )
        )
    return rows


_SHIFT_HEAD = ("", "BEFORE", "AFTER", "change", "")
_TRAFFIC_HEAD = ("", "BEFORE", "AFTER", "change", "tolerance", "")
_STATION_HEAD = (
    "station",
    "p50 BEFORE",
    "p50 AFTER",
    "change",
    "p99 BEFORE",
    "p99 AFTER",
    "change",
)
_RULE_HEAD = ("rule", "change", "BEFORE", "AFTER", "signals moved", "evidence", "example traces")


def to_json(c: Comparison) -> str:
    return json.dumps(c.to_json(), indent=2, default=str)


def _md_table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    def cell(x: str) -> str:
        return str(x).replace("|", "\\|")

    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return [*out, ""]


def to_markdown(c: Comparison) -> str:
    lines = [
        "# tokenmill comparison",
        "",
        f"- {_run_line('BEFORE', c.before)}",
        f"- {_run_line('AFTER', c.after)}",
        "",
        f"**{headline(c)}**",
        "",
        "## Config difference",
        "",
    ]
    rows = _config_rows(c)
    lines += _md_table(("setting", "kind", "BEFORE", "AFTER"), rows) if rows else ["None.", ""]
    lines += ["## Traffic and host (comparable?)", "", *_md_table(_TRAFFIC_HEAD, _traffic_rows(c))]
    lines += ["## Latency", "", *_md_table(_SHIFT_HEAD, _shift_rows(c.latency))]
    lines += ["## Throughput and goodput", "", *_md_table(_SHIFT_HEAD, _shift_rows(c.throughput))]
    lines += ["## Stations (span time)", "", *_md_table(_STATION_HEAD, _station_rows(c))]
    lines += ["## Rules whose findings or signals moved", ""]
    rows = _rule_rows(c)
    lines += _md_table(_RULE_HEAD, rows) if rows else ["None.", ""]
    lines += [
        "## Slowest requests (TTFT)",
        "",
        "- BEFORE: " + (", ".join(f"`{t}`" for t in c.before.slowest) or "none"),
        "- AFTER: " + (", ".join(f"`{t}`" for t in c.after.slowest) or "none"),
        "",
    ]
    if c.notes:
        lines += ["## Notes", "", *[f"- {n}" for n in c.notes], ""]
    return "\n".join(lines)


def _table(title: str, head: tuple[str, ...], rows: list[tuple[str, ...]]) -> Table:
    t = Table(title=title, title_justify="left")
    for h in head:
        t.add_column(h)
    for r in rows:
        t.add_row(*(escape(str(x)) for x in r))
    return t


def print_text(c: Comparison, console: Console) -> None:
    console.print("[bold]tokenmill comparison[/]")
    console.print(escape(_run_line("BEFORE", c.before)), highlight=False)
    console.print(escape(_run_line("AFTER ", c.after)), highlight=False)
    color = {"regression": "red", "not_comparable": "yellow"}.get(c.verdict, "green")
    console.print(f"[bold {color}]{escape(headline(c))}[/]", highlight=False)
    rows = _config_rows(c)
    if rows:
        console.print(_table("config difference", ("setting", "kind", "BEFORE", "AFTER"), rows))
    else:
        console.print("config difference: none")
    console.print(_table("traffic and host (comparable?)", _TRAFFIC_HEAD, _traffic_rows(c)))
    console.print(_table("latency", _SHIFT_HEAD, _shift_rows(c.latency)))
    console.print(_table("throughput and goodput", _SHIFT_HEAD, _shift_rows(c.throughput)))
    console.print(_table("stations (span time)", _STATION_HEAD, _station_rows(c)))
    rows = _rule_rows(c)
    if rows:
        console.print(_table("rules whose findings or signals moved", _RULE_HEAD, rows))
    else:
        console.print("rules whose findings or signals moved: none")
    console.print("slowest BEFORE: " + (", ".join(c.before.slowest) or "none"), highlight=False)
    console.print("slowest AFTER:  " + (", ".join(c.after.slowest) or "none"), highlight=False)
    for n in c.notes:
        console.print(f"[dim]note:[/] {escape(n)}")
