"""``tokenmill export``: the exported Prometheus rules pass ``promtool check rules``; under
``promtool test rules`` every alert fires on synthetic series where its rule's condition holds
(with its labels and annotations, the value included) and stays silent where it does not; the
findings group has an alert for every rule that fires exactly while its
``tokenmill_finding_active`` series is 1, per instance, and ``--no-findings`` leaves it out; the
Grafana dashboard is dashboard JSON whose queries, like the alerts', name only series a real
``/metrics`` render has; bad input is one ``error:`` line, exit 2. (The findings alerts through a
real Prometheus and Alertmanager: ``test_alertmanager.py``.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.diagnose.alerts import ALERT_GROUP, FINDINGS_GROUP, RECORDING_GROUP
from tokenmill.diagnose.rules import RULES
from tokenmill.telemetry.metrics import ServingMetrics, histogram_quantile

ROOT = Path(__file__).resolve().parents[2]
TOKENMILL = Path(sys.executable).with_name("tokenmill")
MODEL = "m"
CLIENT = "client_ttft_seconds"
ALERTED = [r for r in RULES if r.alert is not None]
NAME = {r.id: r.alert.name for r in ALERTED}


def tm(*args: str) -> subprocess.CompletedProcess:
    """The real ``tokenmill`` console script."""
    return subprocess.run([str(TOKENMILL), *args], capture_output=True, text=True, timeout=120)


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail(
            "promtool not found: install the Debian package `prometheus` "
            "(apt-get install --no-install-recommends prometheus; `make test` does it)"
        )
    return promtool


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory) -> Path:
    """The rules with the client-side gap too (``--client-ttft-metric``): every alert."""
    path = tmp_path_factory.mktemp("export") / "tokenmill-rules.yml"
    r = tm("export", "prometheus-rules", "--client-ttft-metric", CLIENT, "--out", str(path))
    assert r.returncode == 0 and r.stdout == "", r.stderr
    return path


def _alerts(path: Path, group: str = ALERT_GROUP) -> dict[str, dict]:
    """The alerts of one group of the rule file, by name."""
    groups = yaml.safe_load(path.read_text())["groups"]
    return {r["alert"]: r for g in groups if g["name"] == group for r in g["rules"] if "alert" in r}


def _camel(rule_id: str) -> str:
    return "".join(part.capitalize() for part in rule_id.split("_"))


# ---------------------------------------------------------------------------------------------
# promtool check rules; what is exported


def test_default_export_passes_promtool_check(tmp_path):
    out = tmp_path / "rules.yml"
    r = tm("export", "prometheus-rules", "--out", str(out))
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(out.read_text())
    n = sum(len(g["rules"]) for g in doc["groups"])
    check = subprocess.run(
        [_promtool(), "check", "rules", str(out)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {n} rules found" in check.stdout, check.stdout
    # the same file on stdout
    assert tm("export", "prometheus-rules").stdout == out.read_text()
    # without a client-side histogram the client/server gap is left out, and the header says why
    alerts = _alerts(out)
    gap = [r for r in ALERTED if "$client_ttft_p50" in r.alert.expr]
    assert gap and all(r.alert.name not in alerts for r in gap)
    assert {a["labels"]["rule_id"] for a in alerts.values()} == {
        r.id for r in ALERTED if r not in gap
    }
    head = out.read_text().split("groups:")[0]
    assert "--client-ttft-metric" in head
    # the three groups, the findings one last with an alert for every rule
    assert [g["name"] for g in doc["groups"]] == [RECORDING_GROUP, ALERT_GROUP, FINDINGS_GROUP]
    assert {a["labels"]["rule_id"] for a in _alerts(out, FINDINGS_GROUP).values()} == {
        r.id for r in RULES
    }
    assert f"{FINDINGS_GROUP}: an alert for each of the {len(RULES)} rules" in head


def test_no_findings_leaves_the_findings_group_out(tmp_path):
    out = tmp_path / "rules.yml"
    r = tm("export", "prometheus-rules", "--no-findings", "--out", str(out))
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(out.read_text())
    assert [g["name"] for g in doc["groups"]] == [RECORDING_GROUP, ALERT_GROUP]
    assert "tokenmill_finding_active" not in out.read_text()
    check = subprocess.run(
        [_promtool(), "check", "rules", str(out)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # the other two groups are the same with and without it
    full = yaml.safe_load(tm("export", "prometheus-rules").stdout)
    assert full["groups"][:2] == doc["groups"]


def test_a_finding_alert_for_every_rule_on_the_live_series(rules_file, tmp_path):
    findings = _alerts(rules_file, FINDINGS_GROUP)
    assert len(findings) == len(RULES)
    for rule in RULES:
        name = f"TokenmillFinding{_camel(rule.id)}"
        a = findings[name]
        # every label of the series kept (no aggregation: per instance, whatever --group-by)
        assert a["expr"] == f'tokenmill_finding_active{{rule="{rule.id}"}} == 1'
        assert a["for"] == "0s"  # the loop's hysteresis already held it
        # severity is the series' own label, not the rule file's
        assert a["labels"] == {"rule_id": rule.id, "source": "live_diagnosis"}
        ann = a["annotations"]
        assert ann["summary"].lower() == rule.title.lower() and ann["summary"][0].isupper()
        assert rule.symptom in ann["description"] and rule.knob in ann["description"]
        assert "GET /v1/findings on {{ $labels.instance }}" in ann["description"]
        assert ann["runbook_url"] == f"runbooks/{rule.id}.md"
        assert (ROOT / ann["runbook_url"]).is_file()
    # --group-by and the runbook prefix: the first groups aggregate by instance, the findings
    # group is the same per-instance expression with the prefixed runbook
    out = tmp_path / "per-instance.yml"
    r = tm(
        "export", "prometheus-rules", "--group-by", "model_name,instance",
        "--runbook-base-url", "https://example.org/tm/", "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    for name, a in _alerts(out, FINDINGS_GROUP).items():
        assert a["expr"] == findings[name]["expr"]
        assert a["annotations"]["runbook_url"].startswith("https://example.org/tm/runbooks/")


def test_every_rule_is_exported_or_named_as_not(rules_file):
    text = rules_file.read_text()
    head = text.split("groups:")[0]
    exported, _, skipped = head.partition("# Not exported")
    for rule in RULES:
        named_in = [part for part in (exported, skipped) if re.search(rf"\b{rule.id}\b", part)]
        assert len(named_in) == 1, (rule.id, "must be listed once, as exported or not")
        assert (rule.alert is not None) == bool(re.search(rf"\b{rule.id}\b", exported)), rule.id
    check = subprocess.run(
        [_promtool(), "check", "rules", str(rules_file)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # the list: queueing, error spike, KV pressure, queue growth, client/server gap
    assert len(ALERTED) >= 5


def test_alerts_carry_rule_id_severity_runbook_and_thresholds(rules_file, tmp_path):
    alerts = _alerts(rules_file)
    assert set(alerts) == set(NAME.values())
    for rule in ALERTED:
        a = alerts[rule.alert.name]
        assert a["labels"] == {"rule_id": rule.id, "severity": rule.alert.severity}
        assert a["annotations"]["runbook_url"] == f"runbooks/{rule.id}.md"
        assert (ROOT / a["annotations"]["runbook_url"]).is_file()
        assert a["annotations"]["summary"].lower() == rule.title.lower()
        assert rule.knob in a["annotations"]["description"]
        assert re.fullmatch(r"\d+[smh]", a["for"])
        # the thresholds are the rule's own params defaults, not numbers of their own
        for name, param in rule.params.items():
            if f"${name}" in rule.alert.expr:
                assert f"{name} {param.default:g}" in a["annotations"]["description"]
                assert f"{param.default:g}" in a["expr"]
    out = tmp_path / "prefixed.yml"
    r = tm(
        "export",
        "prometheus-rules",
        "--runbook-base-url",
        "https://example.org/tokenmill/blob/main/",
        "--group-by",
        "model_name,instance",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    for rule in ALERTED:
        a = _alerts(out).get(rule.alert.name)
        if a is not None:
            assert (
                a["annotations"]["runbook_url"]
                == f"https://example.org/tokenmill/blob/main/runbooks/{rule.id}.md"
            )
    assert "sum by (model_name, instance, le)" in out.read_text()
    assert subprocess.run([_promtool(), "check", "rules", str(out)]).returncode == 0


# ---------------------------------------------------------------------------------------------
# promtool test rules: synthetic series

MINUTES = 90  # samples at 0..90 min, one a minute
BAD_FROM = 60  # minutes 61..90 are the scenario's symptom (healthy before)
EVAL_MIN = 85
LADDER = (0.05, 0.075, 0.1, 0.15, 0.3, 0.5, 0.75, 1.0, 1.5, 3.0)

HEALTHY = dict(
    rate=60,  # completed requests a minute
    ttft_le=0.1,  # every observation in the bucket (previous bound, le]
    itl_le=0.05,
    tpot_le=0.05,
    prefill_le=0.075,
    client_le=0.1,
    queue_frac=0.1,  # queue time / TTFT
    prefill_frac=0.6,  # prefill time / TTFT
    errors=0,  # a minute
    tokens=6000,  # output tokens a minute
    kv=0.3,
    running=4,
    waiting=0,
    in_flight=4,
    preempt=0,  # a minute
    restarts=0,  # engine core restarts a minute
)


def _at(v, minute: int):
    return v(minute) if callable(v) else v


def _knobs(bad: dict, minute: int) -> dict:
    """The knobs of minute ``minute`` (the minute ending at that sample)."""
    k = dict(HEALTHY)
    if minute > BAD_FROM:
        k.update({key: _at(v, minute) for key, v in bad.items()})
    return k


def _values(xs: list[float]) -> str:
    return " ".join(f"{x:.12g}" for x in xs)


def _series(bad: dict) -> list[dict]:
    """promtool input_series: the ``tokenmill_`` series of a server whose knobs are HEALTHY
    up to minute 60 and ``bad`` after (a value or a function of the minute)."""
    knobs = [_knobs(bad, m) for m in range(MINUTES + 1)]
    out: list[dict] = []

    def counter(name: str, labels: str, per_minute) -> None:
        total, xs = 0.0, []
        for m, k in enumerate(knobs):
            total += per_minute(k) if m > 0 else 0.0
            xs.append(total)
        out.append({"series": f'{name}{{model_name="{MODEL}"{labels}}}', "values": _values(xs)})

    def gauge(name: str, key: str) -> None:
        out.append(
            {
                "series": f'{name}{{model_name="{MODEL}"}}',
                "values": _values([k[key] for k in knobs]),
            }
        )

    def hist(name: str, le_key: str, mean=None) -> None:
        def n(k):
            return k["rate"]

        for le in (*LADDER, "+Inf"):
            counter(
                f"{name}_bucket",
                f',le="{le}"',
                lambda k, le=le: n(k) if le == "+Inf" or k[le_key] <= le else 0,
            )
        counter(f"{name}_count", "", n)
        counter(f"{name}_sum", "", mean or (lambda k: n(k) * 0.9 * k[le_key]))

    def ttft_sum(k):
        return k["rate"] * 0.9 * k["ttft_le"]

    hist("tokenmill_time_to_first_token_seconds", "ttft_le", ttft_sum)
    hist("tokenmill_inter_token_latency_seconds", "itl_le")
    hist("tokenmill_request_time_per_output_token_seconds", "tpot_le")
    # the shares of TTFT: prefill and queue time sums as fractions of the TTFT sum
    hist(
        "tokenmill_request_prefill_time_seconds",
        "prefill_le",
        lambda k: ttft_sum(k) * k["prefill_frac"],
    )
    counter("tokenmill_request_queue_time_seconds_sum", "", lambda k: ttft_sum(k) * k["queue_frac"])
    counter("tokenmill_request_queue_time_seconds_count", "", lambda k: k["rate"])
    hist(CLIENT, "client_le")
    counter("tokenmill_requests_total", ',tenant="default",status="200"', lambda k: k["rate"])
    counter("tokenmill_request_errors_total", ',error_type="nan_logits"', lambda k: k["errors"])
    counter("tokenmill_generation_tokens_total", ',tenant="default"', lambda k: k["tokens"])
    counter("tokenmill_num_preemptions_total", "", lambda k: k["preempt"])
    counter("tokenmill_engine_restarts_total", "", lambda k: k["restarts"])
    gauge("tokenmill_kv_cache_usage_perc", "kv")
    gauge("tokenmill_num_requests_running", "running")
    gauge("tokenmill_num_requests_waiting", "waiting")
    gauge("tokenmill_requests_in_flight", "in_flight")
    return out


def _p(q: float, le: float) -> float:
    """The q quantile, as PromQL's histogram_quantile computes it, of observations that all
    fall in the bucket (previous ladder bound, ``le``]."""
    return histogram_quantile(
        q, [(b, 1.0 if le <= b else 0.0) for b in LADDER] + [(float("inf"), 1.0)]
    )


BASE = HEALTHY


def _steps(*les: float):
    """A knob that moves up the ladder every 10 minutes of the symptom."""
    return lambda m: les[min((m - BAD_FROM - 1) // 10, len(les) - 1)]


QUEUEING = dict(ttft_le=1.0, queue_frac=0.9, prefill_frac=0.05)
KV = dict(kv=0.95, preempt=1, ttft_le=0.3, tpot_le=0.1)
OVERLOAD = dict(
    ttft_le=_steps(0.15, 0.5, 1.5),
    waiting=lambda m: 20 * (m - BAD_FROM),
    in_flight=lambda m: 4 + 20 * (m - BAD_FROM),
)
ERRORS = dict(errors=18)
IDLE = dict(rate=0, tokens=0, running=0, waiting=0, in_flight=0)

#: scenario → (its symptom knobs, {rule id: expected alert value} for the alerts that must
#: fire, and the rule ids whose alerts must stay silent)
SCENARIOS = {
    "healthy": ({}, {}, list(NAME)),
    "queueing": (
        QUEUEING,
        {"ttft_queueing": _p(0.99, 1.0) / _p(0.99, BASE["ttft_le"])},
        ["ttft_prefill_bound", "kv_pressure_preemption", "overload", "error_spike"],
    ),
    "queueing but ITL up too": ({**QUEUEING, "itl_le": 0.15}, {}, ["ttft_queueing"]),
    "prefill slow": (
        dict(ttft_le=1.0, queue_frac=0.05, prefill_frac=0.9, prefill_le=0.75),
        {"ttft_prefill_bound": _p(0.99, 1.0) / _p(0.99, BASE["ttft_le"])},
        ["ttft_queueing"],
    ),
    "TTFT up, prefill p99 flat": (
        dict(ttft_le=1.0, queue_frac=0.05, prefill_frac=0.9),
        {},
        ["ttft_prefill_bound", "ttft_queueing"],
    ),
    "KV full with preemptions": (
        KV,
        {"kv_pressure_preemption": 0.95},
        ["ttft_queueing", "kv_block_leak"],
    ),
    "KV full, no preemption": ({**KV, "preempt": 0}, {}, ["kv_pressure_preemption"]),
    "overload": (
        OVERLOAD,
        # arrivals = 15 min of completions (60/min) + 300 more in flight
        {"overload": (15 * 60 + 300) / (15 * 60)},
        ["kv_pressure_preemption", "error_spike"],
    ),
    "TTFT trend, queue flat": (dict(ttft_le=_steps(0.15, 0.5, 1.5)), {}, ["overload"]),
    "error spike": (
        ERRORS,
        {"error_spike": 18 / 60},
        ["ttft_queueing", "overload", "engine_crash"],
    ),
    # an engine core killed every minute: 5 restarts in the 5-minute window
    "engine core crashing": (dict(restarts=1), {"engine_crash": 5.0}, ["kv_block_leak"]),
    "errors while throughput halves": ({**ERRORS, "tokens": 3000}, {}, ["error_spike"]),
    "idle with KV held": (
        {**IDLE, "kv": 0.2},
        {"kv_block_leak": 0.2},
        ["kv_pressure_preemption", "error_spike"],
    ),
    "idle with KV returned": ({**IDLE, "kv": 0.01}, {}, ["kv_block_leak"]),
    "client TTFT far above the server's": (
        dict(client_le=0.5),
        {"client_server_ttft_gap": _p(0.5, 0.5) / _p(0.5, BASE["ttft_le"])},
        ["ttft_queueing"],
    ),
    "client TTFT near the server's": (dict(client_le=0.15), {}, ["client_server_ttft_gap"]),
}


def _format(value: float, template: str) -> str:
    """The description as Prometheus expands it for ``value``: printf "%.2f", or
    humanizePercentage (humanize(100 v): four significant digits) + "%"."""
    if "humanizePercentage" in template:
        return template.replace("{{ $value | humanizePercentage }}", f"{value * 100:.4g}%")
    return template.replace('{{ $value | printf "%.2f" }}', f"{value:.2f}")


def test_every_alert_fires_on_its_symptom_and_not_otherwise(rules_file, tmp_path):
    alerts = _alerts(rules_file)
    fired = {rid for _, want, _ in SCENARIOS.values() for rid in want}
    silent = {rid for _, want, quiet in SCENARIOS.values() for rid in quiet if not want}
    assert fired == set(NAME), f"alerts never shown firing: {set(NAME) - fired}"
    # a silent case of its own (not only the healthy run) for every alert
    own_silent = {
        rid for name, (_, want, quiet) in SCENARIOS.items() if name != "healthy" for rid in quiet
    }
    assert own_silent >= set(NAME), set(NAME) - own_silent
    assert silent
    tests = []
    for name, (bad, want, quiet) in SCENARIOS.items():
        checks = []
        for rid, value in want.items():
            a = alerts[NAME[rid]]
            ann = dict(a["annotations"])
            ann["description"] = _format(value, ann["description"])
            checks.append(
                {
                    "eval_time": f"{EVAL_MIN}m",
                    "alertname": NAME[rid],
                    "exp_alerts": [
                        {"exp_labels": {"model_name": MODEL, **a["labels"]}, "exp_annotations": ann}
                    ],
                }
            )
        for rid in quiet:
            assert rid not in want, (name, rid)
            checks.append({"eval_time": f"{EVAL_MIN}m", "alertname": NAME[rid], "exp_alerts": []})
        tests.append(
            {
                "name": name,
                "interval": "1m",
                "input_series": _series(bad),
                "alert_rule_test": checks,
            }
        )
    spec = tmp_path / "tokenmill-rules.test.yml"
    spec.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(rules_file)],
                "evaluation_interval": "1m",
                # promtool evaluates groups in map order unless told: the recording rules must
                # come first, or an alert reading them sees the previous minute's value (the
                # overload alert then missed its firing minute in some runs)
                "group_eval_order": [RECORDING_GROUP, ALERT_GROUP, FINDINGS_GROUP],
                "tests": tests,
            },
            sort_keys=False,
            width=10_000,
        )
    )
    r = subprocess.run(
        [_promtool(), "test", "rules", str(spec)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_a_silent_case_fails_promtool_when_told_to_fire(rules_file, tmp_path):
    """The unit test above can fail: the same promtool run, told that the healthy run fires
    the queueing alert, reports it did not."""
    rid = "ttft_queueing"
    a = _alerts(rules_file)[NAME[rid]]
    test = {
        "interval": "1m",
        "input_series": _series({}),
        "alert_rule_test": [
            {
                "eval_time": f"{EVAL_MIN}m",
                "alertname": NAME[rid],
                "exp_alerts": [{"exp_labels": {"model_name": MODEL, **a["labels"]}}],
            }
        ],
    }
    spec = tmp_path / "wrong.test.yml"
    spec.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(rules_file)],
                "evaluation_interval": "1m",
                "group_eval_order": [RECORDING_GROUP, ALERT_GROUP, FINDINGS_GROUP],
                "tests": [test],
            }
        )
    )
    r = subprocess.run([_promtool(), "test", "rules", str(spec)], capture_output=True, text=True)
    assert r.returncode != 0 and NAME[rid] in r.stdout + r.stderr


def test_finding_alerts_fire_exactly_while_the_series_is_one(rules_file, tmp_path):
    """promtool test rules on the live loop's series of two servers: the queueing finding open
    on one for minutes 2..4 (warning) and regraded critical at 4, nothing on the other; the
    alert fires per instance with the series' severity, its description naming the instance,
    and is gone once the series is 0."""
    findings = _alerts(rules_file, FINDINGS_GROUP)
    rid, other = "ttft_queueing", "error_spike"
    a = findings[f"TokenmillFinding{_camel(rid)}"]
    up, down = "10.0.0.1:8000", "10.0.0.2:8000"

    def series(rule, severity, instance, values):
        return {
            "series": f'tokenmill_finding_active{{rule="{rule}",severity="{severity}",'
            f'instance="{instance}",job="tokenmill"}}',
            "values": values,
        }

    inputs = [
        series(rid, "warning", up, "0 0 1 1 0 0 0 0"),
        series(rid, "critical", up, "_ _ _ _ 1 0 0 0"),
        series(rid, "warning", down, "0 0 0 0 0 0 0 0"),
        series(other, "critical", up, "0 0 0 0 0 0 0 0"),
    ]

    def expect(severity):
        ann = dict(a["annotations"])
        ann["description"] = ann["description"].replace("{{ $labels.instance }}", up)
        labels = {
            "rule": rid, "severity": severity, "instance": up, "job": "tokenmill", **a["labels"]
        }  # fmt: skip
        return [{"exp_labels": labels, "exp_annotations": ann}]

    name = a["alert"]
    checks = [
        {"eval_time": "1m", "alertname": name, "exp_alerts": []},
        {"eval_time": "2m", "alertname": name, "exp_alerts": expect("warning")},
        {"eval_time": "3m", "alertname": name, "exp_alerts": expect("warning")},
        {"eval_time": "4m", "alertname": name, "exp_alerts": expect("critical")},
        {"eval_time": "5m", "alertname": name, "exp_alerts": []},
        *(
            {"eval_time": f"{m}m", "alertname": findings[f"TokenmillFinding{_camel(other)}"]
             ["alert"], "exp_alerts": []}
            for m in range(8)
        ),
    ]  # fmt: skip
    spec = tmp_path / "findings.test.yml"
    spec.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(rules_file)],
                "evaluation_interval": "1m",
                "group_eval_order": [RECORDING_GROUP, ALERT_GROUP, FINDINGS_GROUP],
                "tests": [{"interval": "1m", "input_series": inputs, "alert_rule_test": checks}],
            },
            sort_keys=False,
            width=10_000,
        )
    )
    r = subprocess.run(
        [_promtool(), "test", "rules", str(spec)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# every series named exists in /metrics; the Grafana dashboard


def _metrics_names() -> set[str]:
    """Sample names of a real ``/metrics`` render: ServingMetrics fed one request of each
    outcome, a step and the engine state (so labelled counters exist too)."""
    m = ServingMetrics(MODEL)
    m.set_drops_source(lambda: {("spans", "queue_full"): 0})
    ok = dict(
        tenant="t",
        http_status=200,
        finish_reason="stop",
        ttft_ms=50.0,
        queue_ms=1.0,
        prefill_ms=40.0,
        decode_ms=60.0,
        tpot_ms=20.0,
        e2e_ms=110.0,
        input_tokens=30,
        output_tokens=4,
        cached_tokens=16,
    )
    m.observe_request(ok, [20.0, 20.0, 20.0])
    m.observe_request(
        {**ok, "finish_reason": "error", "error_type": "nan_logits", "http_status": 500}, []
    )
    m.observe_step(
        dict(num_prefill_tokens=30, num_decode_tokens=1, num_running=1, num_waiting=0,
             kv_blocks_total=64, kv_blocks_used=3, num_preempted=1)
    )  # fmt: skip
    m.set_engine_state(restarts=0, in_flight=1)
    body, _ = m.render()
    names = {s.name for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}
    return names | _live_names()


def _live_names() -> set[str]:
    """Sample names of the live diagnosis loop's series (``LiveMetrics``), one finding open."""
    from prometheus_client import CollectorRegistry, generate_latest

    from tokenmill.diagnose.live_service import LiveMetrics

    registry = CollectorRegistry()
    live = LiveMetrics(registry)
    live.active.labels("ttft_queueing", "warning").set(1)
    live.confidence.labels("ttft_queueing").set(0.9)
    live.opened.labels("ttft_queueing").inc()
    live.runs.labels("judged").inc()
    live.run_seconds.observe(0.1)
    text = generate_latest(registry).decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def _names_in(expr: str) -> set[str]:
    return set(re.findall(r"\btokenmill_[a-z0-9_]+", expr))


def test_every_series_the_alerts_and_dashboard_read_is_in_metrics(rules_file):
    have = _metrics_names()
    doc = yaml.safe_load(rules_file.read_text())
    used = set().union(*(_names_in(r["expr"]) for g in doc["groups"] for r in g["rules"]))
    dash = json.loads(tm("export", "grafana").stdout)
    dash_used = set().union(*(_names_in(t["expr"]) for p in dash["panels"] for t in p["targets"]))
    assert len(used) >= 12 and len(dash_used) >= 12
    for name in sorted(used | dash_used):
        # a series is either a sample name as rendered (_bucket, _sum, _count, _total) or a
        # histogram's family name
        assert name in have or f"{name}_bucket" in have, f"{name} is not in /metrics"


def test_grafana_dashboard_is_dashboard_json(tmp_path):
    out = tmp_path / "dash.json"
    r = tm("export", "grafana", "--out", str(out))
    assert r.returncode == 0 and r.stdout == "", r.stderr
    d = json.loads(out.read_text())
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert d["title"] and d["uid"] and d["time"]["from"].startswith("now-")
    names = {v["name"] for v in d["templating"]["list"]}
    assert names == {"datasource", "model_name"}
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) >= 12
    kinds = {p["type"] for p in d["panels"]}
    assert kinds == {"stat", "timeseries"}
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"] and t["refId"] and t["datasource"]["type"] == "prometheus"
    # no two panels overlap on the grid
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, p["title"]
        cells |= mine
    titles = {p["title"] for p in d["panels"]}
    assert {"TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "Error rate", "KV usage"} <= titles


def test_grafana_queries_are_valid_promql(tmp_path):
    """Each panel query, with Grafana's variables filled in, parses as PromQL (promtool checks
    it as a recording rule)."""
    d = json.loads(tm("export", "grafana").stdout)
    rules = []
    for p in d["panels"]:
        for t in p["targets"]:
            expr = t["expr"].replace("$__rate_interval", "5m").replace("$model_name", ".*")
            assert "$" not in expr, expr
            rules.append({"record": f"grafana:panel_{p['id']}_{t['refId']}", "expr": expr})
    path = tmp_path / "grafana-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "grafana", "rules": rules}]}))
    check = subprocess.run(
        [_promtool(), "check", "rules", str(path)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


# ---------------------------------------------------------------------------------------------
# bad input


def _bad(r: subprocess.CompletedProcess, needle: str) -> None:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], lines
    assert "Traceback" not in r.stderr + r.stdout


def test_bad_input_is_one_line_exit_2(tmp_path):
    missing = tmp_path / "no-such-dir" / "rules.yml"
    _bad(tm("export", "prometheus-rules", "--out", str(missing)), "cannot write")
    _bad(tm("export", "grafana", "--out", str(tmp_path)), "cannot write")
    _bad(tm("export", "alertmanager"), "No such command")
    _bad(tm("export", "prometheus-rules", "--group-by", "model-name"), "--group-by")
    _bad(tm("export", "prometheus-rules", "--group-by", "le"), "--group-by")
    _bad(
        tm("export", "prometheus-rules", "--client-ttft-metric", "client ttft"),
        "--client-ttft-metric",
    )
    _bad(tm("export", "grafana", "--bogus"), "No such option")
    assert not missing.exists()
