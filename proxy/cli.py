"""``tokenmill proxy``: front any OpenAI-compatible server and record what its clients see.

Light top-level imports only (``tokenmill --help`` lists this command without loading DuckDB).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tokenmill.engine.serve_config import ServeConfig
from tokenmill.telemetry.cli import err, fail, open_store

app = typer.Typer(add_completion=False)


@app.command()
def proxy(
    upstream: Annotated[
        str,
        typer.Option(
            metavar="URL",
            help="The upstream server's URL, e.g. http://127.0.0.1:8000 or its OpenAI base URL "
            "http://127.0.0.1:8000/v1 (vLLM, SGLang, "
            "llama.cpp's llama-server, TGI, tokenmill).",
        ),
    ],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8080,
    trace_db: Annotated[
        Path, typer.Option(help="The trace-store file the proxy writes (created if missing).")
    ] = Path("tokenmill-data/proxy.duckdb"),
    first_byte_timeout: Annotated[
        str,
        typer.Option(
            metavar="DURATION",
            help="Longest wait for the upstream's first byte before a 504: 30s, 2m.",
        ),
    ] = "60s",
    shutdown_timeout: Annotated[
        str,
        typer.Option(
            metavar="DURATION",
            help="A first SIGTERM or SIGINT (to the proxy or its process group): new requests "
            "get 503 and those in flight get this long to finish; a second signal stops at once.",
        ),
    ] = "30s",
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="TOKENMILL_API_KEY",
            help="The one key clients must send (Authorization: Bearer KEY); default: none.",
        ),
    ] = None,
    tenants: Annotated[
        Path | None,
        typer.Option(help="A tenants file (keys, quotas), as `tokenmill serve --tenants`."),
    ] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="The upstream model's tokenizer folder (tokenizer.json, tokenizer_config.json): "
            "prompts counted at the proxy, tenants' prompt limits held (default: sizes from "
            "the upstream's usage).",
        ),
    ] = None,
    max_in_flight: Annotated[
        int,
        typer.Option(
            min=0,
            help="Requests forwarded at once; past it a 429 with Retry-After (0: no limit).",
        ),
    ] = 0,
    otlp_receiver: Annotated[
        bool,
        typer.Option(
            help="Also take OTLP/HTTP traces on /v1/traces into TRACE_DB: point the upstream's "
            "exporter here and its request spans join the proxy's trace in one store.",
        ),
    ] = False,
    scrape_interval: Annotated[
        str,
        typer.Option(
            metavar="DURATION",
            help="Scrape the upstream's /metrics this often into TRACE_DB (engine_samples: "
            "its queue, KV use, preemptions, for the diagnosis); 0: never.",
        ),
    ] = "5s",
    max_body_bytes: Annotated[
        int,
        typer.Option(
            metavar="BYTES",
            min=1024,
            help="Largest request body forwarded; past it a 413 while reading (the server's "
            "own default).",
        ),
    ] = ServeConfig().max_body_bytes,
    metrics_url: Annotated[
        str | None,
        typer.Option(metavar="URL", help="The upstream's metrics URL (default: UPSTREAM/metrics)."),
    ] = None,
    scrape_key: Annotated[
        str | None,
        typer.Option(
            envvar="TOKENMILL_SCRAPE_KEY",
            help="The bearer key the upstream's /metrics wants (a keyed tokenmill server's "
            "--metrics-key or admin key).",
        ),
    ] = None,
    upstream_api_key: Annotated[
        str | None,
        typer.Option(
            envvar="TOKENMILL_UPSTREAM_API_KEY",
            help="The key the upstream wants (default: the client's own Authorization).",
        ),
    ] = None,
) -> None:
    """Forward /v1/chat/completions and /v1/completions to UPSTREAM unchanged, and record a
    request row and a trace per request (client-side TTFT, ITL, errors) in TRACE_DB, until
    Ctrl-C. Then `tokenmill diagnose --db TRACE_DB` reads it."""
    from tokenmill.engine.api.gateway import (
        Gateway,
        TenantsFileError,
        load_tenants,
        single_key_tenants,
    )
    from tokenmill.engine.durations import parse_duration

    if not upstream.startswith(("http://", "https://")):
        fail(f"--upstream {upstream}: give an http(s) URL, e.g. http://127.0.0.1:8000")
    # the OpenAI base URL, as every client writes it (…/v1), names the same server
    from tokenmill.telemetry.remote import normalize_url

    upstream = normalize_url(upstream)
    try:
        timeout_s = parse_duration(first_byte_timeout)
    except ValueError as exc:
        fail(f"--first-byte-timeout: {exc}")
    try:
        scrape_s = parse_duration(scrape_interval, allow_zero=True)  # 0: never
    except ValueError as exc:
        fail(f"--scrape-interval: {exc}")
    try:
        shutdown_s = parse_duration(shutdown_timeout, allow_zero=True)
    except ValueError as exc:
        fail(f"--shutdown-timeout: {exc}")
    metrics_url = metrics_url or upstream.rstrip("/") + "/metrics"
    if not metrics_url.startswith(("http://", "https://")):
        fail(f"--metrics-url {metrics_url}: give an http(s) URL")
    if api_key is not None and tenants is not None:
        fail("give --api-key or --tenants, not both")
    try:
        if tenants is not None:
            gateway = Gateway(load_tenants(tenants))
        elif api_key:
            gateway = Gateway(single_key_tenants(api_key))
        else:
            gateway = Gateway()
    except TenantsFileError as exc:
        fail(str(exc))
    tok = None
    if tokenizer is not None:
        from tokenmill.engine.errors import ModelLoadError
        from tokenmill.engine.tokenizer import load_tokenizer

        if not tokenizer.exists():
            fail(f"--tokenizer {tokenizer}: no such folder")
        try:
            tok = load_tokenizer(tokenizer)
        except ModelLoadError as exc:
            fail(f"--tokenizer: {exc}")
    store = open_store(trace_db)
    from tokenmill.engine.api.shutdown import serve_app

    from .app import ProxyState, build_proxy_app

    state = ProxyState(
        upstream,
        store.submit,
        gateway=gateway,
        first_byte_timeout_s=timeout_s,
        upstream_api_key=upstream_api_key,
        max_in_flight=max_in_flight,
        tokenizer=tok,
        max_body_bytes=max_body_bytes,
    )
    app = build_proxy_app(state)
    scraper = None
    if scrape_s > 0:
        from tokenmill.telemetry.scrape import MetricsScraper

        scraper = MetricsScraper(
            metrics_url, store.submit, interval_s=scrape_s, key=scrape_key
        ).start()
    if otlp_receiver:
        from tokenmill.telemetry.collect import add_receiver

        add_receiver(app, store, request_rows=False)
    err.print(
        f"proxying http://{host}:{port} → {upstream}; recording into {trace_db}"
        + (f"; OTLP/HTTP traces on http://{host}:{port}/v1/traces" if otlp_receiver else "")
        + (f"; scraping {metrics_url} every {scrape_interval}" if scraper else ""),
        highlight=False,
    )

    def drain(cause: str) -> None:
        state.draining = True
        err.print(
            f"{cause}: draining {state.open_requests} requests in flight (up to "
            f"{shutdown_s:g} s); new requests get 503",
            highlight=False,
        )

    try:
        serve_app(
            app,
            host,
            port,
            busy=lambda: state.open_requests,
            on_drain=drain,
            on_stop=state.stop,
            drain_s=shutdown_s,
        )
    finally:
        if scraper is not None:
            scraper.stop()
        store.close()
