"""``tokenmill diagnose``: open a dump, a closed store or a live server's dump, run the rules,
print the report. Exit codes: 0 (report printed), 1 (``--fail-on`` threshold reached),
2 (bad input: one ``error:`` line).

The root ``tokenmill`` command finds :data:`app` here by name and imports this module for help
too: DuckDB and the rules are imported when the command runs.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from tokenmill.telemetry.cli import fail, fetch_message, out


class DiagnoseInputError(Exception):
    """Bad input for ``tokenmill diagnose`` (one-line reason, exit code 2)."""


def run(
    source: Path | list[Path] | None,
    *,
    db: Path | None = None,
    url: str | None = None,
    api_key: str | None = None,
    since: str | None = None,
    window: str = "10s",
    fmt: str = "text",
    fail_on: str | None = None,
    console: Console | None = None,
) -> int:
    """Run a diagnosis and print it; returns the exit code.

    A live server's dump (``url``) is fetched with the shared ``/admin/dump`` client,
    :func:`tokenmill.telemetry.remote.fetch_dump`, into a temporary folder.

    ``--since`` counts back from the latest row of the dump (not from now), so an old dump
    can be read with the same flags as a fresh one.

    Several dumps (or a folder of them) are a fleet (:mod:`.fleet`): each dump is diagnosed on
    its own (``--since`` from its own latest row) and the reports merged; ``--fail-on`` looks
    at the worst finding over all of them.

    Raises:
        DiagnoseInputError: bad flags, an unreadable or foreign file, an empty store or window.
    """
    import duckdb

    from tokenmill.telemetry.dump import (
        DumpError,
        duration_ns,
        latest_ns,
        open_dump,
        parse_duration,
    )

    from .findings import SEVERITY_RANK, diagnose
    from .fleet import FleetError, collect_dumps, merge, source_names
    from .report import print_text, to_json, to_markdown
    from .signals import NoTraffic

    console = console or Console(emoji=False)
    if isinstance(source, list):
        source = source or None
    elif source is not None:
        source = [source]
    if sum(x is not None for x in (source, db, url)) != 1:
        raise DiagnoseInputError("give exactly one of DUMP, --db PATH or --url URL")
    if fmt not in ("text", "json", "markdown"):
        raise DiagnoseInputError(f"--format must be text, json or markdown, not {fmt!r}")
    if fail_on not in (None, "warning", "critical"):
        raise DiagnoseInputError(f"--fail-on must be warning or critical, not {fail_on!r}")
    try:
        window_s = parse_duration(window)
    except ValueError as exc:
        raise DiagnoseInputError(f"--window: {exc}") from None
    since_d = None
    if since is not None:
        try:
            since_d = duration_ns(since)
        except ValueError as exc:
            raise DiagnoseInputError(f"--since: {exc}") from None

    from tokenmill.telemetry.retention import is_archive  # duckdb: not at --help

    with contextlib.ExitStack() as stack:
        if url is not None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "live.duckdb"
            _fetch(url, tmp, api_key=api_key)
            paths = [tmp]
        elif source is not None and (
            len(source) > 1 or (source[0].is_dir() and not is_archive(source[0]))
        ):
            try:
                paths = collect_dumps(source)
            except FleetError as exc:
                raise DiagnoseInputError(str(exc)) from None
        else:
            paths = source if source is not None else [db]
        cons = []
        for path in paths:  # open (and check) them all before the first diagnosis
            try:
                cons.append(open_dump(path, verify=False))
            except DumpError as exc:
                raise DiagnoseInputError(str(exc)) from None
            stack.callback(cons[-1].close)
        metas = [_meta_source(con) for con in cons]
        named = []
        for path, name, con in zip(paths, source_names(paths, metas), cons, strict=True):
            try:
                since_ns = latest_ns(con) - since_d if since_d is not None else None
                named.append((name, str(path), diagnose(con, since_ns=since_ns, window_s=window_s)))
            except NoTraffic as exc:
                raise DiagnoseInputError(f"{path}: {exc}") from None
            except duckdb.Error as exc:
                msg = str(exc).strip()
                first = msg.splitlines()[0] if msg else type(exc).__name__
                raise DiagnoseInputError(f"{path}: cannot read the store ({first})") from None
        report = merge(named)
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


def _meta_source(con) -> str:
    """The dump's ``meta`` ``source`` (who wrote it: ``server HOST pid ...``, ``file PATH``)."""
    row = con.execute("SELECT value FROM meta WHERE key = 'source'").fetchone()
    return row[0] if row else ""


def _fetch(url: str, path: Path, *, api_key: str | None) -> None:
    from tokenmill.telemetry.remote import FetchError, fetch_dump

    try:
        fetch_dump(url, path, api_key=api_key, timeout_s=300.0)
    except FetchError as exc:
        raise DiagnoseInputError(fetch_message(exc, url)) from None


app = typer.Typer(add_completion=False)


@app.command()
def diagnose(
    dump_file: Annotated[
        list[Path] | None,
        typer.Argument(
            metavar="DUMP...",
            help="A trace dump or closed store file; several dumps or a folder of them (one "
            "per replica) for a fleet; a Parquet dump folder is one dump.",
        ),
    ] = None,
    db: Annotated[
        Path | None, typer.Option(help="A trace-store file no server holds open.")
    ] = None,
    url: Annotated[
        str | None, typer.Option(help="A running server: fetch a fresh dump (admin key).")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--admin-key", envvar="TOKENMILL_ADMIN_KEY", help="The server's admin key (with --url)."
        ),
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(help="Only the last 30s/10m/2h/1d of the dump (counted from its last row)."),
    ] = None,
    window: Annotated[
        str, typer.Option(help="Window length for the signals: 10s, 1m, ...")
    ] = "10s",
    format: Annotated[str, typer.Option("--format", help="text | json | markdown")] = "text",
    fail_on: Annotated[
        str | None,
        typer.Option(
            metavar="SEVERITY",
            help="Exit 1 when a finding is at least this severe: warning | critical.",
        ),
    ] = None,
    baseline: Annotated[
        Path | None,
        typer.Option(
            metavar="BEFORE",
            help="Compare the dump (AFTER) with this earlier dump of comparable traffic: "
            "config, traffic, latency, station, throughput and rule shifts.",
        ),
    ] = None,
    fail_on_regression: Annotated[
        float | None,
        typer.Option(
            metavar="PCT",
            min=0.0,
            help="With --baseline: exit 1 when comparable runs regressed by more than PCT % "
            "(TTFT/ITL/E2E p99 up, throughput/goodput down).",
        ),
    ] = None,
) -> None:
    """Name the likely bottlenecks in a trace dump, with evidence, example traces and a runbook."""
    common = dict(
        db=db,
        url=url,
        api_key=api_key,
        since=since,
        window=window,
        fmt=format,
        fail_on=fail_on,
        console=out,
    )
    try:
        if baseline is not None or fail_on_regression is not None:  # a comparison
            from .compare_cli import run_compare

            code = run_compare(baseline, dump_file, fail_on_regression=fail_on_regression, **common)
        else:
            code = run(dump_file, **common)
    except DiagnoseInputError as exc:
        fail(str(exc))
    raise typer.Exit(code)
