"""``tokenmill serve``: build the stations, start the engine worker, run uvicorn."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from pathlib import Path

import uvicorn

from ..config import EngineConfig
from ..model_config import load_model_config
from ..model_fetch import resolve_model_dir
from ..serve_config import ServeConfig
from ..tokenizer import load_tokenizer
from .app import build_app
from .engine_setup import engine_workers, serving_cores
from .errors import APIError
from .gateway import (
    Gateway,
    TenantsFileError,
    hash_key,
    is_loopback,
    load_tenants,
    single_key_tenants,
)
from .handle import EngineHandle
from .lifecycle import ServerLifecycle
from .server_state import ServerState
from .shutdown import DrainingServer
from .start_line import engine_line as engine_line  # importable from here, as before
from .stations import AdmissionStation, MeteringStation, TokenizeStation

log = logging.getLogger("tokenmill.serve")


class Unauthenticated(TenantsFileError):
    """A server that would answer anyone on a non-loopback address (one line)."""


def configured_tenants(tenants_file: str | None, api_key: str | None, admin_key: str | None):
    """The tenants from the tenants file or ``--api-key`` (None: open local mode)."""
    if tenants_file and api_key:
        raise TenantsFileError("give --api-key or --tenants, not both")
    if admin_key and not api_key:
        raise TenantsFileError(
            "--admin-key goes with --api-key (a tenants file has its own [admin] key)"
        )
    if tenants_file:
        return load_tenants(tenants_file)
    if api_key is not None:
        if not api_key.strip():
            raise TenantsFileError("--api-key (TOKENMILL_API_KEY) is empty")
        return single_key_tenants(api_key.strip(), admin_key)
    return None


def make_server(
    config: EngineConfig, serve: ServeConfig | None = None, *, announce=print
) -> uvicorn.Server:
    """A configured uvicorn server whose startup launches the engine worker.

    ``serve`` (default: every :class:`ServeConfig` default) holds the server's settings, each
    field documented there: the address and keys (a tenants file, or one API key with an admin
    key; without a key only loopback is served unless ``allow_unauthenticated``), the trace
    store and its roll-outs (``telemetry/retention.py``), the stall thresholds of ``/health``,
    the restart limit (past it ``server.fatal_error`` says why and the CLI exits 1), the SIGTERM
    drain and the stream fault drill (case C03: a per-chunk delay after the first token).

    Raises:
        TenantsFileError, ModelLoadError: bad tenants file or model folder (before any start).
        Unauthenticated: a non-loopback ``host`` with no key and no ``allow_unauthenticated``.
    """
    opts = serve or ServeConfig()
    tenants = configured_tenants(opts.tenants, opts.api_key, opts.admin_key)
    if opts.open_metrics and opts.metrics_key:
        raise ValueError("--open-metrics opens /metrics to any caller: drop it or --metrics-key")
    trace_db, retention = _trace_store(opts)
    if tenants is None and not is_loopback(opts.host) and not opts.allow_unauthenticated:
        raise Unauthenticated(
            f"refusing to serve {opts.host} without API keys: give --api-key (or TOKENMILL_API_KEY) "
            "or --tenants, or --allow-unauthenticated to serve it open"
        )
    model_dir = resolve_model_dir(config.model)
    config.model = str(model_dir)
    load_model_config(model_dir)  # a missing folder or config.json says so before any start
    tokenizer_load = _load_tokenizer_in_background(model_dir)
    if tenants is None and not is_loopback(opts.host):
        log.warning("serving %s with no API keys (--allow-unauthenticated)", opts.host)
    worker = engine_workers(config)
    name = opts.served_model_name or Path(model_dir).name
    telemetry = _build_telemetry(name, opts, trace_db, retention)
    state = _build_state(config, opts, worker, tenants, name, telemetry)
    lifecycle = ServerLifecycle(
        config=config,
        opts=opts,
        worker=worker,
        telemetry=telemetry,
        state=state,
        tokenizer_load=tokenizer_load,
        tenants=tenants,
        announce=announce,
    )
    _wire_worker(worker, telemetry, state, lifecycle, opts)
    app = build_app(state)
    app.router.lifespan_context = lifecycle.lifespan
    if opts.otlp_receiver and telemetry.store is not None:
        _add_otlp_receiver(app, state, telemetry)
    _add_live_diagnosis(app, opts, state, telemetry, lifecycle)
    lifecycle.server = _draining_server(app, opts, lifecycle, state)
    return lifecycle.server


def _add_live_diagnosis(app, opts: ServeConfig, state, telemetry, lifecycle) -> None:
    """The live diagnosis over the trace store (``diagnose/live_service.py``), started and
    stopped with the app, and ``GET /v1/findings`` behind the admin key."""
    from tokenmill.diagnose.live import LiveSettings
    from tokenmill.diagnose.live_service import LiveMetrics, LiveService, add_findings_route
    from tokenmill.telemetry.collect import admin_check

    service = None
    if opts.diagnose_every > 0 and telemetry.store is not None:
        settings = LiveSettings(period_s=opts.diagnose_every)
        metrics = LiveMetrics(telemetry.metrics.registry)
        service = LiveService(telemetry.store, settings, metrics=metrics)
        serving = lifecycle.lifespan

        @contextlib.asynccontextmanager
        async def lifespan(app):
            async with serving(app):
                service.start()
                try:
                    yield
                finally:
                    service.stop()

        app.router.lifespan_context = lifespan

    add_findings_route(app, service, admin_check(state.gateway))


def _trace_store(opts: ServeConfig) -> tuple[str | None, dict]:
    """The trace store's path (None: no store) and its retention settings.

    Raises:
        ValueError: ``--otlp-receiver`` without a store to write into.
    """
    from tokenmill.telemetry.store import default_trace_db

    trace_db = None if opts.no_trace_db or opts.no_tracing else (opts.trace_db or "default")
    retention = {
        "retention_s": opts.trace_retention,
        "max_bytes": opts.trace_max_bytes,
        "archive": opts.trace_archive,
        "archive_max_age_s": opts.trace_archive_max_age,
        "archive_max_bytes": opts.trace_archive_max_bytes,
    }
    if trace_db is not None:
        trace_db = default_trace_db(None if trace_db == "default" else trace_db)
    elif opts.otlp_receiver:
        raise ValueError("--otlp-receiver stores what it takes: it needs the trace store "
                         "(drop --no-trace-db / --no-tracing)")  # fmt: skip
    return trace_db, retention


def _load_tokenizer_in_background(model_dir) -> concurrent.futures.Future:
    """The API's tokenizer (2-3 s, most of it importing transformers) loads while the engine
    core starts instead of before it; the lifespan waits for both. A bad tokenizer still
    fails the start with the loader's one line (the engine core loads the same files)."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer-load")
    tokenizer_load = pool.submit(load_tokenizer, model_dir)
    pool.shutdown(wait=False)
    return tokenizer_load


def _build_telemetry(name: str, opts: ServeConfig, trace_db: str | None, retention: dict):
    """The composition root: the ``Telemetry`` (trace store, OTLP export, device samples,
    ``/metrics``) the API reports to; the API sees it only through its calls."""
    from tokenmill.telemetry.hub import Telemetry

    return Telemetry(
        name,
        trace_db=trace_db,
        tracing=not opts.no_tracing,
        otlp_endpoint=opts.otlp_endpoint,
        device_sample_interval_s=opts.device_sample_interval,
        trace_content=opts.trace_content,
        retention=retention,
    )


def _build_state(
    config: EngineConfig, opts: ServeConfig, worker: EngineHandle, tenants, name: str, telemetry
) -> ServerState:
    """The stations and settings the routes share; the engine's stall thresholds."""
    state = ServerState(
        worker=worker,
        gateway=Gateway(
            tenants,
            metrics_key_sha256=hash_key(opts.metrics_key) if opts.metrics_key else None,
            open_metrics=opts.open_metrics,
        ),
        tokenize=TokenizeStation(None, config.max_model_len or 1 << 30, 1 << 31),
        admission=AdmissionStation(config.max_num_seqs * serving_cores(config), opts.max_queue_len),
        metering=MeteringStation(),
        model_name=name,
        max_body_bytes=opts.max_body_bytes,
        block_size=config.block_size,
        telemetry=telemetry,
        trace_content=opts.trace_content,
        fault_stream_delay_s=opts.fault_stream_delay_ms / 1000.0,
        access_log=opts.access_log,
    )
    state.engine_stall_degraded_s = opts.engine_stall_degraded
    state.engine_stall_unavailable_s = max(
        opts.engine_stall_unavailable, opts.engine_stall_degraded
    )
    worker.silent_after_s = state.engine_stall_degraded_s
    return state


def _wire_worker(
    worker: EngineHandle, telemetry, state: ServerState, lifecycle: ServerLifecycle, opts
) -> None:
    """What the engine worker reports to: its steps, abandoned requests' final records and
    events go to telemetry (and the final records to the state, which records their requests);
    its restart limit; a crash loop stops the server."""
    # replicas, or both sides' engine cores: the state gauges then come per replica
    telemetry.metrics.data_parallel_size = len(worker.workers)
    worker.add_step_listener(telemetry.on_step)
    worker.add_abandoned_listener(telemetry.on_abandoned)
    worker.add_abandoned_listener(state.on_engine_final)
    worker.add_event_listener(
        lambda kind, sev, msg, **attrs: telemetry.event(kind, sev, msg, **attrs)
    )
    for w in worker.workers:
        w.max_crashes, w.crash_window_s = opts.engine_restart_limit, opts.engine_restart_window
    worker.add_event_listener(lifecycle.on_engine_event)


def _add_otlp_receiver(app, state: ServerState, telemetry) -> None:
    """``--otlp-receiver``: ``/v1/traces`` behind the admin key, into the server's own store
    (the server writes its own request rows; a received engine span adds none)."""
    from tokenmill.telemetry.collect import add_receiver

    def admin_only(request):
        client = request.client.host if request.client else None
        try:
            state.gateway.authenticate_admin(request.headers.get("authorization"), client)
        except APIError as exc:
            return exc.response(getattr(request.state, "request_id", None))
        return None

    add_receiver(app, telemetry.store, request_rows=False, authenticate=admin_only)


def _draining_server(
    app, opts: ServeConfig, lifecycle: ServerLifecycle, state: ServerState
) -> DrainingServer:
    """uvicorn's config and the server whose stop signals drain (``shutdown.py``)."""
    uv_config = uvicorn.Config(
        app,
        host=opts.host,
        port=opts.port,
        log_level="warning",
        log_config=None,  # its lines go through the server's handler (engine/logs.py)
        timeout_graceful_shutdown=5,
    )
    return DrainingServer(
        uv_config,
        on_stop=lifecycle.stop,
        on_drain=lifecycle.drain,
        busy=lambda: state.open_requests,
        drain_s=opts.shutdown_timeout,
    )
