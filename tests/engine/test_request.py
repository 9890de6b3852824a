"""Request.append_token: the one way a sampled token is added (the engine core's and the
planner's replay)."""

from __future__ import annotations

from tokenmill.engine.request import Request
from tokenmill.engine.sampling_params import SamplingParams


def test_append_token_keeps_the_output_and_its_times():
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=8))
    r.append_token(7, 100)
    r.append_token(8, 250)
    assert r.all_token_ids == [1, 2, 3, 7, 8] and r.output_token_ids == [7, 8]
    assert r.token_ns == [100, 250]
    assert r.stats.output_tokens == 2 and r.stats.first_token_ns == 100


def test_a_run_appended_at_once_without_times():
    """The planner's replay: a run of decode steps' stand-in token in one call, no times."""
    r = Request("r", [1, 2], SamplingParams(max_tokens=8))
    r.append_token(5, None)
    r.append_token(5, None, 3)
    assert r.all_token_ids == [1, 2, 5, 5, 5, 5] and r.output_token_ids == [5, 5, 5, 5]
    assert r.num_output_tokens == r.stats.output_tokens == 4
    assert r.token_ns == [] and r.stats.first_token_ns is None
    r.append_token(6, 40, 2)
    assert r.token_ns == [40, 40] and r.stats.first_token_ns == 40
