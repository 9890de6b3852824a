"""Always-on diagnosis: the rules run every period over the recent part of a live store, and
each finding opens, stays open and resolves with hysteresis.

:class:`LiveDiagnosis` is the loop's logic, with no thread and no clock of its own, so that a
recorded store can be replayed through it (``benchmarks/live_soak.py``, the tests): each
:meth:`LiveDiagnosis.tick` diagnoses the last ``recent`` windows before ``now`` (window edges on
a fixed grid, so that consecutive ticks see the same windows) with the same rules, statistics
and signal families as ``tokenmill diagnose``.

- **The baseline.** A short range inside an incident has no healthy windows of its own; the
  loop keeps a **reference**: the oldest window of each tick's range (by then its requests have
  mostly ended), when it was judged healthy and no tick that saw it had a finding open or
  pending, up to
  :attr:`LiveSettings.reference_s` back. Those windows join the range's own in the baseline
  (:func:`~.signals.load`'s ``reference``), so a rule compares the incident with the health
  before it, as an operator would. Before the reference holds anything (a fresh start) the
  range is judged on its own windows, as a dump is.
- **Holding.** A rule holds at a tick when it fires there and is not inconclusive. Findings
  that another finding explains are kept (their ``explained_by`` says so) and ranked after it.
- **Hysteresis.** A finding opens once its rule held in ``open_after`` consecutive ticks (more
  for a rule whose claim one range cannot show: its ``Rule.live_open_after``) over the recent
  range, and resolves after ``resolve_after`` consecutive ticks in which its rule no longer
  holds over the newest ``resolve_windows`` windows (a shorter range, so that the fault's last
  window does not keep the finding open for the whole range's length). One incident, one
  finding, opened once and resolved once. The defaults were chosen on the factorial corpus's
  tune split and recorded soaks, and are documented in ``docs/live-diagnosis.md``.

Each change is written to the store's ``findings`` table (``telemetry/rows.py``: ``FindingRow``,
one row per open, refresh and resolve; readers take each finding's latest row) and reported to
the caller; the thread, the metrics and the routes around it are ``diagnose/live_service.py``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import duckdb

from tokenmill.telemetry.rows import FindingRow, finding_row

from .findings import Finding, run_rules
from .rules import RULES_BY_ID
from .signals import NoTraffic, Window, load
from .signals.baseline import judge_baseline
from .signals.scope import columns_read_once

log = logging.getLogger(__name__)

NS = 1_000_000_000


@dataclass(frozen=True)
class LiveSettings:
    """The loop's parameters: one period, the signals' window, how many windows each tick
    judges, how much reference it keeps, and the hysteresis."""

    period_s: float = 10.0
    window_s: float = 10.0
    recent_windows: int = 3
    reference_s: float = 3600.0
    open_after: int = 1
    resolve_after: int = 1
    #: the newest windows an open finding's rule is judged on for its resolve
    resolve_windows: int = 2
    #: resolved findings kept in memory for ``GET /v1/findings``
    keep_resolved_s: float = 3600.0

    def open_after_for(self, rule_id: str) -> int:
        """The consecutive ticks ``rule_id`` must hold in before its finding opens: the loop's
        ``open_after``, or the rule's own ``live_open_after`` where that is longer."""
        rule = RULES_BY_ID.get(rule_id)
        own = rule.live_open_after if rule is not None else None
        return max(self.open_after, own or 0)


@dataclass
class LiveFinding:
    """One finding's lifecycle: the rule, its latest evidence, when it was first and last seen,
    when it opened and resolved. ``status``: ``pending`` (held, not yet ``open_after`` ticks),
    ``open``, ``resolved``."""

    rule_id: str
    finding_id: str
    first_seen_ns: int
    latest: Finding
    last_seen_ns: int
    status: str = "pending"
    held: int = 0
    clean: int = 0
    opened_ns: int | None = None
    resolved_ns: int | None = None

    def row(self, now_ns: int) -> dict:
        f = self.latest
        return finding_row(
            time_ns=now_ns,
            finding_id=self.finding_id,
            rule=self.rule_id,
            status=self.status,
            severity=f.severity,
            confidence=f.confidence,
            title=f.title,
            summary=f.summary,
            first_seen_ns=self.first_seen_ns,
            opened_ns=self.opened_ns,
            last_seen_ns=self.last_seen_ns,
            resolved_ns=self.resolved_ns,
            evidence=f.evidence,
            example_trace_ids=f.example_trace_ids,
            explained_by=f.explained_by,
            runbook=f.runbook,
            knob=f.knob,
        )

    def to_json(self) -> dict:
        f = self.latest
        return {
            "id": self.finding_id,
            "rule": self.rule_id,
            "status": self.status,
            "title": f.title,
            "severity": f.severity,
            "confidence": f.confidence,
            "summary": f.summary,
            "first_seen_ns": self.first_seen_ns,
            "opened_ns": self.opened_ns,
            "last_seen_ns": self.last_seen_ns,
            "resolved_ns": self.resolved_ns,
            "evidence": f.evidence,
            "example_trace_ids": f.example_trace_ids,
            "explained_by": f.explained_by,
            "causes": f.causes,
            "checks": f.checks,
            "knob": f.knob,
            "runbook": f.runbook,
        }


@dataclass
class TickResult:
    """What one tick saw and changed."""

    now_ns: int
    since_ns: int
    until_ns: int
    held: list[str]  # rules that held at this tick
    opened: list[LiveFinding] = field(default_factory=list)
    resolved: list[LiveFinding] = field(default_factory=list)
    seconds: float = 0.0  # wall time
    cpu_seconds: float = 0.0  # this thread's CPU time
    error: str | None = None
    no_traffic: bool = False


class LiveDiagnosis:
    """The loop's state: findings by rule, the reference windows. ``write(table, row)`` (the
    store's ``submit``) receives the ``findings`` rows; None keeps them in memory only."""

    def __init__(
        self,
        settings: LiveSettings | None = None,
        *,
        write: Callable[[str, dict], object] | None = None,
    ):
        self.settings = settings or LiveSettings()
        self.write = write
        self.active: dict[str, LiveFinding] = {}  # pending and open, by rule
        self.resolved: deque[LiveFinding] = deque()
        self.reference: deque[Window] = deque()
        #: windows starting before this were judged while a finding was open or pending
        self.learn_from_ns = 0
        self.last: TickResult | None = None
        self.runs = 0
        self.errors = 0

    # ----- the range a tick judges -----
    def range_at(self, now_ns: int) -> tuple[int, int]:
        """``(since, until)``: the last ``recent_windows`` whole windows before ``now`` on the
        fixed grid of ``window_s``."""
        w = int(self.settings.window_s * NS)
        until = now_ns // w * w
        return until - self.settings.recent_windows * w, until

    def open_findings(self) -> list[LiveFinding]:
        return [f for f in self.active.values() if f.status == "open"]

    def tick(self, con: duckdb.DuckDBPyConnection, now_ns: int) -> TickResult:
        """Diagnose the recent range at ``now`` and move each finding along its lifecycle."""
        t0, c0 = time.perf_counter(), time.thread_time()
        since, until = self.range_at(now_ns)
        res = TickResult(now_ns, since, until, held=[])
        findings: list[Finding] = []
        try:
            with columns_read_once():
                sig = load(
                    con,
                    since_ns=since,
                    until_ns=until,
                    window_s=self.settings.window_s,
                    reference=tuple(self.reference),
                )
                report = run_rules(con, sig)
            findings = [f for f in report.findings if not f.inconclusive]
        except NoTraffic:
            res.no_traffic = True
            report = None
        except duckdb.Error as exc:  # a store mid-reopen: this tick judges nothing
            res.error = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            self.errors += 1
            report = None
        if res.error is None and report is not None:
            findings = self._judged_for_resolve(con, findings, until)
        res.held = [f.rule_id for f in findings]
        if res.error is None:
            self._advance(findings, now_ns, res)
            if report is not None and not self.active:
                self._learn(sig.windows, since)
            if self.active:  # no window of this range joins the reference later
                self.learn_from_ns = until
        self._forget(now_ns)
        res.seconds = time.perf_counter() - t0
        res.cpu_seconds = time.thread_time() - c0
        self.runs += 1
        self.last = res
        return res

    # ----- the lifecycle -----
    def _judged_for_resolve(
        self, con: duckdb.DuckDBPyConnection, findings: list[Finding], until: int
    ) -> list[Finding]:
        """The findings that hold at this tick: over the recent range, but over the newest
        ``resolve_windows`` windows for a rule whose finding is open. Where the newest windows
        cannot judge (no request in them, no healthy baseline, the rule not judged there) the
        recent range decides. A rule whose test is inconclusive there no longer holds: its
        requests were too few to show the symptom, and the range would hold it on the fault's
        own windows (after a queue drains, sparse traffic leaves a window or two of requests
        that cannot show anything, while the range still holds the queue's last ones)."""
        s = self.settings
        watched = {r for r, lf in self.active.items() if lf.status == "open"}
        if not watched or s.resolve_windows >= s.recent_windows:
            return findings
        w = int(s.window_s * NS)
        rules = tuple(RULES_BY_ID[r] for r in sorted(watched) if r in RULES_BY_ID)
        try:
            with columns_read_once():
                sig = load(
                    con,
                    since_ns=until - s.resolve_windows * w,
                    until_ns=until,
                    window_s=s.window_s,
                    reference=tuple(self.reference),
                )
                if not sig.healthy_baseline:
                    return findings
                report = run_rules(con, sig, rules)
        except (NoTraffic, duckdb.Error):
            return findings
        judged = (
            {r.id for r in rules}
            - set(report.rule_errors)
            - set(report.healthy_baseline.get("not_judged") or ())
        )
        newest = {f.rule_id: f for f in report.findings}
        held = {f.rule_id for f in findings}
        # left out: an open finding's rule that no longer holds over the newest windows
        out = [f for f in findings if f.rule_id not in judged or f.rule_id in newest]
        out += [f for r, f in newest.items() if r not in held]  # held over the newest only
        return out

    def _advance(self, findings: list[Finding], now_ns: int, res: TickResult) -> None:
        s = self.settings
        held = {f.rule_id: f for f in findings}
        for rule_id, f in held.items():
            lf = self.active.get(rule_id)
            if lf is None:
                lf = LiveFinding(rule_id, uuid.uuid4().hex[:16], now_ns, f, now_ns)
                self.active[rule_id] = lf
            lf.latest, lf.last_seen_ns, lf.held, lf.clean = f, now_ns, lf.held + 1, 0
            if lf.status == "pending" and lf.held >= s.open_after_for(rule_id):
                lf.status, lf.opened_ns = "open", now_ns
                res.opened.append(lf)
            if lf.status == "open":
                self._emit(lf, now_ns)
        for rule_id, lf in list(self.active.items()):
            if rule_id in held:
                continue
            lf.clean += 1
            lf.held = 0
            if lf.status == "pending":
                del self.active[rule_id]  # never opened: forgotten, nothing written
            elif lf.clean >= s.resolve_after:
                lf.status, lf.resolved_ns = "resolved", now_ns
                del self.active[rule_id]
                self.resolved.append(lf)
                res.resolved.append(lf)
                self._emit(lf, now_ns)

    def _emit(self, lf: LiveFinding, now_ns: int) -> None:
        if self.write is None:
            return
        try:
            self.write("findings", lf.row(now_ns))
        except Exception as exc:  # the store's problem is counted there; the loop goes on
            log.warning("live diagnosis: finding row not written: %s", exc)

    # ----- the reference -----
    def _learn(self, windows: list[Window], since: int) -> None:
        """Keep the range's oldest window when it is healthy (by now its requests have mostly
        ended) and no tick judged it while a finding was open or pending (a finding resolves
        while its fault's last windows are still in the range, and a neighbour's slow windows
        pass the baseline's markers); called only on ticks where none is."""
        if since < self.learn_from_ns:
            return
        if self.reference and self.reference[-1].start_ns >= since:
            return
        busy = [w for w in windows if (w.get("completed_arrivals") or 0) > 0]
        _, healthy, _ = judge_baseline(busy, windows)
        w_ns = int(self.settings.window_s * NS)
        self.reference.extend(
            w for w in healthy if w.start_ns == since and w.end_ns - w.start_ns == w_ns
        )

    def _forget(self, now_ns: int) -> None:
        s = self.settings
        while self.reference and self.reference[0].end_ns < now_ns - s.reference_s * NS:
            self.reference.popleft()
        while self.resolved and self.resolved[0].resolved_ns < now_ns - s.keep_resolved_s * NS:
            self.resolved.popleft()

    def to_json(self) -> dict:
        """``GET /v1/findings``: the open findings, those still pending and the recently
        resolved, with the loop's settings and last run."""
        last = self.last
        return {
            "open": [f.to_json() for f in self.open_findings()],
            "pending": [f.to_json() for f in self.active.values() if f.status == "pending"],
            "resolved": [f.to_json() for f in reversed(self.resolved)],
            "settings": {
                "period_s": self.settings.period_s,
                "window_s": self.settings.window_s,
                "recent_windows": self.settings.recent_windows,
                "open_after": self.settings.open_after,
                "open_after_by_rule": {
                    r: n
                    for r in RULES_BY_ID
                    if (n := self.settings.open_after_for(r)) != self.settings.open_after
                },
                "resolve_after": self.settings.resolve_after,
                "resolve_windows": self.settings.resolve_windows,
            },
            "runs": self.runs,
            "errors": self.errors,
            "reference_windows": len(self.reference),
            "last_run": None
            if last is None
            else {
                "now_ns": last.now_ns,
                "range": {"start_ns": last.since_ns, "end_ns": last.until_ns},
                "held": last.held,
                "seconds": round(last.seconds, 4),
                "cpu_seconds": round(last.cpu_seconds, 4),
                "error": last.error,
            },
        }


__all__ = ["FindingRow", "LiveDiagnosis", "LiveFinding", "LiveSettings", "TickResult"]
