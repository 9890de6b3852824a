"""The request latencies, defined once (telemetry/latency.py), and the four producers that
derive them through it: the server, the proxy, the OTLP receiver and the planner."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.engine.api.timeline import RequestTimeline
from tokenmill.proxy.observe import Exchange
from tokenmill.telemetry import latency
from tokenmill.telemetry.otlp_receiver import vllm_stamps
from tokenmill.telemetry.spans import request_row

T0 = 1_800_000_000_000_000_000
MS = 1_000_000  # ns


def test_one_request_from_its_stamps():
    out = latency.request_latencies(
        arrival=T0,
        end=T0 + 900 * MS,
        output_tokens=5,
        token_times=[T0 + 100 * MS, T0 + 120 * MS, T0 + 150 * MS, T0 + 150 * MS, T0 + 200 * MS],
        queued=T0 + 10 * MS,
        scheduled=T0 + 40 * MS,
    )
    assert out == pytest.approx(
        {
            "ttft_ms": 100.0,
            "queue_ms": 30.0,
            "prefill_ms": 60.0,
            "decode_ms": 100.0,
            "tpot_ms": 25.0,  # 100 ms over 4 tokens after the first
            # two tokens at 150 ms arrived together: three gaps (20, 30, 50), none of zero
            "itl_p50_ms": 30.0,
            "itl_p99_ms": 49.6,
            "itl_max_ms": 50.0,
            "e2e_ms": 900.0,
        }
    )
    assert tuple(out) == latency.LATENCY_COLUMNS


def test_missing_stamps_give_none_and_one_token_has_no_tpot():
    out = latency.request_latencies(arrival=T0, end=T0 + 5 * MS, output_tokens=1,
                                    token_times=[T0 + 3 * MS])  # fmt: skip
    assert out["ttft_ms"] == pytest.approx(3.0)
    assert out["tpot_ms"] is None and out["itl_p50_ms"] is None
    assert out["queue_ms"] is None and out["prefill_ms"] is None
    never = latency.request_latencies(arrival=T0, end=T0 + 5 * MS, output_tokens=0)
    assert never["ttft_ms"] is None and never["decode_ms"] is None
    assert never["e2e_ms"] == pytest.approx(5.0)


def test_arrays_give_what_each_request_gives_alone():
    """The planner's arrays (seconds, NaN for a request that never got there) and one request
    at a time agree value for value."""
    arrival = np.array([0.0, 1.0, 2.0, 3.0])
    first = np.array([0.5, 1.2, np.nan, 3.1])
    last = np.array([1.5, 1.2, np.nan, 3.4])
    end = np.array([1.6, 1.3, np.nan, 3.5])
    n = np.array([11, 1, 0, 4])
    many = latency.request_latencies(arrival=arrival, end=end, output_tokens=n, first_token=first,
                                     last_token=last, scale=latency.S, before=0.01, after=0.02)  # fmt: skip
    for i in range(4):
        one = latency.request_latencies(
            arrival=float(arrival[i]),
            end=None if np.isnan(end[i]) else float(end[i]),
            output_tokens=int(n[i]),
            first_token=None if np.isnan(first[i]) else float(first[i]),
            last_token=None if np.isnan(last[i]) else float(last[i]),
            scale=latency.S,
            before=0.01,
            after=0.02,
        )
        for col in ("ttft_ms", "tpot_ms", "e2e_ms", "decode_ms"):
            want = one[col]
            if want is None:
                assert np.isnan(many[col][i]), (col, i)
            else:
                assert many[col][i] == pytest.approx(want), (col, i)
    assert many["ttft_ms"][0] == pytest.approx(510.0)  # 0.5 s after arrival, 10 ms before it
    assert many["tpot_ms"][0] == pytest.approx(100.0)
    assert many["e2e_ms"][3] == pytest.approx(530.0)


def test_the_server_and_the_proxy_derive_the_same_numbers_from_the_same_times():
    times = [T0 + 200 * MS, T0 + 230 * MS, T0 + 290 * MS]
    tl = RequestTimeline(arrival_ns=T0, method="POST", path="/v1/chat/completions")
    tl.stats.first_token_ns, tl.stats.output_tokens = times[0], 3
    tl.token_ns.extend(times)
    served = request_row(tl, "ab" * 16, {}, T0 + 400 * MS)
    ex = Exchange(arrival_ns=T0, endpoint="chat", trace_id="ab" * 16, span_id="cd" * 8,
                  upstream="http://u", token_ns=list(times), end_ns=T0 + 400 * MS,
                  completion_tokens=3)  # fmt: skip
    proxied = ex.request_row()
    cols = ("ttft_ms", "decode_ms", "tpot_ms", "itl_p50_ms", "itl_p99_ms", "itl_max_ms", "e2e_ms")
    assert {c: served[c] for c in cols} == {c: proxied[c] for c in cols}
    assert served["ttft_ms"] == pytest.approx(200.0)
    assert served["tpot_ms"] == pytest.approx(45.0)
    assert served["itl_max_ms"] == pytest.approx(60.0)


@pytest.mark.parametrize(
    ("queue", "prefill", "ttft", "decode"),
    [(0.25, 0.5, 0.8, 3.2), (0.25, None, 0.8, 3.2), (None, 0.5, 0.8, None), (0.1, 0.2, None, 1.0)],
)
def test_vllm_durations_come_back_from_the_stamps_laid_for_them(queue, prefill, ttft, decode):
    """vLLM reports durations, not stamps: the receiver lays stamps so the one derivation
    gives each duration vLLM reported back (its TTFT may exceed queue + prefill: the API's
    time before the engine took the request)."""
    stamps = vllm_stamps(T0, queue, prefill, ttft, decode)
    out = latency.request_latencies(arrival=T0, end=T0 + 5 * 10**9, output_tokens=9, **stamps)
    assert out["ttft_ms"] == (pytest.approx(ttft * 1e3) if ttft is not None else None)
    assert out["queue_ms"] == (pytest.approx(queue * 1e3) if queue is not None and
                               (prefill is not None or ttft is not None) else out["queue_ms"])  # fmt: skip
    if ttft is not None and prefill is not None:
        assert out["prefill_ms"] == pytest.approx(prefill * 1e3)
    if ttft is not None and decode is not None:
        assert out["decode_ms"] == pytest.approx(decode * 1e3)
        assert out["tpot_ms"] == pytest.approx(decode * 1e3 / 8)
    if ttft is None:
        assert stamps["first_token"] is None and out["decode_ms"] is None
