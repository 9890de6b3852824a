"""The rule set: one module per rule, collected here in a fixed order.

Each module ``<rule_id>.py`` holds everything about its rule: the detector (``detect``), which
looks at :class:`~tokenmill.diagnose.signals.Signals` and returns :class:`Evidence` or None, and
``RULE``, the :class:`Rule` with its symptom, named thresholds (each :class:`Param` says where
its number comes from), ranked causes, the checks that separate them, the knob to turn, the rules
it explains and the per-window signals the console charts as its evidence. Its runbook is
``runbooks/<rule_id>.md``. What the modules share lives in ``_common.py``.

To add a rule: write ``<rule_id>.py`` (copy a similar one), add it to :data:`RULES` below, and
write ``runbooks/<rule_id>.md`` with its line in ``runbooks/README.md``;
``tests/diagnose/test_rule_registry.py`` says what is missing.

The order of :data:`RULES` is the order rules run in and breaks ranking ties; keep new rules at
the end.
"""

from __future__ import annotations

from . import (
    batch_too_large,
    batching_ineffective,
    client_server_ttft_gap,
    engine_crash,
    engine_stalled,
    error_spike,
    gpu_throttling,
    head_of_line_blocking,
    host_bound_steps,
    host_contention,
    itl_frontend_overhead,
    itl_prefill_interference,
    kv_block_leak,
    kv_pressure_preemption,
    kv_transfer_bound,
    midstream_stall,
    oom_low_average_memory,
    overload,
    pd_ratio_imbalance,
    periodic_itl_spikes,
    prefix_cache_miss,
    quantization_no_gain,
    rank_straggler,
    replica_imbalance,
    spec_decode_ineffective,
    tp_communication_bound,
    ttft_prefill_bound,
    ttft_queueing,
)
from ._common import Evidence, Hint, Param, Rule

RULES: tuple[Rule, ...] = (
    ttft_queueing.RULE,
    ttft_prefill_bound.RULE,
    head_of_line_blocking.RULE,
    itl_prefill_interference.RULE,
    itl_frontend_overhead.RULE,
    kv_pressure_preemption.RULE,
    overload.RULE,
    oom_low_average_memory.RULE,
    kv_block_leak.RULE,
    error_spike.RULE,
    prefix_cache_miss.RULE,
    client_server_ttft_gap.RULE,
    batching_ineffective.RULE,
    batch_too_large.RULE,
    midstream_stall.RULE,
    periodic_itl_spikes.RULE,
    gpu_throttling.RULE,
    host_bound_steps.RULE,
    quantization_no_gain.RULE,
    host_contention.RULE,
    spec_decode_ineffective.RULE,
    replica_imbalance.RULE,
    tp_communication_bound.RULE,
    rank_straggler.RULE,
    kv_transfer_bound.RULE,
    pd_ratio_imbalance.RULE,
    engine_crash.RULE,
    engine_stalled.RULE,
)

RULES_BY_ID: dict[str, Rule] = {r.id: r for r in RULES}

__all__ = ["RULES", "RULES_BY_ID", "Evidence", "Hint", "Param", "Rule"]
