"""The console's diagnosis and comparison queries (Diagnosis and Compare pages): ``tokenmill
diagnose`` over the window, the diagnoser's per-window signals, a rule's evidence signals and
runbook; a baseline against the source (``tokenmill diagnose --baseline``) and the latency
distributions the Compare page overlays. Conventions: ``data_store.py``."""

from __future__ import annotations

from importlib import resources

import pandas as pd

from tokenmill.telemetry.goodput import GoodputSlo
from tokenmill.telemetry.schema import STATIONS

from .data_store import (
    OK_SQL,
    _df,
    _time,
)


def diagnosis(con, since_ns: int, until_ns: int, window_s: float):
    """``tokenmill diagnose`` over the window (a :class:`~tokenmill.diagnose.findings.Report`),
    or None when no request arrived in it."""
    from tokenmill.diagnose.findings import diagnose
    from tokenmill.diagnose.signals import NoTraffic

    try:
        return diagnose(con, since_ns=since_ns, until_ns=until_ns, window_s=window_s)
    except NoTraffic:
        return None


def signal_windows(con, since_ns: int, until_ns: int, window_s: float) -> pd.DataFrame:
    """The diagnoser's per-window signals (one row per window; ``time`` = window start) and the
    baseline of each latency signal as ``<name>__baseline`` columns."""
    from tokenmill.diagnose.signals import NoTraffic, load

    try:
        sig = load(con, since_ns=since_ns, until_ns=until_ns, window_s=window_s)
    except NoTraffic:
        return _time(pd.DataFrame({"t_ns": pd.Series(dtype="int64")}))
    rows = [{"t_ns": w.start_ns, "end_ns": w.end_ns, **w.values} for w in sig.windows]
    df = pd.DataFrame(rows)
    for k, v in sig.baseline.items():
        df[f"{k}__baseline"] = v
    return _time(df)


_DEFAULT_EVIDENCE = ("ttft_p99", "itl_p99", "throughput_tok_s")


def evidence_signals(rule_id: str, windows: pd.DataFrame) -> list[str]:
    """The per-window signals that show a rule's evidence (those with any value): the rule's own
    ``evidence_signals`` (``tokenmill.diagnose.rules``), else TTFT, ITL and throughput."""
    from tokenmill.diagnose.rules import RULES_BY_ID

    rule = RULES_BY_ID.get(rule_id)
    names = (rule.evidence_signals if rule else ()) or _DEFAULT_EVIDENCE
    return [n for n in names if n in windows and windows[n].notna().any()]


def runbook(rule_id: str) -> str | None:
    """The runbook Markdown of a rule (package data ``tokenmill.runbooks``), or None."""
    if not rule_id.replace("_", "").isalnum():
        return None
    try:
        return resources.files("tokenmill.runbooks").joinpath(f"{rule_id}.md").read_text()
    except (FileNotFoundError, ModuleNotFoundError):
        return None


# ----- compare (views/compare.py) -----


def comparison(
    before_con,
    after_con,
    *,
    before_label: str,
    after_label: str,
    since_ns: int | None,
    until_ns: int | None,
    slo: GoodputSlo,
    threshold_pct: float,
    window_s: float = 10.0,
):
    """The baseline (BEFORE, all of it) against the source (AFTER, its requests arrived in
    ``[since_ns, until_ns)``) as a :class:`tokenmill.diagnose.compare.Comparison`, goodput
    against ``slo``; None when either holds no request there."""
    from tokenmill.diagnose.compare import CompareError, compare, measure
    from tokenmill.diagnose.signals import NoTraffic

    try:
        before = measure(before_con, label=before_label, slo=slo, window_s=window_s)
        after = measure(
            after_con,
            label=after_label,
            since_ns=since_ns,
            until_ns=until_ns,
            slo=slo,
            window_s=window_s,
        )
    except (CompareError, NoTraffic):
        return None
    return compare(before, after, threshold_pct=threshold_pct)


_SAMPLES_SQL = f"""
WITH r AS (SELECT * FROM requests WHERE arrival_ns >= $since AND arrival_ns < $until AND {OK_SQL})
SELECT s.name AS metric, s.duration_ns / 1e6 AS ms
FROM spans s JOIN r USING (trace_id) WHERE s.name IN ({", ".join(repr(n) for n in STATIONS)})
UNION ALL SELECT 'TTFT', ttft_ms FROM r WHERE ttft_ms IS NOT NULL
UNION ALL SELECT 'ITL p99', itl_p99_ms FROM r WHERE itl_p99_ms IS NOT NULL
UNION ALL SELECT 'TPOT', tpot_ms FROM r WHERE tpot_ms IS NOT NULL
UNION ALL SELECT 'E2E', e2e_ms FROM r WHERE e2e_ms IS NOT NULL
"""


def latency_samples(con, since_ns: int | None = None, until_ns: int | None = None) -> pd.DataFrame:
    """The distributions the Compare page overlays, one row per value (``metric``, ``ms``):
    each station span's duration (``metric`` = the station) and each request's TTFT, ITL p99,
    TPOT and E2E, over the requests that completed and arrived in the range (default: all)."""
    return _df(
        con,
        _SAMPLES_SQL,
        since=since_ns if since_ns is not None else -(2**62),
        until=until_ns if until_ns is not None else 2**62,
    )
