"""Fleets: several dumps (one per replica or host) diagnosed together.

Each dump is one *source*. The rules compare a source to its own healthy windows, so every
source is diagnosed on its own (:func:`tokenmill.diagnose.findings.diagnose`) and the reports
are merged by :func:`merge`: every finding and hint carries its source's name, a rule that
fires on every source of a fleet of two or more is listed as fleet-wide (``fleet_wide``), one
that fires on some sources only is those sources' problem.

:func:`collect_dumps` expands the command line (dump files, Parquet dump folders, folders of
dumps) and :func:`source_names` names each source.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tokenmill.telemetry.parquet_dump import is_parquet_dump, not_a_parquet_dump
from tokenmill.telemetry.retention import is_archive

from .findings import SEVERITY_RANK, Report

#: the summary counts that add up over sources (percentiles do not: they stay per source)
SUMMED_KEYS = ("requests", "completed", "errors", "completed_of_arrived", "ended",
               "preemptions", "steps", "output_tokens")  # fmt: skip
_SERVER_RE = re.compile(r"^server (\S+)")


class FleetError(Exception):
    """The dumps given cannot make a fleet (one-line reason, naming the path)."""


def collect_dumps(paths: list[Path]) -> list[Path]:
    """The dumps named by ``paths``, in order: a file is one dump, a Parquet dump folder is one
    dump, a retention archive (``telemetry/retention.py``) is one dump (its roll-outs read as
    one store), any other folder stands for its ``*.duckdb`` files, Parquet dump sub-folders
    and archives (sorted by name).

    Raises:
        FleetError: a path that does not exist, a folder holding no dumps, or a dump given
            twice.
    """
    found: list[Path] = []
    for p in paths:
        if not p.exists():
            raise FleetError(f"{p}: no such file or folder")
        if p.is_dir() and not is_parquet_dump(p) and not is_archive(p):
            inside = sorted(
                c
                for c in p.iterdir()
                if (c.is_file() and c.suffix == ".duckdb") or is_parquet_dump(c) or is_archive(c)
            )
            if not inside:
                raise FleetError(
                    not_a_parquet_dump(p)
                    or f"{p}: folder holds no dumps (*.duckdb files or Parquet dump folders)"
                )
            found += inside
        else:
            found.append(p)
    seen: set[Path] = set()
    for p in found:
        r = p.resolve()
        if r in seen:
            raise FleetError(f"{p}: the same dump is given twice")
        seen.add(r)
    return found


def _stem(p: Path) -> str:
    return p.name[: -len(".duckdb")] if p.name.endswith(".duckdb") else p.name


def source_names(paths: list[Path], meta_sources: list[str]) -> list[str]:
    """One distinct name per dump: the host in its ``meta`` ``source`` (``server HOST pid ...``,
    written by ``/admin/dump``) when every dump has one and they all differ, else the file
    name without ``.duckdb``, with as many parent folders as it takes to tell them apart."""
    hosts = [m.group(1) if (m := _SERVER_RE.match(s or "")) else None for s in meta_sources]
    if all(hosts) and len(set(hosts)) == len(hosts):
        return list(hosts)
    parts = [p.resolve().parts for p in paths]
    for depth in range(1, max((len(x) for x in parts), default=1) + 1):
        names = [os.path.join(*x[-depth - 1 : -1], _stem(p)) if depth > 1 else _stem(p)
                 for x, p in zip(parts, paths, strict=True)]  # fmt: skip
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]


def merge(named: list[tuple[str, str, Report]]) -> Report:
    """One report over the sources ``(name, dump path, report)``: findings (each with its
    ``source``) ranked as :func:`~tokenmill.diagnose.findings.diagnose` ranks them, then by
    source; hints with their source; rule errors keyed ``source/rule``; the range spanning all
    sources; the summary's counts summed (:data:`SUMMED_KEYS`; percentiles per source only, in
    ``sources``); ``fleet_wide`` the rules that fired on every source (fleets of two or more).

    A single source gives its own report back with ``source`` set on its findings and notes.
    """
    for name, _, report in named:
        for f in report.findings:
            f.source = name
        for n in report.notes:
            n.source = name
        for f in report.inconclusive:
            f.source = name
    sources = [
        {
            "name": name,
            "dump": path,
            "status": "problems_found" if r.findings else "healthy",
            "range": {"start_ns": r.start_ns, "end_ns": r.end_ns},
            "summary": r.summary,
            "rules_fired": sorted({f.rule_id for f in r.findings}),
            "healthy_baseline": r.healthy_baseline,
            "warmup": r.warmup,
        }
        for name, path, r in named
    ]
    if len(named) == 1:
        report = named[0][2]
        report.sources = sources
        return report
    reports = [r for _, _, r in named]
    findings = [f for r in reports for f in r.findings]
    findings.sort(
        key=lambda f: (
            bool(f.explained_by),
            -SEVERITY_RANK.get(f.severity, 0),
            -f.confidence,
            f.rule_id,
            f.source,
        )
    )
    fired = [{f.rule_id for f in r.findings} for r in reports]
    fleet_wide = sorted(set.intersection(*fired)) if fired else []
    summary = {k: sum(r.summary.get(k) or 0 for r in reports) for k in SUMMED_KEYS}
    return Report(
        findings=findings,
        start_ns=min(r.start_ns for r in reports),
        end_ns=max(r.end_ns for r in reports),
        window_s=reports[0].window_s,
        summary=summary,
        rule_errors={
            f"{name}/{rule}": msg for name, _, r in named for rule, msg in r.rule_errors.items()
        },
        notes=[n for r in reports for n in r.notes],
        inconclusive=[f for r in reports for f in r.inconclusive],
        sources=sources,
        fleet_wide=fleet_wide,
        # each source judged on its own healthy windows: the fleet lacks a baseline where any
        # source does, and names which
        healthy_baseline={
            "available": all(r.healthy_baseline.get("available", True) for r in reports),
            "reason": "; ".join(
                f"{name}: {r.healthy_baseline.get('reason')}"
                for name, _, r in named
                if r.healthy_baseline.get("available") is False
            )
            or None,
            "not_judged": sorted(
                {rid for r in reports for rid in r.healthy_baseline.get("not_judged") or []}
            ),
        },
        warmup={
            "requests": sum(r.warmup.get("requests") or 0 for r in reports),
            "intervals": [iv for r in reports for iv in r.warmup.get("intervals") or []],
        },
    )
