"""Prometheus alerting rules from the rule table (``tokenmill export prometheus-rules``).

A rule whose symptom the ``tokenmill_`` metrics of ``/metrics`` (``telemetry/metrics.py``) can
express carries an :class:`~tokenmill.diagnose.rules._common.Alert`: its PromQL, written in the
rule's module with the rule's own ``params`` as thresholds. This module turns those into one
Prometheus rule file of three groups:

- ``tokenmill-recording``: the shared series (:data:`SERIES`), each recorded once: histogram
  quantiles over the last :data:`WINDOW`, queue and prefill shares of TTFT, the error ratio,
  output tokens/s, and their **baselines**. The diagnoser compares a window to the dump's
  healthiest windows (the 25th percentile of the per-window values over windows with traffic,
  ``signals.BASELINE_QUANTILE``); here the baseline is the same quantile of the recorded
  5-minute value over the last :data:`BASELINE_RANGE` (6 h): ``quantile_over_time(0.25,
  tokenmill:ttft_seconds:p99_5m[6h])``, or 0.75 for tokens/s, where higher is healthier.
  A window without completed requests records nothing (``>= 0`` drops PromQL's NaN), so idle
  time does not pull a baseline down, as the diagnoser's baseline skips idle windows. The
  baseline needs the recorded history: it builds up over the first hours after the rules are
  loaded, and a server that was slow for all of the last 6 h has a slow baseline (as a dump
  that is slow throughout has).
- ``tokenmill-alerts``: one alert per exported rule, labelled ``rule_id`` and ``severity``, with
  the rule's title, symptom, thresholds and knob and a ``runbook_url`` to
  ``runbooks/<rule_id>.md`` (prefixed with ``--runbook-base-url``). The severity is the
  ``Alert``'s: ``critical`` where requests fail, ``warning`` where they are slow (the
  diagnoser's report grades each finding's severity from its margin itself).
- ``tokenmill-findings`` (on by default; ``--no-findings`` leaves it out): one alert per rule of
  the registry, **every** rule, named ``TokenmillFinding`` + the rule id in CamelCase
  (``TokenmillFindingTtftQueueing``), over the live diagnosis loop's own series
  ``tokenmill_finding_active{rule, severity}`` (``diagnose/live_service.py``): it fires while
  the loop holds that rule's finding open and resolves when the loop resolves it. Its
  expression is ``tokenmill_finding_active{rule="<id>"} == 1`` with ``for: 0s``: the loop has
  already applied its hysteresis (a finding opens only after its rule held in consecutive
  periods, and resolves only after consecutive clean ones), so Prometheus waits no longer.
  Nothing is aggregated and ``--group-by`` does not apply: a finding is a fact about one server
  (each ``serve``, ``proxy`` and ``collect`` runs its own loop on its own store), its series
  carry only ``rule`` and ``severity`` besides the target's labels (``instance``, ``job``, any
  added at scrape time), and all of them stay on the alert, so it names the server whose
  ``GET /v1/findings`` holds the finding's evidence and example traces (the description links
  it through ``{{ $labels.instance }}``). The ``severity`` label is the series' own: the loop's
  current grade of the finding (a finding regraded from warning to critical resolves the one
  alert and fires the other). Labels ``rule_id`` and ``source: live_diagnosis``; annotations
  ``summary`` (the rule's title), ``description`` (its symptom and knob) and ``runbook_url``.
  Unlike the second group, it covers the rules ``/metrics`` cannot express too: the loop runs
  them all on the store.

Rules without an ``Alert`` read rows only the trace store has (prompt lengths per request,
the make-up and host time of each step, block hashes, throttle reasons, the engine's
``max_num_seqs``, the roofline): :func:`skipped` lists them with the reason, and
``tokenmill diagnose`` on a dump covers them. The client/server TTFT gap needs a client-side
TTFT histogram, which a tokenmill server cannot export about its clients: it is exported only
when ``--client-ttft-metric`` names one (carrying the same ``--group-by`` labels).

Every series of the first two groups is aggregated ``by`` the group-by labels (default
``model_name``, the label every ``tokenmill_`` series carries); add ``instance`` for per-replica
alerts. The findings group is per instance whatever ``--group-by`` says (above).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from string import Template

from .rules import RULES
from .rules._common import Alert, Rule
from .signals import BASELINE_QUANTILE

#: the rate window: every quantile, share and ratio is over the last 5 minutes (the window a
#: scrape every 15-30 s fills with 10-20 samples; the diagnoser's windows are seconds long
#: because a dump holds every request)
WINDOW = "5m"
#: how far back the baseline looks
BASELINE_RANGE = "6h"
RECORDING_GROUP = "tokenmill-recording"
ALERT_GROUP = "tokenmill-alerts"
FINDINGS_GROUP = "tokenmill-findings"
#: the live loop's series (``diagnose/live_service.py``: ``LiveMetrics.active``)
FINDING_METRIC = "tokenmill_finding_active"
FINDINGS_SOURCE = "live_diagnosis"
SEVERITIES = ("warning", "critical")

_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_METRIC = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_DURATION = re.compile(r"(\d+)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class ExportError(ValueError):
    """A bad export option (one-line reason: the CLI prints it and exits 2)."""


@dataclass(frozen=True)
class Series:
    """A recorded series: its placeholder in alert expressions, the record name and its
    PromQL (a :class:`string.Template` over ``$by``, ``$by_le``, ``$window`` and
    ``$client_ttft``)."""

    key: str
    record: str
    expr: str


def _hq(q: float, metric: str) -> str:
    """The ``q`` quantile of a ``tokenmill_`` histogram (seconds) over the window; NaN (no
    observations in the window) dropped."""
    return f"histogram_quantile({q}, sum by ($by_le) (rate({metric}_bucket[$window]))) >= 0"


def _share(part: str, whole: str) -> str:
    """Ratio of two histograms' sums over the window (both count the same completed
    requests, so it is the ratio of the means: time-weighted, where the diagnoser averages
    per-request shares)."""
    return (
        f"sum by ($by) (rate({part}_sum[$window]))\n"
        f"  / sum by ($by) (rate({whole}_sum[$window])) >= 0"
    )


_TTFT = "tokenmill_time_to_first_token_seconds"

#: The shared series, in recording order (a baseline after what it summarizes).
SERIES: tuple[Series, ...] = (
    Series("ttft_p99", "tokenmill:ttft_seconds:p99_$window", _hq(0.99, _TTFT)),
    Series("ttft_p50", "tokenmill:ttft_seconds:p50_$window", _hq(0.5, _TTFT)),
    Series(
        "itl_p99",
        "tokenmill:itl_seconds:p99_$window",
        _hq(0.99, "tokenmill_inter_token_latency_seconds"),
    ),
    Series(
        "tpot_p99",
        "tokenmill:tpot_seconds:p99_$window",
        _hq(0.99, "tokenmill_request_time_per_output_token_seconds"),
    ),
    Series(
        "prefill_p99",
        "tokenmill:prefill_seconds:p99_$window",
        _hq(0.99, "tokenmill_request_prefill_time_seconds"),
    ),
    Series(
        "queue_share_of_ttft",
        "tokenmill:queue_share_of_ttft:ratio_$window",
        _share("tokenmill_request_queue_time_seconds", _TTFT),
    ),
    Series(
        "prefill_share_of_ttft",
        "tokenmill:prefill_share_of_ttft:ratio_$window",
        _share("tokenmill_request_prefill_time_seconds", _TTFT),
    ),
    Series(
        "error_ratio",
        "tokenmill:error_ratio:ratio_$window",
        # error_type series appear with a server's first error: 0 where none exists yet
        "(\n"
        "  sum by ($by) (rate(tokenmill_request_errors_total[$window]))\n"
        "  or 0 * sum by ($by) (rate(tokenmill_requests_total[$window]))\n"
        ")\n"
        "/ sum by ($by) (rate(tokenmill_requests_total[$window])) >= 0",
    ),
    Series(
        "tokens_per_s",
        "tokenmill:generation_tokens:rate_$window",
        "sum by ($by) (rate(tokenmill_generation_tokens_total[$window])) > 0",
    ),
)
#: the series with a baseline, and the quantile of its history taken (higher is healthier for
#: tokens/s, so its baseline is the 75th percentile)
BASELINES: dict[str, float] = {
    "ttft_p99": BASELINE_QUANTILE,
    "itl_p99": BASELINE_QUANTILE,
    "tpot_p99": BASELINE_QUANTILE,
    "prefill_p99": BASELINE_QUANTILE,
    "error_ratio": BASELINE_QUANTILE,
    "tokens_per_s": 1 - BASELINE_QUANTILE,
}
#: recorded only with ``--client-ttft-metric``
CLIENT_SERIES = Series(
    "client_ttft_p50",
    "tokenmill:client_ttft_seconds:p50_$window",
    "histogram_quantile(0.5, sum by ($by_le) (rate(${client_ttft}_bucket[$window]))) >= 0",
)
CLIENT_REASON = "needs a client-side TTFT histogram: pass --client-ttft-metric NAME"
NO_ALERT_REASON = (
    "reads per-request or per-step rows of the trace store that /metrics does not carry: "
    "run tokenmill diagnose on a dump"
)


def _seconds(duration: str) -> int:
    m = _DURATION.fullmatch(duration)
    if m is None:
        raise ExportError(f"not a duration: {duration!r} (like 5m)")
    return int(m.group(1)) * _UNIT_S[m.group(2)]


def _num(v: float) -> str:
    """A threshold as PromQL writes it: 3, 0.05, 1.2."""
    return f"{v:g}"


def _format_unit(unit: str) -> str:
    if unit == "%":
        return "{{ $value | humanizePercentage }}"
    return '{{ $value | printf "%.2f" }}x'


@dataclass(frozen=True)
class Options:
    """Export options.

    Args:
        runbook_base_url: prefix of each ``runbook_url`` (``https://.../tokenmill/blob/main/``);
            empty: the repository-relative path ``runbooks/<rule_id>.md``.
        group_by: the labels every series is aggregated by.
        client_ttft_metric: a client-side TTFT histogram (seconds, with the ``group_by``
            labels), without ``_bucket``; None: the client/server gap alert is not exported.
        findings: the ``tokenmill-findings`` group (an alert per rule on the live loop's
            ``tokenmill_finding_active``; never aggregated, so ``group_by`` does not apply).
    """

    runbook_base_url: str = ""
    group_by: tuple[str, ...] = ("model_name",)
    client_ttft_metric: str | None = None
    findings: bool = True

    def check(self) -> None:
        """Raises :class:`ExportError` on a label or metric name Prometheus would refuse."""
        for label in self.group_by:
            if not _LABEL.fullmatch(label) or label == "le":
                raise ExportError(f"--group-by: {label!r} is not a label name to group by")
        if self.client_ttft_metric is not None and not _METRIC.fullmatch(self.client_ttft_metric):
            raise ExportError(
                f"--client-ttft-metric: {self.client_ttft_metric!r} is not a metric name"
            )


def _mapping(opts: Options) -> dict[str, str]:
    base = {
        "by": ", ".join(opts.group_by),
        "by_le": ", ".join([*opts.group_by, "le"]),
        "window": WINDOW,
    }
    if opts.client_ttft_metric:
        base["client_ttft"] = opts.client_ttft_metric.removesuffix("_bucket")
    return base


def series_records(opts: Options) -> dict[str, str]:
    """Placeholder → record name of every recorded series (baselines as ``<key>_base``)."""
    m = _mapping(opts)
    out = {s.key: Template(s.record).substitute(m) for s in _series(opts)}
    for key in BASELINES:
        out[f"{key}_base"] = f"{out[key]}:baseline_{BASELINE_RANGE}"
    return out


def _series(opts: Options) -> tuple[Series, ...]:
    return SERIES + ((CLIENT_SERIES,) if opts.client_ttft_metric else ())


def recording_rules(opts: Options) -> list[dict]:
    """The ``tokenmill-recording`` group's rules: each shared series, then the baselines."""
    m = _mapping(opts)
    names = series_records(opts)
    rules = [
        {"record": names[s.key], "expr": Template(s.expr).substitute(m)} for s in _series(opts)
    ]
    for key, q in BASELINES.items():
        rules.append(
            {
                "record": names[f"{key}_base"],
                "expr": f"quantile_over_time({_num(q)}, {names[key]}[{BASELINE_RANGE}])",
            }
        )
    return rules


def exportable(rule: Rule, opts: Options) -> str | None:
    """None when ``rule`` is exported with ``opts``, else the reason it is not."""
    if rule.alert is None:
        return NO_ALERT_REASON
    if "client_ttft_p50" in Template(rule.alert.expr).get_identifiers() and not (
        opts.client_ttft_metric
    ):
        return CLIENT_REASON
    return None


def alert_expr(rule: Rule, opts: Options) -> str:
    """The rule's alert PromQL with its thresholds (``params`` defaults), the group-by labels,
    the window and the recorded series' names filled in.

    Raises:
        ExportError: the expression names a placeholder that is neither a param nor a series,
            or a param shadows a series (a rule-table bug).
    """
    a: Alert = rule.alert
    values = {**_mapping(opts), **series_records(opts)}
    clash = set(values) & set(rule.params)
    if clash:
        raise ExportError(f"{rule.id}: params {sorted(clash)} shadow shared series names")
    params = {k: _num(p.default) for k, p in rule.params.items()}
    run = rule.params.get("min_windows")
    if run is not None:
        # a trend over the diagnoser's run of consecutive windows: [$run], first window at
        # offset $run_offset
        w = _seconds(WINDOW)
        params["run"] = f"{int(run.default) * w // 60}m"
        params["run_offset"] = f"{(int(run.default) - 1) * w // 60}m"
    try:
        return Template(a.expr).substitute({**values, **params})
    except KeyError as exc:
        raise ExportError(f"{rule.id}: alert expression names unknown ${exc.args[0]}") from None


def _used_params(rule: Rule) -> list[str]:
    """The params the alert's expression reads (``min_windows`` through ``$run``)."""
    ids = set(Template(rule.alert.expr).get_identifiers())
    if ids & {"run", "run_offset"}:
        ids.add("min_windows")
    return [k for k in rule.params if k in ids]


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _description(rule: Rule) -> str:
    a = rule.alert
    thresholds = ", ".join(f"{k} {_num(rule.params[k].default)}" for k in _used_params(rule))
    return (
        f"{_cap(rule.symptom)}. {_cap(a.value)}: {_format_unit(a.unit)} (thresholds from the "
        f"rule table: {thresholds}). Knob: {rule.knob}."
    )


def runbook_url(rule: Rule, base: str) -> str:
    """``runbooks/<rule_id>.md``, under ``base`` when one is given."""
    return f"{base.rstrip('/')}/{rule.runbook}" if base else rule.runbook


def alert_rule(rule: Rule, opts: Options) -> dict:
    """One Prometheus alerting rule for ``rule`` (which must be :func:`exportable`)."""
    a = rule.alert
    if a.severity not in SEVERITIES:
        raise ExportError(f"{rule.id}: severity {a.severity!r} is not one of {SEVERITIES}")
    return {
        "alert": a.name,
        "expr": alert_expr(rule, opts),
        "for": a.for_,
        "labels": {"rule_id": rule.id, "severity": a.severity},
        "annotations": {
            "summary": _cap(rule.title),
            "description": _description(rule),
            "runbook_url": runbook_url(rule, opts.runbook_base_url),
        },
    }


def finding_alert_name(rule: Rule) -> str:
    """``TokenmillFinding`` + the rule id in CamelCase: ``TokenmillFindingTtftQueueing``."""
    return "TokenmillFinding" + "".join(part.capitalize() for part in rule.id.split("_"))


def finding_rule(rule: Rule, opts: Options) -> dict:
    """The alert that fires while the live loop holds ``rule``'s finding open: its
    ``tokenmill_finding_active`` series at 1, every label of the series kept (``rule``,
    ``severity``, the scrape target's ``instance`` and ``job``)."""
    return {
        "alert": finding_alert_name(rule),
        "expr": f'{FINDING_METRIC}{{rule="{rule.id}"}} == 1',
        "for": "0s",
        "labels": {"rule_id": rule.id, "source": FINDINGS_SOURCE},
        "annotations": {
            "summary": _cap(rule.title),
            "description": (
                f"Live diagnosis holds an open finding on {{{{ $labels.instance }}}}: "
                f"{rule.symptom}. Knob: {rule.knob}. The finding's evidence and example "
                f"traces: GET /v1/findings on {{{{ $labels.instance }}}}."
            ),
            "runbook_url": runbook_url(rule, opts.runbook_base_url),
        },
    }


def exported(opts: Options, rules: tuple[Rule, ...] = RULES) -> list[Rule]:
    """The rules exported with ``opts``, in registry order."""
    return [r for r in rules if exportable(r, opts) is None]


def skipped(opts: Options, rules: tuple[Rule, ...] = RULES) -> dict[str, str]:
    """Rule id → why it is not exported with ``opts``."""
    return {r.id: why for r in rules if (why := exportable(r, opts)) is not None}


def rule_file(opts: Options, rules: tuple[Rule, ...] = RULES) -> dict:
    """The whole Prometheus rule file: ``{"groups": [recording, alerts, findings]}`` (the
    findings group only with ``opts.findings``).

    Raises:
        ExportError: a bad option (:meth:`Options.check`) or a broken alert in the table.
    """
    opts.check()
    groups = [
        {"name": RECORDING_GROUP, "rules": recording_rules(opts)},
        {"name": ALERT_GROUP, "rules": [alert_rule(r, opts) for r in exported(opts, rules)]},
    ]
    if opts.findings:
        groups.append({"name": FINDINGS_GROUP, "rules": [finding_rule(r, opts) for r in rules]})
    return {"groups": groups}


def _wrap(items: list[str], first: str) -> list[str]:
    """Comment lines: ``first``, then ``items`` comma-separated, wrapped at 96 columns."""
    import textwrap

    return [
        first,
        *textwrap.wrap(", ".join(items), 96, initial_indent="#   ", subsequent_indent="#   "),
    ]


def render(opts: Options, rules: tuple[Rule, ...] = RULES) -> str:
    """The rule file as YAML, headed by comments naming the exported and the skipped rules."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        pass

    def _str(dumper, s: str):
        style = "|" if "\n" in s else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", s, style=style)

    _Dumper.add_representer(str, _str)
    doc = rule_file(opts, rules)
    why = skipped(opts, rules)
    head = [
        "# Prometheus rules generated by `tokenmill export prometheus-rules` from the rule table",
        "# (tokenmill.diagnose.rules); thresholds are the rules' own params defaults.",
        *_wrap([r.id for r in exported(opts, rules)], "# Exported:"),
    ]
    for reason in dict.fromkeys(why.values()):
        ids = [rid for rid, w in why.items() if w == reason]
        head += _wrap(ids, f"# Not exported: {reason}:")
    if opts.findings:
        head += [
            f"# {FINDINGS_GROUP}: an alert for each of the {len(rules)} rules (those not exported above",
            "# included), firing while the live diagnosis loop of a server holds the rule's finding",
            f"# open ({FINDING_METRIC} == 1, per instance).",
        ]
    body = yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=10_000, allow_unicode=True)
    return "\n".join(head) + "\n" + body
