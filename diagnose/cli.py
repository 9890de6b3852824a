"""``tokenmill diagnose``: open a dump, a closed store or a live server's dump, run the rules,
print the report. Exit codes: 0 (report printed), 1 (``--fail-on`` threshold reached),
2 (bad input: one ``error:`` line)."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import duckdb
from rich.console import Console

from tokenmill.telemetry.dump import DumpError, open_dump, parse_since

from .findings import SEVERITY_RANK, diagnose
from .report import print_text, to_json, to_markdown
from .signals import NoTraffic


class DiagnoseInputError(Exception):
    """Bad input for ``tokenmill diagnose`` (one-line reason, exit code 2)."""


def _latest_ns(con) -> int:
    (t,) = con.execute(
        "SELECT max(t) FROM (SELECT max(end_ns) t FROM requests "
        "UNION ALL SELECT max(end_ns) FROM engine_steps)"
    ).fetchone()
    return t or 0


def run(
    source: Path | None,
    *,
    db: Path | None = None,
    url: str | None = None,
    api_key: str | None = None,
    since: str | None = None,
    window: str = "10s",
    fmt: str = "text",
    fail_on: str | None = None,
    console: Console | None = None,
    fetch=None,
) -> int:
    """Run a diagnosis and print it; returns the exit code.

    ``--since`` counts back from the latest row of the dump (not from now), so an old dump
    can be read with the same flags as a fresh one.

    Raises:
        DiagnoseInputError: bad flags, an unreadable or foreign file, an empty store or window.
    """
    console = console or Console(emoji=False)
    if sum(x is not None for x in (source, db, url)) != 1:
        raise DiagnoseInputError("give exactly one of DUMP, --db PATH or --url URL")
    if fmt not in ("text", "json", "markdown"):
        raise DiagnoseInputError(f"--format must be text, json or markdown, not {fmt!r}")
    if fail_on not in (None, "warning", "critical"):
        raise DiagnoseInputError(f"--fail-on must be warning or critical, not {fail_on!r}")
    try:
        window_s = float(parse_since(window))
    except ValueError as exc:
        raise DiagnoseInputError(f"--window: {exc}") from None
    since_s = None
    if since is not None:
        try:
            since_s = parse_since(since)
        except ValueError as exc:
            raise DiagnoseInputError(f"--since: {exc}") from None

    with contextlib.ExitStack() as stack:
        if url is not None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "live.duckdb"
            fetch(url, tmp, api_key=api_key)
            path = tmp
        else:
            path = source if source is not None else db
        try:
            con = open_dump(path, verify=False)
        except DumpError as exc:
            raise DiagnoseInputError(str(exc)) from None
        stack.callback(con.close)
        try:
            since_ns = _latest_ns(con) - since_s * 1_000_000_000 if since_s is not None else None
            report = diagnose(con, since_ns=since_ns, window_s=window_s)
        except NoTraffic as exc:
            raise DiagnoseInputError(f"{path}: {exc}") from None
        except duckdb.Error as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DiagnoseInputError(f"{path}: cannot read the store ({first})") from None
    if fmt == "json":
        console.print_json(to_json(report)) if console.is_terminal else print(to_json(report))
    elif fmt == "markdown":
        print(to_markdown(report), end="")
    else:
        print_text(report, console)
    if fail_on is not None:
        worst = max((SEVERITY_RANK.get(f.severity, 0) for f in report.findings), default=0)
        if worst >= SEVERITY_RANK[fail_on]:
            return 1
    return 0
