"""``rank_straggler``: one tensor-parallel rank is consistently slower than the others."""

from __future__ import annotations

from ..signals import Signals, Window
from ._common import Evidence, Param, Rule, _ms, _when, _window_evidence


def detect(sig: Signals, p: dict) -> Evidence | None:
    def hit(w: Window) -> bool:
        return (
            (w.get("rank_samples") or 0) >= p["min_samples"]
            and (w.get("slowest_rank_share") or 0) >= p["consistency"]
            and (w.get("rank_spread_p50") or 0) >= p["spread"]
        )

    hits = [w for w in sig.busy() if hit(w)]
    if not hits:
        return None
    w = max(hits, key=lambda w: w.get("rank_spread_p50"))
    spread, rank = w.get("rank_spread_p50"), w.get("slowest_rank")
    return _window_evidence(
        f"rank {rank} was the slowest of {sig.config.tensor_parallel_size} ranks in "
        f"{w.get('slowest_rank_share'):.0%} of the {w.get('rank_samples')} samples in "
        f"{_when(w)}: its forward outside collectives took {_ms(w.get('slowest_rank_ms'))} "
        f"against {_ms(w.get('fastest_rank_ms'))} for the fastest ({spread:.1f}x), and the "
        "others wait for it at every all-reduce",
        {
            "slowest_rank": rank,
            "slowest_rank_share": w.get("slowest_rank_share"),
            "rank_spread_p50": spread,
            "slowest_rank_ms": w.get("slowest_rank_ms"),
            "fastest_rank_ms": w.get("fastest_rank_ms"),
            "rank_samples": w.get("rank_samples"),
            "decode_collective_share": w.get("decode_collective_share"),
            "tensor_parallel_size": sig.config.tensor_parallel_size,
        },
        w,
        "",
        spread,
        p["spread"],
        w.get("slowest_rank_share") / p["consistency"],
    )


RULE = Rule(
    id="rank_straggler",
    own_test="the ranks' compute times, sampled every 16 steps",
    title="One tensor-parallel rank is slower than the others",
    symptom="one rank's forward time outside collectives well above the others', sample after sample",
    causes=(
        "that rank's core or GPU is shared with other work (a noisy neighbour, another process)",
        "that device runs slower (thermal or power throttling, a lower clock, a slower link)",
        "the split gives that rank more work (uneven heads or KV heads replicated on it)",
    ),
    checks=(
        "engine_steps.rank_compute_ms: which index is largest, and by how much",
        "the slow rank's device samples (GPU clocks, throttle reasons) or host CPU share",
        "the shard plan: heads per rank (engine/parallel/tensor_parallel.py plan_shard)",
    ),
    knob="move the slow rank off its shared core or device, or drop to fewer ranks and more "
    "--data-parallel-size replicas",
    params={
        "spread": Param(1.5, "slowest rank's compute over the fastest's, median of the samples"),
        "consistency": Param(
            0.8, "share of the samples the same rank is the slowest (a straggler, not noise)"
        ),
        "min_samples": Param(2, "samples (one every 16 steps) in the window, at least"),
    },
    detect=detect,
    healthy_baseline="absolute",
    explains=("tp_communication_bound",),
    evidence_signals=("rank_spread_p50", "slowest_rank_share", "decode_collective_share"),
    reads=("requests", "completions", "collectives", "ranks"),
)
