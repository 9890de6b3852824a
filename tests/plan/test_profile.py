"""The profile sweep's levels (``plan/profile.py``): batch sizes up to ``max_num_seqs``, each
prompt length clipped to the context, no more requests at once than the KV pool holds."""

import re

import pytest

from tokenmill.plan.profile import ProfileError, batch_sizes, check_profile, plan_levels
from tokenmill.telemetry.recorded_config import RecordedConfig


def test_batch_sizes_double_up_to_max_num_seqs():
    assert batch_sizes(16) == [1, 2, 4, 8, 16]
    assert batch_sizes(6) == [1, 2, 4, 6]
    assert batch_sizes(1) == [1]


def test_levels_fit_the_context_and_the_pool():
    cfg = RecordedConfig(max_num_seqs=16, max_model_len=400, block_size=16)
    # 90% of 240 blocks: 3456 tokens; 128 + 32 tokens fit 21 at once, 367 + 32 fit 8
    assert plan_levels(cfg, 240) == [
        (128, 1), (128, 2), (128, 4), (128, 8), (128, 16),
        (367, 1), (367, 2), (367, 4), (367, 8),
    ]  # fmt: skip


def test_a_profile_of_another_setup_is_refused():
    mine = RecordedConfig(recorded=True, model="m", quantization="int8")
    check_profile(mine, RecordedConfig(recorded=True, model="m", quantization="int8"), "p")
    for other, says in (
        (RecordedConfig(recorded=True, model="m", quantization=None), "quantization None"),
        (RecordedConfig(recorded=True, model="n", quantization="int8"), "model 'n'"),
        (RecordedConfig(), "records no engine config"),
    ):
        with pytest.raises(ProfileError, match=re.escape(says)):
            check_profile(mine, other, "p")
