"""The one ``traceparent`` reader and writer (W3C Trace Context), and its users: the server's
root span continues the caller's trace, the proxy passes a child of it upstream."""

from __future__ import annotations

import pytest

from tokenmill.engine.api.traceparent import TraceParent, new_traceparent, parse_traceparent
from tokenmill.proxy.observe import new_trace

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


def test_a_valid_header_is_read_field_by_field():
    tp = parse_traceparent(f"00-{TRACE}-{SPAN}-01")
    assert tp == TraceParent(TRACE, SPAN, 1, "00")
    assert tp.sampled and tp.header() == f"00-{TRACE}-{SPAN}-01"
    assert not parse_traceparent(f"00-{TRACE}-{SPAN}-00").sampled
    assert parse_traceparent(f"00-{TRACE}-{SPAN}-01".encode()) == tp  # a raw ASGI header


def test_upper_case_hex_is_taken_and_kept_lower_case():
    assert parse_traceparent(f" 00-{TRACE.upper()}-{SPAN.upper()}-01 ").trace_id == TRACE


def test_a_later_version_may_carry_more_fields():
    assert parse_traceparent(f"01-{TRACE}-{SPAN}-01-extra").trace_id == TRACE


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "garbage",
        f"00-{'0' * 32}-{SPAN}-01",  # an all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # an all-zero parent id
        f"ff-{TRACE}-{SPAN}-01",  # the forbidden version
        f"00-{TRACE}-{SPAN}-01-extra",  # version 00 has exactly four fields
        f"00-{TRACE[:-1]}-{SPAN}-01",  # a short trace id
        f"00-{TRACE[:-1]}g-{SPAN}-01",  # not hex
    ],
)
def test_an_invalid_header_is_none(value):
    assert parse_traceparent(value) is None


def test_a_new_span_joins_the_given_trace_or_starts_one():
    child = new_traceparent(TRACE)
    assert child.trace_id == TRACE and child.span_id != SPAN and child.sampled
    assert parse_traceparent(child.header()) == child
    fresh = new_traceparent()
    assert len(fresh.trace_id) == 32 and fresh.trace_id != TRACE


def test_the_proxy_continues_a_valid_caller_trace_and_replaces_an_invalid_one():
    trace_id, span_id, upstream = new_trace(f"00-{TRACE}-{SPAN}-00")
    assert trace_id == TRACE and upstream == f"00-{TRACE}-{span_id}-01"  # sampled upstream
    trace_id, _, upstream = new_trace(f"00-{'0' * 32}-{SPAN}-01")
    assert trace_id != "0" * 32 and parse_traceparent(upstream).trace_id == trace_id
