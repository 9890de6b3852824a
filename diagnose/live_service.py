"""The live diagnosis running beside a writer of the store: ``serve``, ``proxy`` and ``collect``.

:class:`LiveService` runs :class:`~.live.LiveDiagnosis` every ``period_s`` in a background
thread of low priority. Each tick reads through a cursor of its own on the store's database
(DuckDB's snapshot reads: the writer is never held back, and a reader never sees half a batch);
only taking the cursor holds the store's lock, for microseconds. A tick that fails (a store
being reopened) is counted and the next one tries again; nothing in it can raise into serving.

It exports, into the host's Prometheus registry:

- ``tokenmill_finding_active{rule, severity}``: 1 while a finding of ``rule`` is open, 0 once it
  resolved (the series stays, so that an alert on it resolves too);
- ``tokenmill_finding_confidence{rule}``: the open finding's confidence (0 once resolved);
- ``tokenmill_findings_opened_total{rule}``: findings opened;
- ``tokenmill_diagnosis_run_seconds``: the wall time of each tick, and
  ``tokenmill_diagnosis_cpu_seconds_total`` the CPU time of all of them (the loop's own cost);
- ``tokenmill_diagnosis_runs_total{outcome}``: ticks by outcome (``judged``, ``no_traffic``,
  ``error``).

and :func:`add_findings_route` adds ``GET /v1/findings`` (the open, pending and recently
resolved findings as JSON) behind the host's admin check.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .live import NS, LiveDiagnosis, LiveSettings, TickResult
from .signals.host_bursts import LIVE_RUN_EVENT

#: seconds a run waits past the store's flush interval after its window closes
SETTLE_S = 0.5

log = logging.getLogger(__name__)

#: the loop's run-time buckets (s): a tick over three 10 s windows takes a few hundred ms
RUN_BUCKETS_S = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)


class LiveMetrics:
    """The series above, in ``registry``."""

    def __init__(self, registry: CollectorRegistry):
        self.active = Gauge(
            "tokenmill_finding_active",
            "1 while a live finding of the rule is open, 0 once it resolved.",
            ["rule", "severity"],
            registry=registry,
        )
        self.confidence = Gauge(
            "tokenmill_finding_confidence",
            "The open live finding's confidence, 0..1 (0 once resolved).",
            ["rule"],
            registry=registry,
        )
        self.opened = Counter(
            "tokenmill_findings_opened",
            "Live findings opened.",
            ["rule"],
            registry=registry,
        )
        self.run_seconds = Histogram(
            "tokenmill_diagnosis_run_seconds",
            "Wall time of one live diagnosis period's run (s).",
            buckets=RUN_BUCKETS_S,
            registry=registry,
        )
        self.cpu_seconds = Counter(
            "tokenmill_diagnosis_cpu_seconds",
            "CPU time the live diagnosis' runs took (s): its cost to the host.",
            registry=registry,
        )
        self.runs = Counter(
            "tokenmill_diagnosis_runs",
            "Live diagnosis runs, by outcome: judged, no_traffic, error.",
            ["outcome"],
            registry=registry,
        )

    def update(self, loop: LiveDiagnosis, res: TickResult) -> None:
        self.run_seconds.observe(res.seconds)
        self.cpu_seconds.inc(res.cpu_seconds)
        outcome = "error" if res.error else ("no_traffic" if res.no_traffic else "judged")
        self.runs.labels(outcome).inc()
        for f in res.opened:
            self.opened.labels(f.rule_id).inc()
        for f in res.resolved:
            self.active.labels(f.rule_id, f.latest.severity).set(0)
            self.confidence.labels(f.rule_id).set(0)
        for f in loop.open_findings():
            for sev in ("warning", "critical"):  # a finding that changed grade moves series
                if sev != f.latest.severity:
                    self.active.labels(f.rule_id, sev).set(0)
            self.active.labels(f.rule_id, f.latest.severity).set(1)
            self.confidence.labels(f.rule_id).set(f.latest.confidence)


class LiveService:
    """The loop's thread over ``store`` (a ``TraceStore``), reporting to ``metrics``."""

    def __init__(
        self,
        store,
        settings: LiveSettings,
        *,
        metrics: LiveMetrics | None = None,
        clock: Callable[[], int] = time.time_ns,
    ):
        self.store = store
        self.loop = LiveDiagnosis(settings, write=store.submit)
        self.metrics = metrics
        self.clock = clock
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the loop's state against /v1/findings readers
        self._thread = threading.Thread(
            target=self._run, name="tokenmill-live-diagnosis", daemon=True
        )

    def start(self) -> LiveService:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def snapshot(self) -> dict:
        with self._lock:
            return self.loop.to_json()

    def run_once(self) -> TickResult | None:
        """One tick now (the thread's body; tests call it directly)."""
        try:
            with self.store.connection_locked() as con:
                cur = con.cursor()
        except Exception as exc:  # no store open right now: try next period
            log.debug("live diagnosis: no store: %s", exc)
            return None
        try:
            with self._lock:
                res = self.loop.tick(cur, self.clock())
        finally:
            cur.close()
        self._record_run(res)
        if self.metrics is not None:
            self.metrics.update(self.loop, res)
        for f in res.opened:
            log.warning(
                "finding opened: %s (%s): %s", f.rule_id, f.latest.severity, f.latest.summary
            )
        for f in res.resolved:
            log.warning("finding resolved: %s", f.rule_id)
        return res

    def _record_run(self, res: TickResult) -> None:
        """The run's own interval as a ``live_diagnosis_run`` event: its CPU slices may slow
        what runs beside it, and the rules that look for a periodic cause leave those moments
        out rather than name the loop's own period (``signals/host_bursts.py: own_runs``)."""
        end_ns = res.now_ns + int(res.seconds * 1e9)
        self.store.submit(
            "events",
            {
                "time_ns": res.now_ns,
                "kind": LIVE_RUN_EVENT,
                "severity": "info",
                "message": "",
                "attributes": json.dumps(
                    {"end_ns": end_ns, "cpu_s": round(res.cpu_seconds, 4), "held": res.held}
                ),
            },
        )

    def _run(self) -> None:
        from tokenmill.telemetry.store import lower_thread_priority

        # the other telemetry threads' nice (10). Lower costs the loop its timing when the
        # engine is busy: at 19 the live soak's findings opened 1-2 periods later, and under a
        # CPU hog not until it stopped; SCHED_IDLE made a run longer than its period. At 10 its
        # time slices stretch some decode steps in the second after a run, which is why a run
        # is kept short (benchmarks/RESULTS.md)
        lower_thread_priority()
        while not self._stop.wait(self.wait_s()):
            try:
                self.run_once()
            except Exception:  # never let one tick end the loop
                log.exception("live diagnosis tick failed")

    def wait_s(self) -> float:
        """Seconds until the next run: just after the next window closes on the period's
        grid, once the store has flushed the rows of its last second (``SETTLE_S`` past it, or
        the store's flush interval and half a second). A run at a random moment of the period
        judged a window that had closed up to a whole period earlier; one run per period,
        whatever a run took."""
        period_ns = int(self.loop.settings.period_s * NS)
        settle_ns = int(1e9 * (getattr(self.store, "flush_interval_s", 1.0) + SETTLE_S))
        now = self.clock()
        nxt = (now - settle_ns) // period_ns * period_ns + period_ns + settle_ns
        return (nxt - now) / 1e9


def add_findings_route(app, service: LiveService | None, authenticate: Callable) -> None:
    """``GET /v1/findings`` on ``app``: the loop's findings as JSON. ``authenticate(request)``
    answers a refused caller's response (401/403), None for one it lets in. Without a loop
    (``--diagnose-every 0`` or no store) a 503 says so."""

    @app.get("/v1/findings")
    async def findings(request: Request):
        refusal = authenticate(request)
        if refusal is not None:
            return refusal
        if service is None:
            return JSONResponse(
                {
                    "error": {
                        "message": "live diagnosis is off (--diagnose-every 0, or no trace store)",
                        "type": "unavailable",
                        "param": None,
                        "code": "live_diagnosis_off",
                    }
                },
                status_code=503,
            )
        return JSONResponse(service.snapshot())


def start_live(
    app, store, period_s: float, registry: CollectorRegistry, authenticate: Callable | None
) -> LiveService | None:
    """The live diagnosis of a writing command (``proxy``, ``collect``): ``GET /v1/findings``
    on ``app`` (None: no HTTP, no route) and, unless ``period_s`` is 0, the loop over ``store``
    started (the caller stops it) with its series in ``registry``."""
    service = None
    if period_s > 0 and store is not None:
        settings = LiveSettings(period_s=period_s)
        service = LiveService(store, settings, metrics=LiveMetrics(registry)).start()
    if app is not None:
        add_findings_route(app, service, authenticate)
    return service
