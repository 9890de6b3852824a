"""``tokenmill explain REQUEST_ID --db STORE|DUMP [--format text|json]``: one request's critical
path (:mod:`.explain`). Exit 0 with the explanation; bad input (no ``--db``, an unreadable or
foreign file, an unknown request id, a bad ``--format``) is one ``error:`` line, exit 2.

The root ``tokenmill`` command finds :data:`app` here by name and imports this module for help
too: DuckDB and the explanation are imported when the command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tokenmill.telemetry.cli import fail

app = typer.Typer(add_completion=False)


def run(request_id: str, db: Path | None, fmt: str) -> str:
    """The explanation of ``request_id`` in the store or dump ``db``, rendered as ``fmt``.

    Raises:
        ValueError: bad input (one-line reason).
    """
    import duckdb

    from tokenmill.telemetry.dump import DumpError, open_dump

    from .explain import ExplainError, explain, to_json, to_text

    if fmt not in ("text", "json"):
        raise ValueError(f"--format must be text or json, not {fmt!r}")
    if db is None:
        raise ValueError("give the store or dump to read: --db PATH")
    try:
        con = open_dump(db, verify=False)
    except DumpError as exc:
        raise ValueError(str(exc)) from None
    try:
        ex = explain(con, request_id)
    except ExplainError as exc:
        raise ValueError(f"{db}: {exc}") from None
    except duckdb.Error as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{db}: cannot read the store ({first})") from None
    finally:
        con.close()
    return to_json(ex) + "\n" if fmt == "json" else to_text(ex)


@app.command()
def explain(
    request_id: Annotated[
        str,
        typer.Argument(
            metavar="REQUEST_ID",
            help="The request: its engine id (cmpl-...), the client's x-request-id or its "
            "trace id.",
        ),
    ],
    db: Annotated[
        Path | None,
        typer.Option(help="A trace dump, or a store file no server holds open."),
    ] = None,
    format: Annotated[str, typer.Option("--format", help="text | json")] = "text",
) -> None:
    """Explain one request's latency: its critical path in parts that add up to its E2E (what
    it queued behind, its prefill chunks, preemptions, decode steps and stalls, the stream)
    and why each uncached prompt block missed the prefix cache."""
    try:
        text = run(request_id, db, format)
    except ValueError as exc:
        fail(str(exc))
    typer.echo(text, nl=False)
