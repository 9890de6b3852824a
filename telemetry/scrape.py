"""Scrape an engine's ``/metrics`` at a fixed interval into the store's ``engine_samples``.

One :class:`MetricsScraper` per URL, on a thread of its own. What goes wrong is said once per
streak, in one warning line, and the scraper keeps trying: a ``/metrics`` that 404s (the
engine does not serve metrics, or llama.cpp's server started without ``--metrics``), an
upstream that is down, text that is not Prometheus exposition format, or metrics of no engine
kind tokenmill knows (then only the client-side view exists). :attr:`MetricsScraper.status`
says where it stands, for ``/health`` and the report.

llama.cpp's server also answers ``GET /slots`` (unless started with ``--no-slots``): for a
llama.cpp engine each scrape reads it too and fills what the metrics leave out (KV use,
estimated from the busy slots' tokens: ``engine_metrics.read_slots``). A server that refuses
``/slots`` is said once and not asked again; the metrics row is written either way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import httpx
import msgspec

from .engine_metrics import (
    ENGINES,
    CounterResets,
    MetricsFormatError,
    missing_signals,
    read_exposition,
    read_slots,
)

log = logging.getLogger("tokenmill.scrape")


class MetricsScraper:
    """Scrape ``url`` every ``interval_s`` seconds and hand each row to ``submit(table, row)``.

    Args:
        url: the engine's metrics URL (``http://host:port/metrics``).
        submit: the store's ``submit`` (``TraceStore.submit``).
        kind: force an engine kind (``vllm``, ``sglang``, ``llamacpp``, ``tgi``, ``tokenmill``);
            None: read it from the metric names.
        slots_url: llama.cpp's ``/slots`` (default: beside ``url`` when it ends in
            ``/metrics``); read only for a llama.cpp engine.
    """

    def __init__(
        self,
        url: str,
        submit: Callable[[str, dict], bool],
        *,
        interval_s: float = 5.0,
        timeout_s: float = 5.0,
        kind: str | None = None,
        client: httpx.Client | None = None,
        slots_url: str | None = None,
        key: str | None = None,
    ):
        if kind is not None and kind not in ENGINES:
            raise ValueError(f"unknown engine kind {kind!r}; known: {', '.join(ENGINES)}")
        if interval_s <= 0:
            raise ValueError("the scrape interval must be > 0")
        self.url, self.submit, self.interval_s, self.kind = url, submit, interval_s, kind
        # a keyed server's /metrics (tokenmill's --metrics-key, a scrape job's bearer token)
        headers = {"authorization": f"Bearer {key}"} if key else None
        self._client = client or httpx.Client(timeout=timeout_s, headers=headers)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples = 0
        self.problem: str | None = None  # the current streak's one-line reason
        self.detected: str | None = kind
        if slots_url is None and url.rstrip("/").endswith("/metrics"):
            slots_url = url.rstrip("/")[: -len("/metrics")] + "/slots"
        self.slots_url = slots_url
        self.slots: str | None = None  # "read", or why /slots is not read
        self.counters = CounterResets()  # each counter series' resets, across scrapes

    @property
    def status(self) -> dict:
        """Where the scraper stands: URL, engine kind, rows written, the current problem and
        the signals this engine does not expose."""
        return {
            "url": self.url,
            "engine_kind": self.detected,
            "samples": self.samples,
            "problem": self.problem,
            "not_exposed": missing_signals(self.detected) if self.detected else None,
            "slots": self.slots,
        }

    def _trouble(self, reason: str | None) -> None:
        if reason is not None and reason != self.problem:
            log.warning("scraping %s: %s", self.url, reason)
        elif reason is None and self.problem is not None:
            log.info("scraping %s: answering again", self.url)
        self.problem = reason

    def scrape_once(self) -> dict | None:
        """One scrape: the row written (as a dict), or None (the reason in :attr:`problem`)."""
        try:
            r = self._client.get(self.url)
        except httpx.HTTPError as exc:
            self._trouble(f"no answer ({type(exc).__name__}: {str(exc)[:100] or 'no detail'})")
            return None
        now = time.time_ns()
        if r.status_code == 404:
            self._trouble(
                "404: the engine serves no metrics here (llama.cpp's server needs --metrics); "
                "the rules that read engine metrics are not assessed"
            )
            return None
        if r.status_code != 200:
            self._trouble(f"HTTP {r.status_code}")
            return None
        try:
            row = read_exposition(r.text, self.url, now, self.kind, self.counters)
        except MetricsFormatError as exc:
            self._trouble(str(exc))
            return None
        if row is None:
            self._trouble(
                "no metrics of a known engine (vllm:, sglang:, llamacpp:, tgi_, tokenmill_): "
                "only the client-side view"
            )
            return None
        self._trouble(None)
        self.detected = row.engine_kind
        out = msgspec.structs.asdict(row)
        if row.engine_kind == "llamacpp" and self.slots_url and self.slots in (None, "read"):
            for signal, value in self._read_slots().items():
                if out.get(signal) is None:
                    out[signal] = value
        if self.submit("engine_samples", out):
            self.samples += 1
        return out

    def _read_slots(self) -> dict[str, float]:
        """What llama.cpp's ``/slots`` adds ({} when it is not read; the reason said once)."""
        try:
            r = self._client.get(self.slots_url)
        except httpx.HTTPError as exc:
            log.warning("reading %s: no answer (%s)", self.slots_url, type(exc).__name__)
            return {}
        if r.status_code != 200:
            self.slots = (
                f"HTTP {r.status_code}: the server does not serve /slots (started with "
                "--no-slots?); KV use is not estimated"
            )
            log.warning("reading %s: %s", self.slots_url, self.slots)
            return {}
        try:
            signals = read_slots(r.json())
        except (ValueError, MetricsFormatError) as exc:
            self.slots = str(exc) if isinstance(exc, MetricsFormatError) else "/slots: not JSON"
            log.warning("reading %s: %s", self.slots_url, self.slots)
            return {}
        self.slots = "read"
        return signals

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.scrape_once()
            except Exception as exc:  # never let one bad scrape end the thread
                self._trouble(f"scrape failed: {type(exc).__name__}: {exc}")
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def start(self) -> MetricsScraper:
        self._thread = threading.Thread(target=self._run, name="metrics-scraper", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._client.close()
