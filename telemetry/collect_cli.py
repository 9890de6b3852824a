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

from .cli import err, fail, open_store

app = typer.Typer(add_completion=False)


@dataclass
class CollectConfig:
    """Settings of ``tokenmill collect``: one field each, from which its options are generated
    (``engine/settings.py``). The interval is held as typed (``5s``)."""

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
    host: str = setting("127.0.0.1", "Address of the OTLP/HTTP receiver.")
    scrape_key: str | None = setting(
        None,
        "The bearer key the scraped /metrics want (a keyed tokenmill server's --metrics-key or "
        "admin key).",
        envvar="TOKENMILL_SCRAPE_KEY",
    )
    port: int = setting(4318, "Port of the OTLP/HTTP receiver (0: none).", min=0, max=65535)


@app.command()
@config_options(CollectConfig)
def collect(**options: Any) -> None:
    """Receive OTLP/HTTP traces on HOST:PORT/v1/traces and scrape engines' /metrics into a
    trace store, until Ctrl-C. Then `tokenmill diagnose --db TRACE_DB` reads it."""
    cfg: CollectConfig = from_options(CollectConfig, options)
    urls, interval = _check(cfg)
    store = open_store(cfg.trace_db)
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
    try:
        _serve(cfg, store, scrapers)
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
    return urls, interval


def _serve(cfg: CollectConfig, store, scrapers: list) -> None:
    """The OTLP/HTTP receiver until a stop signal, or (``--port 0``) the scrapers until one."""
    if cfg.port:
        from tokenmill.engine.api.shutdown import serve_app

        from .collect import make_app

        # a stop signal ends it after the export in hand; the store keeps its last rows
        serve_app(make_app(store, scrapers), cfg.host, cfg.port)
    else:
        import signal
        import time

        # SIGTERM (systemd, a group stop) ends the scrapers as Ctrl-C does
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        while True:
            time.sleep(3600)
