"""The engine on the real default model: batching, chunking, prefix caching and preemption never
change a greedy request's tokens — each equals the request run alone and transformers' generate."""

from __future__ import annotations

import pytest
import torch
import transformers

from tokenmill.engine.core import EngineCore
from tokenmill.engine.llm import LLM
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.tokenizer import encode_chat

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
SHARED = (
    "You are a careful assistant for a logistics company. Answer briefly, cite the rule you used, "
    "and never invent tracking numbers. "
)
TOPICS = [
    "Where is my parcel?",
    "How do I return a broken lamp?",
    "Explain customs duties for books.",
    "What does 'out for delivery' mean?",
    "Can I change the delivery address after shipping?",
    "List three ways to pack glass safely.",
    "Why was my package held at the depot for two days?",
    "Translate 'fragile' into French.",
]


def prompts(tokenizer) -> list[list[int]]:
    """16 chats of 40-140 tokens; the chat template's system prompt is a shared prefix."""
    out = []
    for i, topic in enumerate(TOPICS):
        out.append(encode_chat(tokenizer, SHARED + topic))
        out.append(encode_chat(tokenizer, f"Question {i}: {topic} " * (1 + i % 4)))
    return out


@pytest.fixture(scope="module")
def base(smollm2_dir):
    llm = LLM(str(smollm2_dir), device="cpu", dtype="float32")
    ps = prompts(llm.tokenizer)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for p in ps:
            expected.append(
                hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[
                    0, len(p) :
                ].tolist()
            )
    return llm, ps, expected


def engine_like(base_llm: LLM, **overrides) -> LLM:
    """A fresh engine (own KV pool and scheduler) sharing the already-loaded model weights."""
    cfg = base_llm.config.__class__(**{**base_llm.config.to_dict(), **overrides})
    core = EngineCore(cfg, runner=_runner_with_blocks(base_llm, cfg), tokenizer=base_llm.tokenizer)
    return LLM(core=core)


def _runner_with_blocks(base_llm: LLM, cfg):
    from tokenmill.engine.kv_cache import allocate_kv_caches

    runner = base_llm.core.runner
    clone = object.__new__(type(runner))
    clone.__dict__.update(runner.__dict__)
    clone.config = cfg
    clone.block_size = cfg.block_size
    clone.num_blocks = cfg.num_gpu_blocks_override or runner.num_blocks
    clone.kv_caches = allocate_kv_caches(
        runner.model_config, clone.num_blocks, cfg.block_size, runner.dtype, runner.device
    )
    return clone


def test_sixteen_alone_equal_transformers(base):
    llm, ps, expected = base
    for p, e in zip(ps, expected):
        (alone,) = llm.generate([p], SamplingParams(max_tokens=MAX_TOKENS))
        assert alone.token_ids == e


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"enable_chunked_prefill": False},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 48},  # small budget: prompts split into several chunks
        {
            "num_gpu_blocks_override": 24,
            "max_num_batched_tokens": 96,
        },  # tiny pool: forced preemption
        # chunked prefill (a budget that spreads the prompts over steps) and prefix caching on
        {"speculative_config": SPEC, "max_num_batched_tokens": 128},
        {"speculative_config": SPEC, "num_gpu_blocks_override": 24, "max_num_batched_tokens": 96},
    ],
    ids=[
        "default",
        "chunked-off",
        "prefix-off",
        "small-chunks",
        "preemption",
        "spec",
        "spec-preemption",
    ],
)
def test_sixteen_concurrent_equal_alone(base, overrides):
    llm, ps, expected = base
    engine = engine_like(llm, **overrides)
    results = engine.generate(ps, SamplingParams(max_tokens=MAX_TOKENS))
    assert [r.token_ids for r in results] == expected
    assert sum(len(t) for t in expected) > 12 * MAX_TOKENS  # real answers, not an early EOS
    records = engine.step_records
    assert max(r.num_running for r in records) > 1  # really batched
    if "speculative_config" in overrides:  # drafts verified in steps mixed with prefill chunks
        assert sum(r.num_accepted_tokens for r in records) > 0
        assert sum(r.num_draft_tokens > r.num_accepted_tokens for r in records) > 0
        assert any(r.num_draft_tokens and r.num_prefill_tokens for r in records)
    if "num_gpu_blocks_override" in overrides:
        assert sum(r.stats.preemptions for r in results) > 0
        assert sum(r.stats.recomputed_tokens for r in results) > 0
    if overrides.get("max_num_batched_tokens") == 48:
        assert max(r.num_prefill_chunks for r in records) >= 2
        assert all(r.num_prefill_tokens + r.num_decode_tokens <= 48 for r in records)
    if overrides.get("enable_chunked_prefill") is False:
        # prefill-only steps: no step mixes prefill tokens with decodes
        assert not any(r.num_prefill_tokens and r.num_decode_tokens for r in records)


def test_prefix_cache_serves_a_shared_system_prompt(base):
    llm, _, _ = base
    engine = engine_like(llm)
    system = llm.tokenizer.encode(
        "Rules: " + " ".join(f"rule {i} says be kind;" for i in range(60))
    )[:200]
    assert len(system) == 200
    first = engine.generate(
        [[*system, *llm.tokenizer.encode(" Hi there")]], SamplingParams(max_tokens=4)
    )[0]
    prefill_first = sum(r.num_prefill_tokens for r in engine.step_records)
    engine.step_records.clear()
    second_prompt = [*system, *llm.tokenizer.encode(" What now?")]
    second = engine.generate([second_prompt], SamplingParams(max_tokens=4))[0]
    prefill_second = sum(r.num_prefill_tokens for r in engine.step_records)
    assert first.stats.cached_tokens == 0
    assert second.stats.cached_tokens >= 192
    assert prefill_second == len(second_prompt) - second.stats.cached_tokens
    assert prefill_second < prefill_first / 10


def test_stop_string_inside_an_accepted_run_cuts_it_there(base):
    """Speculation: a stop string that falls in the middle of a run of accepted drafts ends the
    request at that token, exactly as without speculation (same tokens, text, stop reason)."""
    llm, _, _ = base
    passage = "The quick brown fox jumps over the lazy dog near the quiet river bank at dawn."
    prompt = encode_chat(llm.tokenizer, f"Repeat this sentence exactly, once: {passage}")
    spec = engine_like(llm, speculative_config=SPEC)
    (free,) = spec.generate([prompt], SamplingParams(max_tokens=40))
    assert sum(r.num_accepted_tokens for r in spec.step_records) >= 8  # it copies in runs
    stop = None
    for j in range(1, len(free.token_ids) - 1):
        # token j arrived with the tokens before and after it: the middle of an accepted run
        if not free.token_ns[j - 1] == free.token_ns[j] == free.token_ns[j + 1]:
            continue
        word = llm.tokenizer.decode([free.token_ids[j]]).strip()
        before = llm.tokenizer.decode(free.token_ids[:j])
        if len(word) >= 3 and word not in before:
            stop = word
            break
    assert stop is not None, llm.tokenizer.decode(free.token_ids)
    params = SamplingParams(max_tokens=40, stop=[stop])
    (cut,) = engine_like(llm, speculative_config=SPEC).generate([prompt], params)
    (plain,) = engine_like(llm).generate([prompt], params)
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.token_ids == plain.token_ids and cut.text == plain.text
    assert len(cut.token_ids) <= j + 1 < len(free.token_ids)
    assert stop not in cut.text  # the stop string itself is not returned


def test_each_step_records_the_longest_wait_in_the_queue(base):
    """The queue as it stands at each step's start: the longest-waiting request not yet
    scheduled, its wait so far and its prompt size, equal to what the requests' own milestones
    say afterwards (queued before the step started, first scheduled after it)."""
    llm, ps, _ = base
    engine = engine_like(llm, max_num_seqs=2)
    results = engine.generate(ps[:6], SamplingParams(max_tokens=4))
    waited = 0
    for rec in engine.step_records:
        ahead = [r for r in results if r.stats.queued_ns <= rec.start_ns < r.stats.scheduled_ns]
        oldest = min(ahead, key=lambda r: r.stats.queued_ns, default=None)
        if oldest is None:
            assert rec.oldest_wait_ms is None and rec.oldest_wait_id is None, rec
            continue
        waited += 1
        assert rec.oldest_wait_id == oldest.request_id, (rec.step_id, ahead)
        assert rec.oldest_wait_prompt_tokens == len(oldest.prompt_token_ids)
        assert rec.oldest_wait_ms == pytest.approx((rec.start_ns - oldest.stats.queued_ns) / 1e6)
    # two run at a time: the other four wait over several steps
    assert waited >= 4, [(r.step_id, r.oldest_wait_id) for r in engine.step_records]
