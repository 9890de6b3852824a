"""What-ifs and SLOs: what parses into what, and one-line refusals naming the part."""

from __future__ import annotations

import pytest

from tokenmill.engine.config import EngineConfig
from tokenmill.plan.whatif import (
    CONFIG_FIELDS,
    KNOBS,
    knob_fields,
    knob_type,
    parse_slo,
    parse_whatif,
    whatif_help,
)


def test_whatif_parses_each_kind_of_value():
    w = parse_whatif("rate=1.5, max-num-seqs=4,chunked_prefill=off,replicas=2,kv_blocks=300")
    assert w.changes == {
        "rate": 1.5,
        "max_num_seqs": 4,
        "chunked_prefill": False,
        "replicas": 2,
        "kv_blocks": 300,
    }
    assert parse_whatif("").label == "as recorded"
    assert parse_whatif("prefix_caching=on").changes == {"prefix_caching": True}
    assert parse_whatif("step_time=1.25").changes == {"step_time": 1.25}
    # a factor as operators write it ("twice the traffic": 2x)
    assert parse_whatif("rate=2x").changes == {"rate": 2.0}
    assert parse_whatif("rate=1.5×").changes == {"rate": 1.5}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("max_batch=4", "unknown knob 'max_batch' (known: rate, requests"),
        ("rate=0", "rate=0: a factor > 0"),
        ("rate=-1", "rate=-1: a factor > 0"),
        ("rate=fast", "rate=fast: a factor > 0"),
        ("rate=x", "rate=x: a factor > 0"),
        ("rate=0x", "rate=0x: a factor > 0"),
        ("step_time=0", "step_time=0: a factor from 0.01 to 100"),
        ("step_time=inf", "step_time=inf: a factor from 0.01 to 100"),
        ("step_time=3e8", "step_time=3e8: a factor from 0.01 to 100"),
        ("step_time=0.001", "step_time=0.001: a factor from 0.01 to 100"),
        ("max_num_seqs=0", "max_num_seqs=0: an integer >= 1"),
        ("replicas=two", "replicas=two: an integer >= 1"),
        ("chunked_prefill=maybe", "on | off"),
        ("rate", "expected knob=value"),
        ("rate=2,rate=3", "rate is given twice"),
        ("disaggregation=1:1", "not replayed"),
    ],
)
def test_whatif_refusals_name_the_part(text, says):
    with pytest.raises(ValueError) as exc:
        parse_whatif(text)
    assert says in str(exc.value)
    assert "\n" not in str(exc.value)


def test_slo_bounds_and_the_per_request_goodput_bounds():
    slo = parse_slo("ttft_p99<2s, itl_p50<=150ms,e2e_p99<1m")
    assert slo.bounds == {"ttft_p99_ms": 2000.0, "itl_p50_ms": 150.0, "e2e_p99_ms": 60000.0}
    assert (slo.goodput.ttft_ms, slo.goodput.itl_ms, slo.goodput.e2e_ms) == (2000.0, 150.0, 60000.0)
    summary = {"ttft_p99_ms": 1500.0, "itl_p50_ms": 160.0, "e2e_p99_ms": 30000.0}
    assert slo.misses(summary) == {"itl_p50_ms": (160.0, 150.0)}
    assert slo.margin(summary) == pytest.approx(1 - 160 / 150)
    assert parse_slo(None).bounds == {}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("ttft_p99 2s", "expected metric<duration"),
        ("ttft_p95<2s", "unknown metric 'ttft_p95'"),
        ("ttft_p99<soon", "bad duration"),
        ("ttft_p99<0s", "ttft_p99<0s"),
    ],
)
def test_slo_refusals_name_the_part(text, says):
    with pytest.raises(ValueError) as exc:
        parse_slo(text)
    assert says in str(exc.value)


def test_each_knob_is_one_field_that_help_parsing_and_the_console_read():
    """A knob is a ``Knobs`` field: --what-if's help names every one a replay takes, each has a
    grammar its refusals quote, a config field that exists, and a console widget in bounds."""
    fields = knob_fields()
    assert list(KNOBS) == list(fields)
    shown = whatif_help().split(": ", 1)[1].rstrip(".").split(", ")
    assert [n.removesuffix(" (x)") for n in shown] == [
        n for n, f in fields.items() if not f.metadata.get("refused")
    ]
    assert "rate (x)" in shown and "step_time (x)" in shown
    assert set(CONFIG_FIELDS.values()) <= set(EngineConfig.field_names())
    for name, f in fields.items():
        assert f.metadata["help"] and f.metadata["grammar"], name
        assert knob_type(name) in (float, int, bool, str), name
        widget = f.metadata.get("console")
        if widget and knob_type(name) is not bool:
            assert widget["min"] <= (f.metadata.get("recorded") or widget["min"]) <= widget["max"]
