"""``kv_transfer_bound``: disaggregated serving spends a large share of a request's wait on
moving its KV from the prefill core to the decode core."""

from __future__ import annotations

from ..signals import Signals, Window
from ._common import Evidence, Param, Rule, _ms, _when, _window_evidence


def detect(sig: Signals, p: dict) -> Evidence | None:
    def hit(w: Window) -> bool:
        share = w.get("kv_transfer_share_of_ttft")
        return (w.get("kv_transfers") or 0) >= p["min_transfers"] and (
            share is not None and share >= p["share_of_ttft"]
        )

    hits = [w for w in sig.busy() if hit(w)]
    if not hits:
        return None
    w = max(hits, key=lambda w: w.get("kv_transfer_share_of_ttft"))
    share = w.get("kv_transfer_share_of_ttft")
    moved, itl = w.get("kv_transfer_p50"), w.get("itl_p50")
    steps = moved / itl if moved is not None and itl else None
    mb = (w.get("kv_transfer_bytes_p50") or 0) / 1e6
    gbps = mb / 1e3 / (moved / 1e3) if moved else None
    size = f"{share:.1f}x its TTFT" if share >= 1 else f"{share:.0%} of its TTFT"
    return _window_evidence(
        f"in {_when(w)} each request's KV took {_ms(moved)} (p50, {mb:.1f} MB) to move from "
        f"the prefill core to the decode core, {size} of {_ms(w.get('ttft_p50'))}: its second "
        f"token came that much after its first"
        + (f" (as long as {steps:.0f} decode steps)" if steps is not None else ""),
        {
            "kv_transfers": w.get("kv_transfers"),
            "kv_transfer_p50_ms": moved,
            "kv_transfer_share_of_ttft": share,
            "kv_transfer_mb_p50": mb,
            "kv_transfer_gbps": gbps,
            "ttft_p50_ms": w.get("ttft_p50"),
            "itl_p50_ms": itl,
            "transfer_in_decode_steps": steps,
            "kv_wait_p50_ms": w.get("kv_wait_p50"),
        },
        w,
        " AND kv_transfer_ms >= ? * ttft_ms",
        share,
        p["share_of_ttft"],
        example_params=(p["share_of_ttft"],),
    )


RULE = Rule(
    id="kv_transfer_bound",
    own_test="KV transfer time against TTFT, request by request",
    title="moving the KV between prefill and decode takes a large share of the wait",
    symptom=(
        "with --disaggregation, each request's KV transfer from the prefill to the decode core "
        "is a large share of its TTFT: the second token comes that much after the first"
    ),
    causes=(
        "a slow link between the cores (TCP/gloo between hosts, no RDMA; a busy receiving core)",
        "long prompts in a wide cache dtype: the KV of a 1,500-token prompt is 69 MB in float32",
        "one transfer at a time on the link: a burst of long prompts queues behind each other",
    ),
    checks=(
        "requests.kv_transfer_ms and kv_transfer_bytes against ttft_ms in the window",
        "the transfer's GB/s against the link's (kv_transfer_bytes / kv_transfer_ms)",
        "tokenmill_kv_transfer_seconds in /metrics",
    ),
    knob=(
        "a narrower KV (--dtype bfloat16 halves the bytes), a faster link or both sides on one "
        "host; for short prompts colocated serving (chunked prefill) may cost less"
    ),
    params={
        "share_of_ttft": Param(
            0.25,
            "KV transfer ms / TTFT ms, median over the window's requests (issue 17: the "
            "transfer is a large share of TTFT)",
        ),
        "min_transfers": Param(5, "requests handed off in the window, at least"),
    },
    detect=detect,
    healthy_baseline="absolute",
    explains=("midstream_stall",),
    evidence_signals=("kv_transfer_p50", "kv_transfer_share_of_ttft", "ttft_p50", "itl_p50"),
    reads=("requests", "kv_transfer", "completions"),
)
