"""Run the rules over a store and rank what they find.

A :class:`Finding` is a rule that fired, with its evidence, window, up to five example trace ids,
causes, checks, the knob and the runbook. A :class:`Note` is a rule's companion hint (a knob the
data says would help; not a problem, never counted by ``--fail-on`` or the status).
:func:`diagnose` returns a :class:`Report`; its ``to_json()`` is the stable JSON output
(``schema_version`` below; fields are only ever added).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import duckdb

from .coverage import not_assessed
from .rules import RULES, Rule
from .rules._common import NEEDS_BASELINE, baseline_need
from .signals import COMPLETED_SQL, Signals, Window, load
from .stats import Support, calibrated, compare, judge

log = logging.getLogger(__name__)

REPORT_SCHEMA_VERSION = 1
SEVERITY_RANK = {"critical": 2, "warning": 1}


@dataclass
class Finding:
    """One rule that fired."""

    rule_id: str
    title: str
    severity: str
    confidence: float
    summary: str
    evidence: dict
    window_start_ns: int | None
    window_end_ns: int | None
    example_trace_ids: list[str]
    causes: list[str]
    checks: list[str]
    knob: str
    runbook: str
    explained_by: list[str] = field(default_factory=list)
    # the fired findings this one explains: its consequences, the chain from the root down
    leads_to: list[str] = field(default_factory=list)
    source: str | None = None  # the dump (replica/host) it fired on (diagnose/fleet.py)
    # the test behind it (diagnose/stats.py Support.to_json()); None: the rule states none
    support: dict | None = None

    @property
    def inconclusive(self) -> bool:
        return bool(self.support) and self.support.get("verdict") == "inconclusive"

    def to_json(self) -> dict:
        return {
            "rule": self.rule_id,
            "title": self.title,
            "severity": self.severity,
            "confidence": self.confidence,
            "summary": self.summary,
            "evidence": self.evidence,
            "window": {"start_ns": self.window_start_ns, "end_ns": self.window_end_ns},
            "example_trace_ids": self.example_trace_ids,
            "causes": self.causes,
            "checks": self.checks,
            "knob": self.knob,
            "runbook": self.runbook,
            "explained_by": self.explained_by,
            "leads_to": self.leads_to,
            "source": self.source,
            "support": self.support,
        }


@dataclass
class Note:
    """A rule's hint that held (see :attr:`Rule.hint`)."""

    rule_id: str
    summary: str
    evidence: dict
    knob: str
    runbook: str
    source: str | None = None  # the dump (replica/host) it holds on (diagnose/fleet.py)

    def to_json(self) -> dict:
        return {
            "rule": self.rule_id,
            "summary": self.summary,
            "evidence": self.evidence,
            "knob": self.knob,
            "runbook": self.runbook,
            "source": self.source,
        }


@dataclass
class Report:
    """Findings ranked by severity then confidence, plus the healthy numbers."""

    findings: list[Finding]
    start_ns: int
    end_ns: int
    window_s: float
    summary: dict
    rule_errors: dict[str, str] = field(default_factory=dict)
    notes: list[Note] = field(default_factory=list)
    # the dumps diagnosed (name, dump, status, range, summary, rules_fired; diagnose/fleet.py)
    # and the rules that fired on every one of two or more
    sources: list[dict] = field(default_factory=list)
    fleet_wide: list[str] = field(default_factory=list)
    # whether the dump had healthy windows to compare with (see signals/baseline.py), and the rules
    # that need them and so were not judged: {"available", "reason", "healthy_windows",
    # "busy_windows", "not_judged"}
    healthy_baseline: dict = field(default_factory=lambda: {"available": True})
    # warm-up set apart from the windows: {"requests": n, "intervals": [[start_ns, end_ns]]}
    warmup: dict = field(default_factory=lambda: {"requests": 0, "intervals": []})
    # rules whose symptom showed on too little evidence to count (Support.verdict
    # "inconclusive"): listed apart, never findings, never counted by --fail-on or the status
    inconclusive: list[Finding] = field(default_factory=list)
    # rules the store cannot feed (another engine's store without per-step records, a store
    # written before a column): {rule id: "needs X, which this store does not hold"}
    # (diagnose/coverage.py); never counted as healthy
    not_assessed: dict[str, str] = field(default_factory=dict)
    # signal families read from another table saying the same thing: {family: its fallback}
    # (signals/samples.py: another engine's scraped metrics in place of our step records)
    signal_sources: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "schema_version": REPORT_SCHEMA_VERSION,
            "range": {"start_ns": self.start_ns, "end_ns": self.end_ns},
            "window_s": self.window_s,
            "status": "problems_found" if self.findings else "healthy",
            "summary": self.summary,
            "findings": [f.to_json() for f in self.findings],
            "rule_errors": self.rule_errors,
            "notes": [n.to_json() for n in self.notes],
            "sources": self.sources,
            "fleet_wide": self.fleet_wide,
            "healthy_baseline": self.healthy_baseline,
            "warmup": self.warmup,
            "inconclusive": [f.to_json() for f in self.inconclusive],
            "not_assessed": self.not_assessed,
            "signal_sources": self.signal_sources,
        }


def _summary(sig: Signals) -> dict:
    o = sig.overall
    # "requests" counts arrivals in the range; "completed" and "errors" count requests that
    # ended in it (some arrived before it), so "completed" can exceed "requests";
    # "completed_of_arrived" is the arrivals that completed
    return {
        "requests": o.get("arrivals"),
        "completed": o.get("completions"),
        "errors": o.get("errors"),
        "completed_of_arrived": o.get("completed_arrivals"),
        "ended": o.get("ended"),
        "errors_by_type": sig.errors_by_type,
        "ttft_p50_ms": o.get("ttft_p50"),
        "ttft_p99_ms": o.get("ttft_p99"),
        "itl_p50_ms": o.get("itl_p50"),
        "itl_p99_ms": o.get("itl_p99"),
        "tpot_p50_ms": o.get("tpot_p50"),
        "e2e_p50_ms": o.get("e2e_p50"),
        "e2e_p99_ms": o.get("e2e_p99"),
        "queue_p99_ms": o.get("queue_p99"),
        "prefix_hit_rate": o.get("prefix_hit_rate"),
        "kv_usage_max": o.get("kv_usage_max"),
        "preemptions": o.get("preemptions"),
        "steps": o.get("steps"),
        "output_tokens": o.get("sampled_tokens"),
        "windows": len(sig.windows),
        # None unless speculative decoding verified drafts in the range
        "spec_acceptance_rate": o.get("spec_acceptance_rate"),
        "spec_accepted_per_draft": o.get("spec_accepted_per_draft"),
    }


MIN_REQUESTS = 2  # a finding on one request is inconclusive unless the rule says why one suffices
# the confidence a finding explained by another reports at most (and 0.1 below the explaining
# finding's): chosen on the corpus's tune split, where the explained findings (batch_too_large
# beside head_of_line_blocking, prefill interference beside a history computed again) were
# consequences and the only ones wrong at 0.8 and above
EXPLAINED_CAP = 0.7


def request_support(
    rule: Rule,
    sig: Signals,
    where: str | None,
    params: list,
    window: tuple[int, int] | None = None,
) -> Support | None:
    """The test behind a finding whose detector stated none: its example requests (``where``
    over ``requests`` in the range) against the requests of the dump's healthy windows, on the
    rule's ``test_metric``; see :attr:`Rule.test_metric`. None without an example filter."""
    if not where:
        return None
    metric = rule.test_metric or "NULL"
    rows = sig.con.execute(
        f"SELECT {metric}, arrival_ns FROM requests WHERE arrival_ns >= ? AND arrival_ns < ? "
        f"AND ({where})",
        [sig.since_ns, sig.until_ns, *params],
    ).fetchall()
    w_ns = int(sig.window_s * 1e9)
    held = len({(t - sig.start_ns) // w_ns for _, t in rows})
    persistence = f"{held} of {sig.busy_windows or len(sig.windows)} busy windows"
    if rule.own_test:
        return Support(
            n=len(rows), unit="requests", reference=rule.own_test, persistence=persistence
        )
    # the reference: the healthy windows other than the finding's own
    healthy = [r for r in sig.healthy_ranges if window is None or r != window]
    if rule.test_metric is None or not healthy:
        sup = Support(
            n=len(rows),
            unit="requests",
            reference="the rule's window thresholds",
            persistence=persistence,
        )
        return judge(sup, min_n=MIN_REQUESTS, min_effect=0.0)
    ranges = " OR ".join("(arrival_ns >= ? AND arrival_ns < ?)" for _ in healthy)
    ref = sig.con.execute(
        f"SELECT {metric} FROM requests WHERE ({ranges}) AND {COMPLETED_SQL} "
        f"AND {metric} IS NOT NULL",
        [t for r in healthy for t in r],
    ).fetchall()
    return compare(
        [v for v, _ in rows],
        [v for (v,) in ref],
        unit="requests",
        reference_name=f"{rule.test_metric} in the dump's healthy windows",
        min_effect=rule.test_effect,
        min_n=MIN_REQUESTS,
        persistence=persistence,
    )


def evaluate(rule: Rule, sig: Signals, overrides: dict | None = None) -> Finding | None:
    """Run one rule; None when it does not fire."""
    params = {k: v.default for k, v in rule.params.items()}
    params.update(overrides or {})
    ev = rule.detect(sig, params)
    if ev is None:
        return None
    support, confidence = None, ev.confidence
    if ev.support is None:
        try:
            ev.support = request_support(rule, sig, ev.example_where, ev.example_params, ev.window)
        except duckdb.Error as exc:  # the test must never lose the finding
            log.warning("support for %s failed: %s", rule.id, exc)
    if ev.support is not None:
        support = ev.support.to_json()
        support["line"] = ev.support.line()
        confidence = calibrated(ev.support, ev.confidence)
    examples = []
    if ev.example_where:
        try:
            examples = sig.examples(ev.example_where, ev.example_params)
        except duckdb.Error as exc:  # an example query must never lose the finding
            log.warning("examples for %s failed: %s", rule.id, exc)
    return Finding(
        rule_id=rule.id,
        title=rule.title,
        severity=ev.severity,
        confidence=confidence,
        summary=ev.summary,
        evidence={k: _plain(v) for k, v in ev.numbers.items()},
        window_start_ns=ev.window[0] if ev.window else None,
        window_end_ns=ev.window[1] if ev.window else None,
        example_trace_ids=examples,
        causes=list(ev.causes or rule.causes),
        checks=list(rule.checks),
        knob=ev.knob or rule.knob,
        runbook=rule.runbook,
        support=support,
    )


def hint_note(rule: Rule, sig: Signals, overrides: dict | None = None) -> Note | None:
    """Run one rule's hint; None when it has none or it does not hold."""
    if rule.hint is None:
        return None
    params = {k: v.default for k, v in rule.params.items()}
    params.update(overrides or {})
    h = rule.hint(sig, params)
    if h is None:
        return None
    return Note(
        rule.id, h.summary, {k: _plain(v) for k, v in h.numbers.items()}, h.knob, rule.runbook
    )


def _plain(v):
    if isinstance(v, float):
        return round(v, 4)
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def diagnose(
    con: duckdb.DuckDBPyConnection,
    *,
    since_ns: int | None = None,
    until_ns: int | None = None,
    window_s: float = 10.0,
    rules: tuple[Rule, ...] = RULES,
    reference: Sequence[Window] = (),
) -> Report:
    """Compute the signals and run every rule (``reference``: healthy windows from before the
    range that join its baseline, see :func:`~.signals.load`).

    Raises:
        NoTraffic: no requests in the range.
    """
    sig = load(con, since_ns=since_ns, until_ns=until_ns, window_s=window_s, reference=reference)
    return run_rules(con, sig, rules)


def run_rules(
    con: duckdb.DuckDBPyConnection, sig: Signals, rules: tuple[Rule, ...] = RULES
) -> Report:
    """Run every rule on computed signals and rank what fired (:func:`diagnose` without the
    loading; the live loop keeps the signals to learn its reference from)."""
    window_s = sig.window_s
    findings, errors = [], {}
    # without healthy windows, rules whose thresholds are ratios to them are not judged
    not_judged = (
        [] if sig.healthy_baseline else [r.id for r in rules if baseline_need(r) == NEEDS_BASELINE]
    )
    for rule in rules:
        if rule.id in not_judged:
            continue
        try:
            f = evaluate(rule, sig)
        except Exception as exc:  # one broken rule must not hide the others
            log.exception("rule %s failed", rule.id)
            errors[rule.id] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            continue
        if f is not None:
            findings.append(f)
    inconclusive = [f for f in findings if f.inconclusive]
    findings = [f for f in findings if not f.inconclusive]
    fired = {f.rule_id for f in findings}
    notes = []
    for rule in rules:  # a rule's hint only where the rule itself did not fire
        if rule.hint is None or rule.id in fired or rule.id in errors or rule.id in not_judged:
            continue
        try:
            note = hint_note(rule, sig)
        except Exception as exc:
            log.exception("hint of rule %s failed", rule.id)
            errors[rule.id] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            continue
        if note is not None:
            notes.append(note)
    for f in findings:  # a specific finding explains a general one: rank the general one later
        f.explained_by = sorted(
            r.id
            for r in rules
            if r.id in fired
            and (
                f.rule_id in r.explains
                or (f.rule_id in r.explains_when and r.explains_when[f.rule_id](f.evidence))
            )
        )
    for f in findings:
        f.leads_to = sorted(g.rule_id for g in findings if f.rule_id in g.explained_by)
    by_id = {f.rule_id: f for f in findings}
    for f in findings:  # a consequence of another finding is less likely the thing to fix
        if f.explained_by:
            top = min(by_id[r].confidence for r in f.explained_by)
            f.confidence = round(max(0.3, min(f.confidence, EXPLAINED_CAP, top - 0.1)), 2)
    findings.sort(
        key=lambda f: (
            bool(f.explained_by),
            -SEVERITY_RANK.get(f.severity, 0),
            -f.confidence,
            f.rule_id,
        )
    )
    report = Report(findings, sig.start_ns, sig.end_ns, window_s, _summary(sig), errors, notes)
    report.healthy_baseline = {
        "available": sig.healthy_baseline,
        "reason": sig.healthy_baseline_reason or None,
        "healthy_windows": sig.healthy_windows,
        "busy_windows": sig.busy_windows,
        "not_judged": not_judged,
    }
    report.warmup = sig.warmup
    report.signal_sources = dict(sig.sources)
    report.inconclusive = inconclusive
    spoke = fired | {f.rule_id for f in inconclusive} | {n.rule_id for n in notes}
    report.not_assessed = {
        rid: why for rid, why in not_assessed(con, sig, rules).items() if rid not in spoke
    }
    return report
