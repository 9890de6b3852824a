"""``tokenmill dump``, and what the observers' commands share.

The root ``tokenmill`` command (``engine/cli.py``) finds ``dump`` here by name and imports this
module only when the command runs or help is shown: keep its top-level imports light (typer
and rich; DuckDB and httpx inside the command).

Every failure of the observers' commands (``dump``, ``diagnose``, ``dashboard``, ``bench``,
``scenario``, ``demo``) is one ``error:`` line and exit status 2: :func:`fail`. The live
sources beside ``serve`` (``proxy``, ``collect``) share their store's settings, their bind
check and their logs with it: :func:`serve_setting`, :func:`open_store`, :func:`refuse_open_bind`,
:func:`start_logs`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

err = Console(stderr=True, emoji=False)  # ":joy:" in a user's input stays as typed
out = Console(emoji=False)


def fail(message: str) -> NoReturn:
    """Print a one-line error and exit with status 2."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


#: the trace store's settings a writing command shares with ``serve`` (``ServeConfig``'s
#: fields of those names), and the ``TraceStore`` keyword each one sets
STORE_SETTINGS = {
    "trace_retention": "retention_s",
    "trace_max_bytes": "max_bytes",
    "trace_archive": "archive",
    "trace_archive_max_age": "archive_max_age_s",
    "trace_archive_max_bytes": "archive_max_bytes",
}


#: the shape of a store setting ``ServeConfig`` does not declare yet (``serve_setting``)
SERVE_FALLBACKS: dict[str, dict] = {
    "trace_archive_max_age": {
        "default": None,
        "help": "Delete roll-outs in --trace-archive older than this (7d, 30d; default: keep "
        "them).",
        "duration": True,
        "min": 1.0,
    },
    "trace_archive_max_bytes": {
        "default": None,
        "help": "Past this size (bytes) of --trace-archive its oldest roll-outs are deleted.",
        "min": 1 << 20,
    },
}


def serve_setting(name: str, help: str | None = None) -> Any:
    """A settings field shaped as ``ServeConfig``'s field ``name`` (its default, help, bounds
    and duration grammar, in the command's own ``--help`` panel), so that ``proxy`` and
    ``collect`` name and describe it as ``serve`` does; ``help`` replaces its help. A name
    ``ServeConfig`` lacks takes its shape from :data:`SERVE_FALLBACKS`."""
    from tokenmill.engine.serve_config import ServeConfig
    from tokenmill.engine.settings import setting

    f = next((f for f in dataclasses.fields(ServeConfig) if f.name == name), None)
    if f is None:
        return setting(**{**SERVE_FALLBACKS[name], **({"help": help} if help else {})})
    meta = {**f.metadata, "panel": None, **({"help": help} if help else {})}
    return dataclasses.field(default=f.default, metadata=meta)


def store_kwargs(cfg: Any) -> dict:
    """``TraceStore``'s retention keywords from a command's :data:`STORE_SETTINGS` fields, the
    ones set (a field left unset is not passed)."""
    return {
        kw: getattr(cfg, name)
        for name, kw in STORE_SETTINGS.items()
        if getattr(cfg, name, None) is not None
    }


def open_store(trace_db: Path, **store_kwargs: Any):
    """A ``TraceStore`` on ``trace_db`` for a writing command (``collect``, ``proxy``), with
    its retention (:func:`store_kwargs`), or one ``error:`` line: the file in use, not a store,
    or an unwritable folder."""
    from .store import TraceStore, TraceStoreInUse

    try:
        return TraceStore(trace_db, **store_kwargs)
    except TraceStoreInUse as exc:
        fail(str(exc))
    except TypeError as exc:  # a retention setting this store does not take yet
        fail(f"the trace store does not take this setting: {exc}")
    except Exception as exc:
        fail(f"--trace-db {trace_db}: {str(exc).splitlines()[0]}")


def refuse_open_bind(host: str, keyed: bool, allow_unauthenticated: bool, keys: str) -> None:
    """One ``error:`` line for a command about to answer anyone on a non-loopback ``host``
    with no key (``keys``: the flags that give one), as ``tokenmill serve`` refuses it."""
    from tokenmill.engine.api.gateway import is_loopback

    if not keyed and not is_loopback(host) and not allow_unauthenticated:
        fail(
            f"refusing to serve {host} without a key: give {keys}, or --allow-unauthenticated "
            "to serve it open"
        )


def check_logs(level: str, fmt: str) -> None:
    """``--log-level`` and ``--log-format`` checked as ``serve`` checks them (one line)."""
    from tokenmill.engine.logs import FORMATS, LEVELS

    if level not in LEVELS or fmt not in FORMATS:
        fail(
            f"--log-level is one of {', '.join(LEVELS)}; --log-format one of "
            f"{', '.join(FORMATS)} (got {level!r}, {fmt!r})"
        )


def start_logs(level: str, fmt: str) -> None:
    """The command's logs (``tokenmill.*`` and uvicorn's) on stderr at ``level``, as text or
    JSON lines: ``serve``'s handler (``engine/logs.py``)."""
    from tokenmill.engine.logs import configure

    check_logs(level, fmt)
    configure(level, fmt, export=False)


app = typer.Typer(add_completion=False)

# the options of ``tokenmill dump``
_Output = Annotated[
    Path,
    typer.Option("--output", "-o", help="The dump file to write (a folder with --format parquet)."),
]
_Db = Annotated[
    Path | None,
    typer.Option(help="A trace-store file no server holds open (for a live one, use --url)."),
]
_Url = Annotated[str | None, typer.Option(help="A running server, e.g. http://127.0.0.1:8000.")]
_Since = Annotated[
    str | None,
    typer.Option(
        metavar="DURATION",
        help="Start of the window, counted back from the store's latest row: 30s, 10m, 2h, "
        "1d (default: all).",
    ),
]
_Until = Annotated[
    str | None,
    typer.Option(
        metavar="DURATION",
        help="End of the window, counted back from the latest row (default: the latest).",
    ),
]
_AdminKey = Annotated[
    str | None,
    typer.Option(
        "--admin-key", envvar="TOKENMILL_ADMIN_KEY", help="The server's admin key (with --url)."
    ),
]
_Force = Annotated[bool, typer.Option(help="Overwrite an existing output file.")]
_Timeout = Annotated[
    float, typer.Option(min=1.0, help="Seconds to wait for the server (with --url).")
]
_Format = Annotated[
    str,
    typer.Option(
        "--format",
        metavar="FORMAT",
        help="duckdb (one file) | parquet (a folder: one Parquet file per table, for "
        "DuckDB, Spark or Trino).",
    ),
]


@app.command()
def dump(
    output: _Output,
    db: _Db = None,
    url: _Url = None,
    since: _Since = None,
    until: _Until = None,
    api_key: _AdminKey = None,
    force: _Force = False,
    timeout: _Timeout = 300.0,
    format: _Format = "duckdb",
) -> None:
    """Write a trace dump (a self-contained DuckDB file of a time window, or a folder of
    Parquet files) from a closed store file (--db) or a running server (--url, admin key)."""
    import shutil
    import tempfile

    from .dump import DumpError, format_summary

    since_d, until_d = _check_dump_options(output, db, url, since, until, force, format)
    parquet = format == "parquet"
    final, tmp_dir = output, None
    if parquet:  # the DuckDB dump first, in a private folder beside the output, then exported
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
        output = tmp_dir / "dump.duckdb"
    try:
        if db is not None:
            _dump_from_file(db, output, since_d, until_d, force)
        else:
            _dump_from_server(url, output, since, until, api_key, timeout, force)
        info = _finish_dump(output, final if parquet else None, force)
    except DumpError as exc:
        fail(str(exc))
    finally:
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    out.print(format_summary(final, info), highlight=False, markup=False, soft_wrap=True)


def _check_dump_options(
    output: Path,
    db: Path | None,
    url: str | None,
    since: str | None,
    until: str | None,
    force: bool,
    format: str,
) -> tuple[int | None, int | None]:
    """``dump``'s options checked before anything is read or written (one ``error:`` line
    each): the ``--since`` and ``--until`` durations in ns."""
    from .dump import duration_ns

    if (db is None) == (url is None):
        fail("give exactly one of --db (a store file) or --url (a running server)")
    if format not in ("duckdb", "parquet"):
        fail(f"--format must be duckdb or parquet, not {format!r}")
    parquet = format == "parquet"
    try:
        since_d = duration_ns(since) if since is not None else None
    except ValueError as exc:
        fail(f"--since: {exc}")
    try:
        until_d = duration_ns(until) if until is not None else None
    except ValueError as exc:
        fail(f"--until: {exc}")
    if since_d is not None and until_d is not None and until_d >= since_d:
        fail("--until must be later than --since (both count back from the latest row)")
    if output.is_dir() and not parquet:
        fail(f"{output} is a folder; give a file name with -o")
    if output.exists() and not output.is_dir() and parquet:
        fail(f"{output} is a file; --format parquet writes a folder")
    if output.exists() and not force:
        fail(f"{output} already exists (choose another name, or --force)")
    if not output.parent.is_dir():
        fail(f"folder {output.parent} does not exist")
    return since_d, until_d


def _dump_from_file(
    db: Path, output: Path, since_d: int | None, until_d: int | None, force: bool
) -> None:
    """The window of the store file ``db`` into ``output``."""
    from .dump import latest_ns, open_dump, write_dump

    con = open_dump(db, verify=False)
    try:
        latest = latest_ns(con)  # --since/--until count back from the latest row
        write_dump(
            con,
            output,
            since_ns=None if since_d is None else latest - since_d,
            until_ns=None if until_d is None else latest - until_d,
            source=f"file {db.resolve()}",
            overwrite=force,
        )
    finally:
        con.close()


def _dump_from_server(
    url: str,
    output: Path,
    since: str | None,
    until: str | None,
    api_key: str | None,
    timeout: float,
    force: bool,
) -> None:
    """The window of the running server at ``url`` into ``output`` (its ``/admin/dump``)."""
    from .remote import FetchError, fetch_dump

    try:
        fetch_dump(
            url,
            output,
            since=since,
            until=until,
            api_key=api_key,
            timeout_s=timeout,
            overwrite=force,
        )
    except FetchError as exc:
        fail(fetch_message(exc, url, timeout_option=True))


def _finish_dump(output: Path, parquet_to: Path | None, force: bool) -> dict:
    """The written dump opened (checked), exported to the folder ``parquet_to`` if given, and
    described for the summary line."""
    from .dump import describe_dump, open_dump

    con = open_dump(output)
    try:
        if parquet_to is not None:
            from .parquet_dump import ParquetDumpError, export_parquet

            try:
                export_parquet(con, parquet_to, overwrite=force)
            except ParquetDumpError as exc:
                fail(str(exc))
        return describe_dump(con)
    finally:
        con.close()


def fetch_message(exc, url: str, *, timeout_option: bool = False) -> str:
    """The one line a ``--url`` command prints for a :class:`~.remote.FetchError`: the flag
    named for a malformed URL, and the hints its options allow."""
    if exc.kind == "url":
        return f"bad --url {url!r}: {exc.detail}"
    if exc.kind == "timeout" and timeout_option:
        return f"{exc} (try --timeout)"
    if exc.kind == "exists":
        return f"{exc} (choose another name, or --force)"
    return str(exc)
