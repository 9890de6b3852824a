"""``tokenmill collect``: another engine's OTLP traces and ``/metrics`` into a trace store.

Light top-level imports only (``tokenmill --help`` lists this command without loading DuckDB).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .cli import err, fail, open_store

app = typer.Typer(add_completion=False)


@app.command()
def collect(
    trace_db: Annotated[
        Path,
        typer.Option(help="The trace-store file to fill (created if missing)."),
    ] = Path("tokenmill-data/collected.duckdb"),
    scrape: Annotated[
        list[str] | None,
        typer.Option(
            metavar="URL",
            help="An engine's metrics URL to scrape, e.g. http://127.0.0.1:8000/metrics "
            "(vLLM, SGLang, llama.cpp with --metrics, TGI, tokenmill); repeatable.",
        ),
    ] = None,
    scrape_interval: Annotated[
        str,
        typer.Option(metavar="DURATION", help="Time between scrapes: 1s, 5s, 1m; 0: never."),
    ] = "5s",
    engine_kind: Annotated[
        str | None,
        typer.Option(
            metavar="KIND",
            help="vllm | sglang | llamacpp | tgi | tokenmill (default: read from the metric "
            "names).",
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address of the OTLP/HTTP receiver.")] = "127.0.0.1",
    scrape_key: Annotated[
        str | None,
        typer.Option(
            envvar="TOKENMILL_SCRAPE_KEY",
            help="The bearer key the scraped /metrics want (a keyed tokenmill server's "
            "--metrics-key or admin key).",
        ),
    ] = None,
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="Port of the OTLP/HTTP receiver (0: none).")
    ] = 4318,
) -> None:
    """Receive OTLP/HTTP traces on HOST:PORT/v1/traces and scrape engines' /metrics into a
    trace store, until Ctrl-C. Then `tokenmill diagnose --db TRACE_DB` reads it."""
    import signal
    import time

    from tokenmill.engine.durations import parse_duration

    from .engine_metrics import ENGINES
    from .scrape import MetricsScraper

    try:
        interval = parse_duration(scrape_interval, allow_zero=True)
    except ValueError as exc:
        fail(f"--scrape-interval: {exc}")
    if engine_kind is not None and engine_kind not in ENGINES:
        fail(f"--engine-kind must be one of {', '.join(ENGINES)}, not {engine_kind!r}")
    urls = scrape or []
    for u in urls:
        if not u.startswith(("http://", "https://")):
            fail(f"--scrape {u}: give an http(s) URL, e.g. http://127.0.0.1:8000/metrics")
    if interval == 0:  # never: the URLs are checked, not scraped
        urls = []
    if not urls and port == 0:
        fail("nothing to collect: give --scrape URL, a --port for OTLP traces, or both")
    store = open_store(trace_db)
    scrapers = [
        MetricsScraper(
            u, store.submit, interval_s=interval, kind=engine_kind, key=scrape_key
        ).start()
        for u in urls
    ]
    err.print(
        f"collecting into {trace_db}"
        + (f"; OTLP/HTTP traces on http://{host}:{port}/v1/traces" if port else "")
        + (f"; scraping {', '.join(urls)} every {scrape_interval}" if urls else "")
        + ("; not scraping (--scrape-interval 0)" if scrape and not urls else ""),
        highlight=False,
    )
    try:
        if port:
            from tokenmill.engine.api.shutdown import serve_app

            from .collect import make_app

            # a stop signal ends it after the export in hand; the store keeps its last rows
            serve_app(make_app(store, scrapers), host, port)
        else:
            # SIGTERM (systemd, a group stop) ends the scrapers as Ctrl-C does
            signal.signal(signal.SIGTERM, signal.default_int_handler)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        for s in scrapers:
            s.stop()
        store.close()
