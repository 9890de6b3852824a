"""``tokenmill collect``: another engine's OTLP traces and ``/metrics`` into a trace store.

Light top-level imports only (``tokenmill --help`` lists this command without loading DuckDB).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from tokenmill.engine.settings import (
    DATA_DIR,
    config_options,
    duration_seconds,
    from_options,
    setting,
)

from .cli import (
    check_logs,
    err,
    fail,
    open_store,
    refuse_open_bind,
    serve_setting,
    start_logs,
    store_kwargs,
)

app = typer.Typer(add_completion=False)

#: the largest OTLP export body (the receiver's own default, ``collect.MAX_BODY_BYTES``)
OTLP_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class CollectConfig:
    """Settings of ``tokenmill collect``: one field each, from which its options are generated
    (``engine/settings.py``). The interval is held as typed (``5s``); the trace store's, the
    logs' and the drain's settings are ``tokenmill serve``'s (``serve_setting``)."""

    trace_db: Path = setting(  # noqa: RUF009 - a field, not a shared default
        Path(DATA_DIR) / "collected.duckdb", "The trace-store file to fill (created if missing)."
    )
    scrape: list[str] | None = setting(  # noqa: RUF009
        None,
        "An engine's metrics URL to scrape, e.g. http://127.0.0.1:8000/metrics (vLLM, SGLang, "
        "llama.cpp with --metrics, TGI, tokenmill); repeatable.",
        metavar="URL",
    )
    scrape_interval: str = setting(
        "5s", "Time between scrapes: 1s, 5s, 1m; 0: never.", duration=True
    )
    engine_kind: str | None = setting(
        None,
        "vllm | sglang | llamacpp | tgi | tokenmill (default: read from the metric names).",
        metavar="KIND",
    )
    host: str = setting(
        "127.0.0.1",
        "Address of the OTLP/HTTP receiver. Anything but loopback needs --api-key or "
        "--admin-key (or --allow-unauthenticated).",
    )
    scrape_key: str | None = setting(
        None,
        "The bearer key the scraped /metrics want (a keyed tokenmill server's --metrics-key or "
        "admin key).",
        envvar="TOKENMILL_SCRAPE_KEY",
    )
    port: int = setting(4318, "Port of the OTLP/HTTP receiver (0: none).", min=0, max=65535)
    api_key: str | None = setting(
        None,
        "The key exporters send on POST /v1/traces (Authorization: Bearer KEY; an OTel SDK's "
        "OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer%20KEY); without --admin-key also the "
        "key of GET /admin/dump.",
        envvar="TOKENMILL_API_KEY",
    )
    admin_key: str | None = setting(
        None,
        "The key of GET /admin/dump (`diagnose --url`, `dashboard --source`), also taken on "
        "/v1/traces.",
        envvar="TOKENMILL_ADMIN_KEY",
    )
    allow_unauthenticated: bool = serve_setting(
        "allow_unauthenticated",
        "Serve a non-loopback --host with no key (anyone who reaches it may send traces).",
    )
    otlp_max_body_bytes: int = setting(
        OTLP_MAX_BODY_BYTES,
        "Largest OTLP export body, as sent or once inflated; past it a 413 while reading.",
        min=1024,
        metavar="BYTES",
    )
    shutdown_timeout: float = serve_setting(
        "shutdown_timeout",
        "A first SIGTERM or SIGINT (to the collector or its process group): new exports get "
        "503 with Retry-After, /health/ready 503, and those in hand get this long to be "
        "stored; a second signal stops at once.",
    )
    log_level: str = serve_setting(
        "log_level", "Logs on stderr from this level: debug, info, warning, error."
    )
    log_format: str = serve_setting("log_format")
    trace_retention: float | None = serve_setting("trace_retention")
    trace_max_bytes: int | None = serve_setting("trace_max_bytes")
    trace_archive: str | None = serve_setting("trace_archive")
    trace_archive_max_age: float | None = serve_setting("trace_archive_max_age")
    trace_archive_max_bytes: int | None = serve_setting("trace_archive_max_bytes")
    diagnose_every: float = serve_setting("diagnose_every")


@app.command()
@config_options(CollectConfig)
def collect(**options: Any) -> None:
    """Receive OTLP/HTTP traces on HOST:PORT/v1/traces and scrape engines' /metrics into a
    trace store, until Ctrl-C; a running collector hands out dumps on /admin/dump. Then
    `tokenmill diagnose --db TRACE_DB` (or `--url http://HOST:PORT`) reads it."""
    cfg: CollectConfig = from_options(CollectConfig, options)
    urls, interval = _check(cfg)
    gateway = _gateway(cfg)
    store = open_store(cfg.trace_db, **store_kwargs(cfg))
    from .scrape import MetricsScraper

    scrapers = [
        MetricsScraper(
            u, store.submit, interval_s=interval, kind=cfg.engine_kind, key=cfg.scrape_key
        ).start()
        for u in urls
    ]
    err.print(
        f"collecting into {cfg.trace_db}"
        + (f"; OTLP/HTTP traces on http://{cfg.host}:{cfg.port}/v1/traces" if cfg.port else "")
        + (f"; scraping {', '.join(urls)} every {cfg.scrape_interval}" if urls else "")
        + ("; not scraping (--scrape-interval 0)" if cfg.scrape and not urls else ""),
        highlight=False,
    )
    start_logs(cfg.log_level, cfg.log_format)
    try:
        _serve(cfg, store, scrapers, gateway)
    except KeyboardInterrupt:
        pass
    finally:
        for s in scrapers:
            s.stop()
        store.close()


def _check(cfg: CollectConfig) -> tuple[list[str], float]:
    """The URLs to scrape (none at interval 0) and the interval in seconds, or one ``error:``
    line."""
    from .engine_metrics import ENGINES

    try:
        interval = duration_seconds(cfg, "scrape_interval")
    except ValueError as exc:
        fail(str(exc))
    if cfg.engine_kind is not None and cfg.engine_kind not in ENGINES:
        fail(f"--engine-kind must be one of {', '.join(ENGINES)}, not {cfg.engine_kind!r}")
    urls = cfg.scrape or []
    for u in urls:
        if not u.startswith(("http://", "https://")):
            fail(f"--scrape {u}: give an http(s) URL, e.g. http://127.0.0.1:8000/metrics")
    if interval == 0:  # never: the URLs are checked, not scraped
        urls = []
    if not urls and cfg.port == 0:
        fail("nothing to collect: give --scrape URL, a --port for OTLP traces, or both")
    check_logs(cfg.log_level, cfg.log_format)
    if cfg.port:
        keyed = bool(cfg.api_key or cfg.admin_key)
        keys = "--api-key (or TOKENMILL_API_KEY) or --admin-key"
        refuse_open_bind(cfg.host, keyed, cfg.allow_unauthenticated, keys)
    return urls, interval


def _gateway(cfg: CollectConfig):
    """The collector's keys: exports take either key, a dump the admin key (the API key when
    it is the only one); no key: open (loopback, or ``--allow-unauthenticated``)."""
    from tokenmill.engine.api.gateway import Gateway, single_key_tenants

    for flag, key in (("--api-key", cfg.api_key), ("--admin-key", cfg.admin_key)):
        if key is not None and not key.strip():
            fail(f"{flag} is empty")
    if not (cfg.api_key or cfg.admin_key):
        return Gateway()
    api, admin = cfg.api_key or cfg.admin_key, cfg.admin_key or cfg.api_key
    return Gateway(single_key_tenants(api.strip(), admin.strip()))


def _serve(cfg: CollectConfig, store, scrapers: list, gateway) -> None:
    """The OTLP/HTTP receiver until a stop signal (drained: the exports in hand are stored),
    or (``--port 0``) the scrapers until one."""
    if cfg.port:
        from prometheus_client import CollectorRegistry

        from tokenmill.diagnose.live_service import start_live
        from tokenmill.engine.api.shutdown import serve_app

        from .collect import CollectorState, admin_check, make_app

        state = CollectorState(gateway)
        registry = CollectorRegistry()
        app = make_app(store, scrapers, state, max_body_bytes=cfg.otlp_max_body_bytes,
                       registry=registry)  # fmt: skip
        live = start_live(app, store, cfg.diagnose_every, registry, admin_check(gateway))

        def drain(cause: str) -> None:
            state.draining = True
            err.print(
                f"{cause}: storing {state.open_exports} exports in hand (up to "
                f"{cfg.shutdown_timeout:g} s); new exports get 503",
                highlight=False,
            )

        try:
            serve_app(
                app,
                cfg.host,
                cfg.port,
                busy=lambda: state.open_exports,
                on_drain=drain,
                drain_s=cfg.shutdown_timeout,
            )
        finally:
            if live is not None:
                live.stop()
    else:
        import signal
        import time

        from prometheus_client import CollectorRegistry

        from tokenmill.diagnose.live_service import start_live

        # no HTTP: the findings go to the store and the log only
        live = start_live(None, store, cfg.diagnose_every, CollectorRegistry(), None)
        # SIGTERM (systemd, a group stop) ends the scrapers as Ctrl-C does
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            while True:
                time.sleep(3600)
        finally:
            if live is not None:
                live.stop()
