"""``tp_communication_bound``: tensor-parallel decode steps spend their time in collectives."""

from __future__ import annotations

from ..signals import Signals, Window
from ._common import Evidence, Param, Rule, _ms, _when, _window_evidence


def detect(sig: Signals, p: dict) -> Evidence | None:
    def hit(w: Window) -> bool:
        return (w.get("collective_decode_steps") or 0) >= p["min_steps"] and (
            w.get("decode_collective_share") or 0
        ) >= p["share"]

    hits = [w for w in sig.busy() if hit(w)]
    if not hits:
        return None
    w = max(hits, key=lambda w: w.get("decode_collective_share"))
    share = w.get("decode_collective_share")
    prefill = w.get("prefill_collective_share")
    tp = sig.config.tensor_parallel_size
    dp = sig.config.data_parallel_size
    kb = (w.get("decode_collective_bytes_mean") or 0) / 1024
    prefill_part = ""
    if prefill is not None:
        # prefill's many tokens hide the same all-reduces (the seed's point) unless the ranks
        # themselves wait on each other (shared cores), when prefill shows it too
        hidden = prefill < share / 2
        prefill_part = f"; in prefill steps {prefill:.0%}" + (
            ", hidden behind their compute" if hidden else ", so the ranks wait on each other"
        )
    return _window_evidence(
        f"decode steps in {_when(w)} spent {share:.0%} of their forward in collectives "
        f"({_ms(w.get('decode_collective_ms_mean'))} of {_ms(w.get('decode_forward_ms_mean'))} "
        f"a step, {kb:.0f} KB moved) with --tensor-parallel-size {tp}{prefill_part}",
        {
            "decode_collective_share": share,
            "decode_collective_ms_mean": w.get("decode_collective_ms_mean"),
            "decode_forward_ms_mean": w.get("decode_forward_ms_mean"),
            "decode_collective_bytes_mean": w.get("decode_collective_bytes_mean"),
            "prefill_collective_share": prefill,
            "collective_decode_steps": w.get("collective_decode_steps"),
            "tensor_parallel_size": tp,
            "data_parallel_size": dp,
        },
        w,
        "",
        share,
        p["share"],
    )


RULE = Rule(
    id="tp_communication_bound",
    own_test="the collectives' share of the steps",
    title="Tensor-parallel decode waits on collectives",
    symptom="decode steps spend a large share of their forward in all-reduces (tensor parallel)",
    causes=(
        "too many ranks for the model: each rank's slice of a decode step is small, its two "
        "all-reduces a layer are not",
        "the ranks share cores or a slow link (gloo over TCP, PCIe without NVLink)",
        "one rank is slower and the others wait for it at every all-reduce",
    ),
    checks=(
        "collective_ms against forward_ms of decode-only steps (engine_steps)",
        "the same in prefill steps: a low share there means the cost is per step, not per token",
        "cores or devices per rank (one core each at least; NVLink between GPUs)",
    ),
    knob="fewer --tensor-parallel-size ranks and more --data-parallel-size replicas (seed 003 "
    "§5.2: for a small model prefer single-device replicas)",
    params={
        "share": Param(
            0.3,
            "collectives' share of a decode step's forward; seed 003 §5.2 pitfall 5 (exposed "
            "in decode)",
        ),
        "min_steps": Param(5, "decode-only steps with collectives in the window, at least"),
    },
    detect=detect,
    healthy_baseline="absolute",
    explains=("host_bound_steps", "batching_ineffective", "host_contention"),
    evidence_signals=(
        "decode_collective_share",
        "decode_collective_ms_mean",
        "prefill_collective_share",
    ),
    reads=("requests", "completions", "collectives"),
)
