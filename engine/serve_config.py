"""The server's own settings (address, keys, limits, trace store, logs, lifecycle): one field
each, from which ``tokenmill serve``'s options, their ``--config`` keys and ``TOKENMILL_*``
variables are generated (``engine/settings.py``: ``config_options``), as :class:`EngineConfig`'s
fields give the engine's. ``make_server`` (``engine/api/server.py``) takes the instance.

Durations take the one grammar of ``engine/durations.py`` (``30s``, ``10m``, ``2h``; a bare
number is seconds) and are held in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from . import settings
from .settings import DEFAULT_TRACE_DB

#: --help panels
SERVER_PANEL = "Server options (ServeConfig)"
FAULT_PANEL = "Fault drills (for tests and rehearsals, never production)"


def setting(
    default: Any,
    help: str,
    *,
    min: float | None = None,
    max: float | None = None,
    duration: bool = False,
    envvar: str | None = None,
    panel: str = SERVER_PANEL,
) -> Any:
    """A server field with its documentation and its option's shape (``settings.setting``, in
    the server's panel): ``duration`` takes the duration grammar (``min`` then in seconds);
    ``envvar`` a variable of its own beside the generated ``TOKENMILL_<FIELD>``."""
    return settings.setting(
        default, help, min=min, max=max, duration=duration, envvar=envvar, panel=panel
    )


@dataclass
class ServeConfig:
    """Settings of ``tokenmill serve`` outside the engine (see the module docstring)."""

    host: str = setting(
        "127.0.0.1",
        "Bind address. Anything but loopback needs --api-key or --tenants (or "
        "--allow-unauthenticated).",
    )
    port: int = setting(8000, "TCP port.", min=1, max=65535)
    tenants: str | None = setting(None, "Tenants TOML (API key hashes and limits).")
    api_key: str | None = setting(
        None,
        "One API key for every client (tenant 'default'); a tenants file for many.",
        envvar="TOKENMILL_API_KEY",
    )
    admin_key: str | None = setting(
        None, "The /admin/* key with --api-key.", envvar="TOKENMILL_ADMIN_KEY"
    )
    metrics_key: str | None = setting(
        None,
        "/metrics answers only 'Authorization: Bearer <this key>' or the admin key (its series "
        "name tenants).",
        envvar="TOKENMILL_METRICS_KEY",
    )
    open_metrics: bool = setting(
        False,
        "/metrics answers any caller without a key, also on a keyed server (a scraper inside "
        "a trusted network; its series name tenants). Off: /metrics follows the server's auth.",
    )
    allow_unauthenticated: bool = setting(
        False, "Serve a non-loopback --host with no API key (anyone who reaches it)."
    )
    served_model_name: str | None = setting(None, "Model id clients send (default: folder name).")
    max_queue_len: int = setting(
        64, "Requests that may wait beyond max-num-seqs before 429.", min=0
    )
    max_body_bytes: int = setting(2 << 20, "Largest request body accepted (bytes).", min=1024)
    trace_db: str | None = setting(
        None,
        "DuckDB trace store (spans, requests, steps, device samples); default "
        f"{DEFAULT_TRACE_DB}, printed absolute at start.",
    )
    trace_retention: float | None = setting(
        None,
        "Keep this long in the live store (30m, 24h, 7d); older rows roll out to Parquet dumps "
        "in --trace-archive, which `tokenmill diagnose FOLDER` reads as one.",
        duration=True,
        min=1.0,
    )
    trace_max_bytes: int | None = setting(
        None,
        "Past this size (bytes) the oldest half of the live store rolls out too.",
        min=1 << 20,
    )
    trace_archive: str | None = setting(
        None, "Where rolled-out rows go (default: archive/ beside the store)."
    )
    trace_archive_max_age: float | None = setting(
        None,
        "Delete archive folders older than this (30m, 24h, 7d) after each roll-out; the "
        "archive's small roll-outs are merged per hour (per day for earlier days) either way.",
        duration=True,
        min=1.0,
    )
    trace_archive_max_bytes: int | None = setting(
        None,
        "Then delete the oldest archive folders until the archive holds at most this (bytes).",
        min=1 << 20,
    )
    no_trace_db: bool = setting(False, "Keep no trace store (metrics and OTLP only).")
    trace_content: bool = setting(False, "Store prompt and output text on spans.")
    otlp_receiver: bool = setting(
        False,
        "Also take OTLP/HTTP traces (protobuf or JSON) on POST /v1/traces into the trace store, "
        "with the admin key: a gateway's or client's spans join the server's own traces.",
    )
    otlp_endpoint: str | None = setting(
        None, "OTLP collector, e.g. http://127.0.0.1:4318 (or OTEL_EXPORTER_OTLP_*)."
    )
    device_sample_interval: float = setting(
        0.1, "GPU/host sampling period (a duration; 0 = off).", duration=True
    )
    no_tracing: bool = setting(False, "Build no spans at all (only to measure tracing's cost).")
    engine_stall_degraded: float = setting(
        10.0,
        "/health says degraded after the engine core is silent this long (a duration; it sends "
        "a message every step, a heartbeat every 0.5 s when idle).",
        duration=True,
        min=0.1,
    )
    engine_stall_unavailable: float = setting(
        120.0,
        "/health answers 503 after the engine core is silent this long (a duration).",
        duration=True,
        min=0.1,
    )
    diagnose_every: float = setting(
        10.0,
        "Run the diagnosis over the live trace store this often (a duration); findings open "
        "and resolve in its `findings` table, on /metrics and on GET /v1/findings. 0: off.",
        duration=True,
        min=0.0,
    )
    log_level: str = setting(
        "info", "Server and engine logs on stderr from this level: debug, info, warning, error."
    )
    log_format: str = setting(
        "text", "text, or json (one object a line, with request and trace ids)."
    )
    access_log: bool = setting(
        False, "Log one line per completion request (method, path, status, ms, ids, tenant)."
    )
    engine_restart_limit: int = setting(
        5,
        "Engine core crashes (or failed restarts) within --engine-restart-window after which "
        "the server exits 1 instead of restarting it again.",
        min=1,
    )
    engine_restart_window: float = setting(
        300.0, "The window of --engine-restart-limit (a duration).", duration=True, min=1.0
    )
    shutdown_timeout: float = setting(
        30.0,
        "A first SIGTERM or SIGINT (to the server or its process group): refuse new requests "
        "(503, /health/ready 503) and let those in flight finish for up to this long (a "
        "duration) before they end with server_shutdown; a second signal stops at once.",
        duration=True,
    )
    fault_stream_delay_ms: float = setting(
        0.0,
        "Fault drill: the stream waits this long (ms) before each token chunk but the first.",
        min=0.0,
        max=60_000.0,
        panel=FAULT_PANEL,
    )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


__all__ = ["FAULT_PANEL", "SERVER_PANEL", "ServeConfig", "setting"]
