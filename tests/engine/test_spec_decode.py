"""Speculative decoding (n-gram prompt lookup): the config's errors, the proposer, and the
verifier's exactness. With temperature the tokens must follow the target distribution: a
chi-square test on a tiny dummy model compares the tokens sampled in speculating steps with
the model's own probabilities. Greedy equality on the default model is in
``tests/engine/test_engine_batching.py``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter

import pytest
import torch
from tiny_model import write_tiny_llama

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.llm import LLM
from tokenmill.engine.request import Request
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.scheduler import ScheduledChunk, SchedulerOutput
from tokenmill.engine.spec_config import parse_speculative_config
from tokenmill.engine.spec_decode import propose_ngram, verify
from tokenmill.engine.tokenizer import load_tokenizer

BAD_CONFIGS = [
    ('{"method": "ngram", "num_speculative_tokens": 4', "not valid JSON"),
    ("[4]", "expected a JSON object"),
    ('{"num_speculative_tokens": 4}', "speculative_config.method: required"),
    ('{"method": "eagle"}', "speculative_config.method: unknown method 'eagle'"),
    (
        '{"method": "ngram", "num_speculative_tokens": 0}',
        "num_speculative_tokens: must be in 1..16",
    ),
    (
        '{"method": "ngram", "num_speculative_tokens": 17}',
        "num_speculative_tokens: must be in 1..16",
    ),
    (
        '{"method": "ngram", "num_speculative_tokens": "4"}',
        "num_speculative_tokens: must be an integer",
    ),
    (
        '{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}',
        "prompt_lookup_min: 5 is above prompt_lookup_max 3",
    ),
    ('{"method": "ngram", "prompt_lookup_min": 0}', "prompt_lookup_min: must be in 1..32"),
    ('{"method": "ngram", "lookahead": 3}', "speculative_config.lookahead: unknown field"),
    ('{"method": "ngram", "disable_by_batch_size": 0}', "disable_by_batch_size: must be >= 1"),
    ('{"method": "ngram", "prompt_lookup_max": 0}', "prompt_lookup_max: must be in 1..32, got 0"),
    ('{"method": "ngram", "prompt_lookup_max": 40}', "prompt_lookup_max: must be in 1..32"),
    ("", "speculative_config: empty"),
    ("   ", "speculative_config: empty"),
    ('{"method": "ngram"', "not valid JSON"),
]


@pytest.mark.parametrize("text,message", BAD_CONFIGS)
def test_bad_speculative_config_is_one_line_naming_the_field(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        parse_speculative_config(text)
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(speculative_config=text).validate()


def test_serve_refuses_a_bad_speculative_config_at_startup():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.engine.cli",
            "serve",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 0}',
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: speculative_config.num_speculative_tokens")


def test_config_defaults_and_partial_lookup_bounds():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 2, 4)
    assert (
        parse_speculative_config('{"method": "ngram", "prompt_lookup_max": 1}').prompt_lookup_min
        == 1
    )
    assert (
        parse_speculative_config('{"method": "ngram", "prompt_lookup_min": 6}').prompt_lookup_max
        == 6
    )
    assert parse_speculative_config(None) is None
    nulls = '{"method": "ngram", "num_speculative_tokens": null, "disable_by_batch_size": null}'
    assert parse_speculative_config(nulls) == parse_speculative_config('{"method": "ngram"}')


def test_propose_ngram_prefers_the_longest_then_most_recent_match():
    # "5 6" occurs twice; the longer pattern "4 5 6" only once, so it wins
    tokens = [4, 5, 6, 10, 11, 12, 9, 5, 6, 20, 21, 4, 5, 6]
    assert propose_ngram(tokens, 3, 1, 3) == [10, 11, 12]
    # with trigrams ruled out, the most recent bigram "5 6" (followed by 20 21 4) wins
    assert propose_ngram(tokens, 3, 1, 2) == [20, 21, 4]
    assert propose_ngram(tokens, 3, 4, 4) == []  # no earlier 4-gram
    assert propose_ngram([1, 2, 3], 2, 1, 3) == []  # nothing repeats
    # a match too close to the end for k tokens: the earliest match gives the longest run
    assert propose_ngram([7, 7, 7, 7], 4, 1, 2) == [7, 7]


def test_verify_greedy_keeps_the_matching_prefix_and_adds_the_targets_token():
    vocab = 10
    best = [3, 1, 4, 1]  # the target's argmax at each of K + 1 = 4 rows
    logits = torch.full((4, vocab), -5.0)
    logits[torch.arange(4), torch.tensor(best)] = 5.0
    greedy = SamplingParams(temperature=0.0)
    assert verify(logits, [3, 1, 4], greedy, None) == ([3, 1, 4, 1], 3)  # all + bonus
    assert verify(logits, [3, 9, 4], greedy, None) == ([3, 1], 1)  # rejected at position 1
    assert verify(logits, [8, 1, 4], greedy, None) == ([3], 0)


def _tiny_core(tmp_path, smollm2_dir, spec: dict) -> EngineCore:
    """A 1-layer dummy Llama with an 8-token vocabulary (SmolLM2's tokenizer for text)."""
    write_tiny_llama(tmp_path, vocab_size=8)
    torch.manual_seed(0)
    cfg = EngineConfig(
        model=str(tmp_path),
        load_format="dummy",
        block_size=4,
        num_gpu_blocks_override=1024,
        max_num_seqs=128,
        speculative_config=json.dumps(spec),
    )
    return EngineCore(cfg, tokenizer=load_tokenizer(smollm2_dir))


def _next_token_probs(core: EngineCore, tokens: list[int], params: SamplingParams) -> torch.Tensor:
    """The target distribution after ``tokens``: one forward of the engine's own model on a
    fresh KV pool (blocks from the free end), then the sampler's temperature/filter step."""
    from tokenmill.engine.sampling import _filtered_probs

    r = Request("probe", tokens, params)
    r.block_ids = list(range(core.block_manager.num_blocks - 16, core.block_manager.num_blocks))
    out = SchedulerOutput(step_id=0, chunks=[ScheduledChunk(r, 0, len(tokens))])
    logits = core.runner.execute(out)
    return _filtered_probs(logits[0], params)


def _wilson_hilferty(df: int, z: float) -> float:
    """Chi-square quantile for ``df`` degrees of freedom at the normal quantile ``z``
    (Wilson & Hilferty 1931; within 1% of the exact value for df >= 10)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_distribution(tmp_path, smollm2_dir):
    """3,000 requests at temperature 1: the prompt holds every token of the 8-token vocabulary,
    so each request's first token t1 has an earlier 1-gram match and its second step verifies
    two drafts. The joint distribution of (t1, t2) must equal p(t1) p(t2 | t1) from the model
    (chi-square, p = 0.001). Accepting every draft, or resampling from p without removing the
    rejected draft, moves mass onto the drafted tokens and fails it (checked by hand)."""
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 1,
    }
    core = _tiny_core(tmp_path, smollm2_dir, spec)
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 4, 6, 1, 3, 5, 7]
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    p1 = _next_token_probs(core, prompt, params)
    p2 = torch.stack([_next_token_probs(core, [*prompt, t], params) for t in range(8)])
    expected = (p1[:, None] * p2).flatten()  # P(t1, t2) over 64 cells

    torch.manual_seed(1234)
    n = 3000
    llm = LLM(core=core)
    results = llm.generate([prompt] * n, params)
    drafted = sum(r.num_draft_tokens for r in llm.step_records)
    accepted = sum(r.num_accepted_tokens for r in llm.step_records)
    assert drafted >= 2 * n  # every request's second step verified two drafts
    assert 0 < accepted < drafted  # some drafts accepted, some rejected
    counts = Counter(r.token_ids[0] * 8 + r.token_ids[1] for r in results)
    # chi-square over cells expected >= 5, the rest pooled into one cell
    big = [i for i in range(64) if expected[i] * n >= 5]
    obs = [counts.get(i, 0) for i in big] + [n - sum(counts.get(i, 0) for i in big)]
    exp = [float(expected[i]) * n for i in big] + [n - sum(float(expected[i]) * n for i in big)]
    cells = [(o, e) for o, e in zip(obs, exp) if e > 0]
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    assert df >= 20, df
    assert stat < _wilson_hilferty(df, 3.09), (stat, df)


@pytest.mark.slow
def test_served_stream_with_speculation(tmp_path, smollm2_dir):
    """Through the real server: a copy prompt streamed with speculation on. Several tokens of
    one step go out as one SSE chunk; usage.completion_tokens stays exact; the text equals a
    non-streamed run; the trace store and /metrics count drafts and accepted tokens."""
    import duckdb
    import httpx
    from server_proc import Server

    db = tmp_path / "traces.duckdb"
    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    server = Server(
        tmp_path, "--model", str(smollm2_dir), "--speculative-config", spec, "--trace-db", str(db)
    )
    text = (
        "Repeat exactly: the red fox ran past the old mill, over the bridge, and into the "
        "dark wood beyond the river."
    )
    body = {
        "model": "smollm2-135m-instruct",
        "max_tokens": 48,
        "temperature": 0,
        "messages": [{"role": "user", "content": text}],
    }
    try:
        chunks, usage = [], None
        with httpx.stream(
            "POST",
            server.url + "/v1/chat/completions",
            timeout=120,
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        ) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices", []):
                    if choice["delta"].get("content"):
                        chunks.append(choice["delta"]["content"])
        whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
        # a stop token id in the middle of the answer (vLLM's extension)
        answer = whole["choices"][0]["message"]["content"]
        ids = load_tokenizer(smollm2_dir).encode(answer, add_special_tokens=False)
        stop_id = next(t for t in ids[6:] if ids.index(t) >= 6)
        cut = httpx.post(
            server.url + "/v1/chat/completions",
            json={**body, "stop_token_ids": [stop_id]},
            timeout=120,
        ).json()
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        server.stop()
    assert "".join(chunks) == whole["choices"][0]["message"]["content"]
    n = usage["completion_tokens"]
    assert n == whole["usage"]["completion_tokens"]
    assert len(chunks) < n  # some chunks carried several tokens (one chunk per engine step)
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert 6 < cut["usage"]["completion_tokens"] < n
    assert answer.startswith(cut["choices"][0]["message"]["content"])
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute(
        "SELECT output_tokens, spec_drafts, spec_draft_tokens, spec_accepted_tokens "
        "FROM requests ORDER BY arrival_ns"
    ).fetchall()
    steps = con.execute(
        "SELECT sum(num_draft_tokens), sum(num_accepted_tokens) FROM engine_steps"
    ).fetchone()
    con.close()
    assert [r[0] for r in rows] == [n, n, cut["usage"]["completion_tokens"]]
    assert all(0 < r[3] <= r[2] and r[1] > 0 for r in rows[:2]), rows
    assert steps == (sum(r[2] for r in rows), sum(r[3] for r in rows))
    accepted = sum(r[3] for r in rows)
    line = next(
        ln
        for ln in metrics.splitlines()
        if ln.startswith("tokenmill_spec_decode_num_accepted_tokens_total{")
    )
    assert float(line.rsplit(" ", 1)[1]) == accepted


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size(tmp_path, smollm2_dir):
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 1,
        "disable_by_batch_size": 2,
    }
    llm = LLM(core=_tiny_core(tmp_path, smollm2_dir, spec))
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 4, 6]
    # four requests run together, then two of them (longer answers) alone
    lengths = [6, 6, 30, 30]
    for i, n in enumerate(lengths):
        llm.core.add_request(
            f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )
    records = []
    while llm.core.has_work():
        running_before = len(llm.core.scheduler.running)
        _, record = llm.core.step()
        records.append((running_before, record))
    assert any(n > 2 for n, _ in records) and any(0 < n <= 2 for n, _ in records)
    assert all(r.num_draft_tokens == 0 for n, r in records if n > 2)
    assert sum(r.num_draft_tokens for n, r in records if n <= 2) > 0
