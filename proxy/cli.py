"""``tokenmill proxy``: front any OpenAI-compatible server and record what its clients see.

Light top-level imports only (``tokenmill --help`` lists this command without loading DuckDB).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from tokenmill.engine.serve_config import ServeConfig
from tokenmill.engine.settings import (
    DATA_DIR,
    config_options,
    duration_seconds,
    from_options,
    setting,
)
from tokenmill.telemetry.cli import (
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
class ProxyConfig:
    """Settings of ``tokenmill proxy``: one field each, from which its options are generated
    (``engine/settings.py``). Durations are held as typed (``60s``); :meth:`seconds` reads them."""

    upstream: str = setting(
        help="The upstream server's URL, e.g. http://127.0.0.1:8000 or its OpenAI base URL "
        "http://127.0.0.1:8000/v1 (vLLM, SGLang, llama.cpp's llama-server, TGI, tokenmill).",
        metavar="URL",
    )
    host: str = setting(
        "127.0.0.1",
        "Address to listen on. Anything but loopback needs --api-key or --tenants (or "
        "--allow-unauthenticated).",
    )
    port: int = setting(8080, "Port to listen on.", min=1, max=65535)
    trace_db: Path = setting(  # noqa: RUF009 - a field, not a shared default
        Path(DATA_DIR) / "proxy.duckdb",
        "The trace-store file the proxy writes (created if missing).",
    )
    first_byte_timeout: str = setting(
        "60s",
        "Longest wait for the upstream's first byte before a 504: 30s, 2m.",
        duration=True,
        allow_zero=False,
    )
    shutdown_timeout: str = setting(
        "30s",
        "A first SIGTERM or SIGINT (to the proxy or its process group): new requests get 503 "
        "and those in flight get this long to finish; a second signal stops at once.",
        duration=True,
    )
    api_key: str | None = setting(
        None,
        "The one key clients must send (Authorization: Bearer KEY); default: none.",
        envvar="TOKENMILL_API_KEY",
    )
    tenants: Path | None = setting(  # noqa: RUF009
        None, "A tenants file (keys, quotas), as `tokenmill serve --tenants`."
    )
    admin_key: str | None = setting(
        None,
        "The key of GET /admin/dump (`diagnose --url`, `dashboard --source`) and, with "
        "--otlp-receiver, POST /v1/traces; with --api-key (a tenants file has its own [admin] "
        "key).",
        envvar="TOKENMILL_ADMIN_KEY",
    )
    allow_unauthenticated: bool = serve_setting(
        "allow_unauthenticated",
        "Serve a non-loopback --host with no key (anyone who reaches it, through to the upstream).",
    )
    tokenizer: Path | None = setting(  # noqa: RUF009
        None,
        "The upstream model's tokenizer folder (tokenizer.json, tokenizer_config.json): prompts "
        "counted at the proxy, tenants' prompt limits held (default: sizes from the upstream's "
        "usage).",
        metavar="DIR",
    )
    max_in_flight: int = setting(
        0, "Requests forwarded at once; past it a 429 with Retry-After (0: no limit).", min=0
    )
    otlp_receiver: bool = setting(
        False,
        "Also take OTLP/HTTP traces on /v1/traces into TRACE_DB: point the upstream's exporter "
        "here and its request spans join the proxy's trace in one store.",
        flags=("--otlp-receiver/--no-otlp-receiver",),
    )
    scrape_interval: str = setting(
        "5s",
        "Scrape the upstream's /metrics this often into TRACE_DB (engine_samples: its queue, KV "
        "use, preemptions, for the diagnosis); 0: never.",
        duration=True,
    )
    max_body_bytes: int = setting(
        ServeConfig.max_body_bytes,
        "Largest request body forwarded; past it a 413 while reading (the server's own default).",
        min=1024,
        metavar="BYTES",
    )
    metrics_url: str | None = setting(
        None, "The upstream's metrics URL (default: UPSTREAM/metrics).", metavar="URL"
    )
    scrape_key: str | None = setting(
        None,
        "The bearer key the upstream's /metrics wants (a keyed tokenmill server's --metrics-key "
        "or admin key).",
        envvar="TOKENMILL_SCRAPE_KEY",
    )
    upstream_api_key: str | None = setting(
        None,
        "The key the upstream wants (default: the client's own Authorization).",
        envvar="TOKENMILL_UPSTREAM_API_KEY",
    )
    otlp_max_body_bytes: int = setting(
        OTLP_MAX_BODY_BYTES,
        "Largest OTLP export body on /v1/traces (--otlp-receiver), as sent or once inflated; "
        "past it a 413 while reading.",
        min=1024,
        metavar="BYTES",
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
    device_sample_interval: float = setting(
        0.5,
        "Sample this host's CPU (and who else uses it) this often when the upstream listens "
        "on this host, its process counted as the server's (a noisy neighbour's evidence); "
        "0: never.",
        duration=True,
    )

    def seconds(self, name: str) -> float:
        """The duration field ``name`` in seconds (ValueError: ``--name: bad duration ...``)."""
        return duration_seconds(self, name)


@app.command()
@config_options(ProxyConfig)
def proxy(**options: Any) -> None:
    """Forward /v1/chat/completions and /v1/completions to UPSTREAM unchanged, and record a
    request row and a trace per request (client-side TTFT, ITL, errors) in TRACE_DB, until
    Ctrl-C; a running proxy hands out dumps on /admin/dump. Then `tokenmill diagnose --db
    TRACE_DB` (or `--url http://HOST:PORT`) reads it."""
    cfg: ProxyConfig = from_options(ProxyConfig, options)
    upstream, metrics_url = _check_urls(cfg)
    try:
        timeout_s = cfg.seconds("first_byte_timeout")
        scrape_s = cfg.seconds("scrape_interval")  # 0: never
        shutdown_s = cfg.seconds("shutdown_timeout")
    except ValueError as exc:
        fail(str(exc))
    check_logs(cfg.log_level, cfg.log_format)
    gateway = _gateway(cfg)
    keys = "--api-key (or TOKENMILL_API_KEY) or --tenants"
    refuse_open_bind(cfg.host, not gateway.open_mode, cfg.allow_unauthenticated, keys)
    tok = _tokenizer(cfg.tokenizer)
    store = open_store(cfg.trace_db, **store_kwargs(cfg))
    from .app import ProxyState, build_proxy_app

    state = ProxyState(
        upstream,
        store.submit,
        gateway=gateway,
        first_byte_timeout_s=timeout_s,
        upstream_api_key=cfg.upstream_api_key,
        max_in_flight=cfg.max_in_flight,
        tokenizer=tok,
        max_body_bytes=cfg.max_body_bytes,
    )
    app = build_proxy_app(state, store)
    scraper = None
    if scrape_s > 0:
        from tokenmill.telemetry.scrape import MetricsScraper

        scraper = MetricsScraper(
            metrics_url, store.submit, interval_s=scrape_s, key=cfg.scrape_key
        ).start()
    if cfg.otlp_receiver:
        from tokenmill.telemetry.collect import add_receiver, key_check

        check = key_check(gateway)
        add_receiver(app, store, request_rows=False, authenticate=check,
                     max_body_bytes=cfg.otlp_max_body_bytes)  # fmt: skip
    from tokenmill.diagnose.live_service import start_live
    from tokenmill.telemetry.collect import admin_check

    _record_start(store, upstream)
    sampler = _host_sampler(upstream, store, cfg.device_sample_interval)
    live = start_live(app, store, cfg.diagnose_every, state.metrics.registry, admin_check(gateway))
    where = f"http://{cfg.host}:{cfg.port}"
    err.print(
        f"proxying {where} → {upstream}; recording into {cfg.trace_db}"
        + (f"; OTLP/HTTP traces on {where}/v1/traces" if cfg.otlp_receiver else "")
        + (f"; scraping {metrics_url} every {cfg.scrape_interval}" if scraper else "")
        + (f"; sampling this host every {cfg.device_sample_interval:g} s" if sampler else ""),
        highlight=False,
    )
    try:
        _serve(cfg, app, state, shutdown_s)
    finally:
        if live is not None:
            live.stop()
        if scraper is not None:
            scraper.stop()
        if sampler is not None:
            sampler.stop()
        store.close()


def _record_start(store, upstream: str) -> None:
    """The ``proxy_start`` event: which upstream this store's requests went to (a finding
    about the upstream names it)."""
    import json
    import time

    store.submit(
        "events",
        {
            "time_ns": time.time_ns(),
            "kind": "proxy_start",
            "severity": "info",
            "message": f"proxying to {upstream}",
            "attributes": json.dumps({"upstream": upstream}),
        },
    )


def _serve(cfg: ProxyConfig, app, state, shutdown_s: float) -> None:
    """Serve until a stop signal, logging as ``--log-level``/``--log-format`` say: the first
    signal drains (new requests 503, those in flight get ``--shutdown-timeout``)."""
    from tokenmill.engine.api.shutdown import serve_app

    def drain(cause: str) -> None:
        state.draining = True
        err.print(
            f"{cause}: draining {state.open_requests} requests in flight (up to "
            f"{shutdown_s:g} s); new requests get 503",
            highlight=False,
        )

    start_logs(cfg.log_level, cfg.log_format)
    serve_app(
        app,
        cfg.host,
        cfg.port,
        busy=lambda: state.open_requests,
        on_drain=drain,
        on_stop=state.stop,
        drain_s=shutdown_s,
    )


def _host_sampler(upstream: str, store, interval_s: float):
    """The host sampler of an upstream on this host (``device_samples`` host rows, the
    upstream's process counted with the proxy's, found by the port it listens on), started;
    None when ``interval_s`` is 0 or the upstream is on another host. While its process is not
    found, a row says nothing about the CPU outside the server (the upstream's own use would
    read as a neighbour's)."""
    from urllib.parse import urlsplit

    from tokenmill.telemetry.host_procs import LOOPBACK_NAMES, ListeningProcess
    from tokenmill.telemetry.sampler import DeviceSampler

    parts = urlsplit(upstream)
    if interval_s <= 0 or (parts.hostname or "") not in LOOPBACK_NAMES:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    upstream_pids = ListeningProcess(port)

    def sink(row: dict) -> None:
        if not upstream_pids():
            row["cpu_others_pct"] = row["busy_others"] = row["loadgen_cpu_pct"] = None
        store.submit("device_samples", row)

    sampler = DeviceSampler(sink, interval_s, pids=upstream_pids, use_nvml=False)
    sampler.start()
    return sampler


def _check_urls(cfg: ProxyConfig) -> tuple[str, str]:
    """The upstream's base URL and its metrics URL, or one ``error:`` line."""
    if not cfg.upstream.startswith(("http://", "https://")):
        fail(f"--upstream {cfg.upstream}: give an http(s) URL, e.g. http://127.0.0.1:8000")
    # the OpenAI base URL, as every client writes it (…/v1), names the same server
    from tokenmill.telemetry.remote import normalize_url

    upstream = normalize_url(cfg.upstream)
    metrics_url = cfg.metrics_url or upstream.rstrip("/") + "/metrics"
    if not metrics_url.startswith(("http://", "https://")):
        fail(f"--metrics-url {metrics_url}: give an http(s) URL")
    return upstream, metrics_url


def _gateway(cfg: ProxyConfig):
    """The clients' keys (``--tenants``, ``--api-key`` or none) and the admin key (a tenants
    file's ``[admin]``, or ``--admin-key`` with ``--api-key``), as ``serve`` takes them; or one
    ``error:`` line."""
    from tokenmill.engine.api.gateway import (
        Gateway,
        TenantsFileError,
        load_tenants,
        single_key_tenants,
    )

    if cfg.api_key is not None and cfg.tenants is not None:
        fail("give --api-key or --tenants, not both")
    if cfg.admin_key and not cfg.api_key:
        fail("--admin-key goes with --api-key (a tenants file has its own [admin] key)")
    try:
        if cfg.tenants is not None:
            return Gateway(load_tenants(cfg.tenants))
        if cfg.api_key is not None:
            if not cfg.api_key.strip():
                fail("--api-key (TOKENMILL_API_KEY) is empty")
            admin = cfg.admin_key.strip() if cfg.admin_key else None
            return Gateway(single_key_tenants(cfg.api_key.strip(), admin))
        return Gateway()
    except TenantsFileError as exc:
        fail(str(exc))


def _tokenizer(folder: Path | None):
    """``--tokenizer``'s tokenizer (None without one), or one ``error:`` line."""
    if folder is None:
        return None
    from tokenmill.engine.errors import ModelLoadError
    from tokenmill.engine.tokenizer import load_tokenizer

    if not folder.exists():
        fail(f"--tokenizer {folder}: no such folder")
    try:
        return load_tokenizer(folder)
    except ModelLoadError as exc:
        fail(f"--tokenizer: {exc}")
