"""Incremental detokenizer (multi-byte, stop strings across tokens, empty tokens at flat cost)
and the batched sampler (filters, seeds, NaN rows)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.sampling import SamplingParams, sample
from tokenmill.engine.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return load_tokenizer(smollm2_dir)


def stream(tok, ids, prompt=(), stop=()):
    d = IncrementalDetokenizer(tok, list(prompt), True, stop)
    deltas, costs, hit = [], [], None
    for t in ids:
        before = d.decoded_tokens
        hit = d.add(t)
        costs.append(d.decoded_tokens - before)
        deltas.append(d.take_delta(finished=hit is not None))
        if hit:
            break
    deltas.append(d.take_delta(finished=True))
    return d, deltas, costs, hit


def test_multibyte_characters_split_across_tokens(tok):
    text = "Grüße aus 日本 🙂🚀 — naïve café"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # the emoji and CJK really are split into byte tokens
    d, deltas, _, _ = stream(tok, ids)
    assert "".join(deltas) == text == d.text
    assert not any("\ufffd" in x for x in deltas)


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(tok):
    text = "The answer is forty-two. END OF ANSWER and more text"
    ids = tok.encode(text)
    _, deltas, _, hit = stream(tok, ids, stop=("END OF ANSWER",))
    assert hit == "END OF ANSWER"
    assert "".join(deltas) == "The answer is forty-two. "
    assert not any("END" in x for x in deltas)


def test_stop_string_that_never_starts_withholds_nothing(tok):
    """A 60-character stop string that never occurs must not hold back 59 characters: every
    token's text is returned in the step that made it (issue 19, item 4)."""
    stop = "Q" * 30 + "<never-occurring stop marker, sixty chars>"[:30]
    assert len(stop) == 60
    ids = tok.encode(" one two three four five six seven eight nine ten" * 4)[:40]
    d, deltas, _, hit = stream(tok, ids, stop=(stop,))
    assert hit is None and len(ids) == 40
    assert deltas[:-1] == [tok.decode([t]) for t in ids]  # each token's text at once
    assert deltas[-1] == "" and "".join(deltas) == d.text


def test_only_a_tail_that_may_become_a_stop_string_is_withheld(tok):
    """The tail withheld is the longest one that is still a prefix of a stop string; it is
    released as soon as the next text rules the match out."""
    d = IncrementalDetokenizer(tok, [], True, ("ENDING", "zz"))
    d.text = "The END"
    assert d.held_chars() == 3 and d.take_delta() == "The "
    d.text += " is near z"
    assert d.held_chars() == 1 and d.take_delta() == "END is near "
    d.text += "oo"
    assert d.held_chars() == 0 and d.take_delta() == "zoo"
    d.text += "ENDIN"
    assert d.take_delta() == "" and d.take_delta(finished=True) == "ENDIN"


def test_stop_string_completed_after_a_released_near_miss(tok):
    text = "Say EN then END and more"
    ids = tok.encode(text)
    _, deltas, _, hit = stream(tok, ids, stop=("END",))
    assert hit == "END" and "".join(deltas) == "Say EN then "


def test_empty_tokens_keep_per_token_cost_flat(tok):
    special = tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode([special], skip_special_tokens=True) == ""
    words = tok.encode(" lorem ipsum dolor sit amet" * 90)[:450]
    ids = [words[0], special, special, *words[1:]]  # "" tokens early on, 450 tokens in all
    _, deltas, costs, _ = stream(tok, ids, prompt=tok.encode("Say:"))
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert max(costs) <= 8  # tokens decoded per new token: bounded, not growing
    assert max(costs[-100:]) == max(costs[5:105])


class EmptyTokenizer:
    """Every token decodes to "" (the worst case for a detokenizer waiting for text)."""

    def decode(self, ids, skip_special_tokens=True):
        return ""


def test_all_empty_tokens_never_grow_the_window():
    d = IncrementalDetokenizer(EmptyTokenizer(), [1, 2, 3])
    costs = []
    for t in range(600):
        before = d.decoded_tokens
        d.add(t)
        costs.append(d.decoded_tokens - before)
    assert max(costs[1:]) == 3 and max(costs) <= 8 and d.text == ""


def test_sampler_greedy_filters_seed_and_nan_rows():
    logits = torch.tensor(
        [
            [0.0, 5.0, 1.0, 0.0],
            [1.0, 1.0, 1.0, 1.0],
            [float("nan"), 0.0, 0.0, 0.0],
            [0.0, 0.0, 3.0, 2.9],
            [2.0, 0.0, 1.9, float("inf")],
        ]
    )
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=1),  # top-k 1 over a tie keeps the first maximum only
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, min_p=0.95),  # only tokens within 95% of the max survive
        SamplingParams(),
    ]
    tokens, bad = sample(logits, params, [None] * 5)
    assert tokens[0] == 1
    assert tokens[3] == 2
    assert bad == [False, False, True, False, True]
    # greedy takes the first of tied maxima; a -inf anywhere in a row fails it like NaN and inf
    ties = torch.tensor([[0.0, 7.0, 7.0, 1.0], [float("-inf"), 1.0, 4.0, 4.0]])
    assert sample(ties, [SamplingParams()] * 2, [None] * 2) == ([1, 2], [False, True])
    # a top_p that rounds to 0 in float32 keeps the most likely token instead of failing the batch
    tiny = sample(
        torch.log(torch.tensor([[0.2, 0.7, 0.1]])),
        [SamplingParams(temperature=1.0, top_p=1e-300)],
        [None],
    )
    assert tiny == ([1], [False])
    # top-p: 0.6 of the mass is token 0 alone
    skewed = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    draws = {
        sample(skewed, [SamplingParams(temperature=1.0, top_p=0.5)], [None])[0][0]
        for _ in range(30)
    }
    assert draws == {0}
    # a per-request seed gives the same draws in any batch position
    p = SamplingParams(temperature=1.0, seed=3)
    flat = torch.zeros(2, 1000)
    a = sample(flat, [p, SamplingParams()], [torch.Generator().manual_seed(3), None])[0][0]
    b = sample(flat[:1], [p], [torch.Generator().manual_seed(3)])[0][0]
    assert a == b


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -1.0),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", 2.0),
    ],
)
def test_sampling_params_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()
