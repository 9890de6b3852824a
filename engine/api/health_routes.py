"""``/health``, ``/health/live``, ``/health/ready`` and ``/metrics`` routes."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from ..messages import IDLE_KV_LEAK_SHARE
from .server_state import DRAIN_RETRY_S, ServerState


def register_health_routes(app: FastAPI, state: ServerState) -> None:
    """The health routes (unkeyed) and ``/metrics`` (keyed with ``--metrics-key``)."""
    scrape = MetricsScrape(state)

    @app.get("/health/live")
    async def live():
        """Liveness: the API process answers (its event loop runs). Never restart on
        anything else: an engine restarting or a drain is not a dead process."""
        return {"status": "alive"}

    @app.get("/health/ready")
    async def ready():
        """Readiness, for a load balancer: 200 while new requests can be served; 503
        ``draining`` from SIGTERM on, ``starting``/``restarting``/``down`` while no engine
        core serves, ``stalled`` when every serving core is silent past
        ``--engine-stall-unavailable``."""
        return readiness(state)

    @app.get("/health")
    async def health():
        return health_report(state)

    @app.get("/metrics")
    async def metrics(request: Request):
        """The Prometheus exposition, rendered per scrape (current: nothing is cached).

        The gauges read from the worker are set here on the event loop; the text is rendered in
        a worker thread, since with many tenants (1,853 series) it takes 16-48 ms that would
        otherwise stall every stream. prometheus_client is thread-safe for this (each metric's
        children and each value sit behind their own locks); a histogram observed during the
        render may show its new count before its new sum, as with any threaded exporter.
        Renders are serialized so concurrent scrapers never hold several threads at once.
        With ``--metrics-key`` a scrape needs that key (the series name tenants).
        """
        return await scrape(request)


def memory_fields(model_info: dict) -> dict:
    """``/health``'s memory fields from ``EngineReady.model_info``: ``weight_bytes_total``,
    ``weight_bytes_by_dtype`` (bytes by storage dtype, int4 as ``int4``) and
    ``kv_cache_bytes`` (the KV pool); None while no engine has reported them."""
    return {
        "weight_bytes_total": model_info.get("weight_bytes_total"),
        "weight_bytes_by_dtype": model_info.get("weight_bytes_by_dtype"),
        "kv_cache_bytes": model_info.get("kv_cache_bytes"),
    }


def readiness(state: ServerState) -> JSONResponse:
    """``/health/ready``'s answer: ``ready`` (200), else why not (503 with Retry-After)."""
    can = state.worker.can_serve
    if state.draining or state.shutting_down:
        status = "draining"
    elif not can:
        status = state.worker.health()["state"]
    else:
        stall = state.worker.stall(state.engine_stall_degraded_s, state.engine_stall_unavailable_s)
        status = "stalled" if stall is not None and stall[0] == "unavailable" else "ready"
    code = 200 if status == "ready" else 503
    headers = {"Retry-After": str(DRAIN_RETRY_S)} if code == 503 else None
    return JSONResponse({"status": status}, status_code=code, headers=headers)


def health_report(state: ServerState) -> JSONResponse:
    """``/health``: ok, degraded (a restarting or silent engine, KV blocks held while idle) or
    down (503), with the engine's state, the queue, the KV pool, memory and telemetry."""
    w = state.worker.health()
    stats = w["stats"]
    status = "ok" if state.worker.ready else ("degraded" if w["state"] == "restarting" else "down")
    reasons = []
    http_status = 200 if status != "down" else 503
    stall = state.worker.stall(state.engine_stall_degraded_s, state.engine_stall_unavailable_s)
    # checked while any replica serves: with one replica restarting, a silent other is
    # the difference between degraded and serving nothing
    if status != "down" and stall is not None:
        severity, reason = stall  # a frozen or hung engine process (still alive)
        status = "degraded"
        reasons.append(reason)
        if severity == "unavailable":
            http_status = 503
    used, total = stats.get("kv_blocks_used") or 0, stats.get("kv_blocks_total") or 0
    idle = not stats.get("num_running") and not stats.get("num_waiting")
    if status == "ok" and idle and total and used / total > IDLE_KV_LEAK_SHARE:
        status = "degraded"  # nothing runs, yet KV blocks stay taken: a leak (case C05)
        reasons.append(f"{used} of {total} KV blocks in use with nothing running or waiting")
    body = {
        "status": status,
        "model": state.model_name,
        "engine": w,
        "queue_depth": state.admission.queue_depth + stats.get("num_waiting", 0),
        "in_flight": state.admission.in_flight,
        "kv_usage": stats.get("kv_usage"),
        "kv_blocks_used": stats.get("kv_blocks_used"),
        "kv_blocks_total": stats.get("kv_blocks_total"),
        **memory_fields(state.worker.info.get("model_info") or {}),
        "telemetry": state.telemetry.health(),
        "reasons": reasons,
        "draining": state.draining,
    }
    body["telemetry_dropped"] = body["telemetry"]["dropped_total"]
    return JSONResponse(body, status_code=http_status)


class MetricsScrape:
    """``/metrics``: the worker's gauges set on the event loop, the text rendered in a worker
    thread, one render at a time (a scrape waiting renders its own)."""

    def __init__(self, state: ServerState):
        self.state = state
        self.render_lock = asyncio.Lock()

    async def __call__(self, request: Request) -> Response:
        state = self.state
        state.gateway.authenticate_metrics(request.headers.get("authorization"))
        m = state.telemetry.metrics
        self.set_engine_gauges(m)
        if not state.metrics_off_loop:
            body, content_type = m.render()
        else:
            async with self.render_lock:
                body, content_type = await run_in_threadpool(m.render)
        return Response(body, media_type=content_type)

    def set_engine_gauges(self, m) -> None:
        """The engine and replica gauges and the heartbeat age, from the worker as it is now."""
        state = self.state
        w = state.worker.health()
        stats = w["stats"]
        for r in w.get("replicas", ()):
            # a replica that is not serving (restarting, down) runs nothing and holds no KV:
            # zeros, not the last values it reported before it went
            up = r.get("state") == "ready"
            rs = r["stats"] if up else {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0}
            m.set_replica_state(
                r["replica"],
                running=rs.get("num_running"),
                waiting=rs.get("num_waiting"),
                kv_usage=rs.get("kv_usage"),
                outstanding_tokens=r["outstanding_tokens"],
            )
        m.set_engine_state(
            running=stats.get("num_running", 0),
            waiting=stats.get("num_waiting", 0),
            kv_usage=stats.get("kv_usage") or 0.0,
            restarts=state.worker.restarts,
            in_flight=state.admission.in_flight,
        )
        m.set_heartbeat_age(state.worker.heartbeat_age_s)
