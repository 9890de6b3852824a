"""``batch_too_large``: throughput falls as the batch grows."""

from __future__ import annotations

from ..signals import Signals
from ._common import Evidence, Param, Rule, _confidence, _in_window, _varies, _when


def detect(sig: Signals, p: dict) -> Evidence | None:
    # the batch as the step ran it (prefill chunks + decodes), not num_running, which is
    # counted after the step and reads 0 when every request finishes in its step
    ws = [w for w in sig.busy() if w.get("throughput_tok_s") and w.get("batch_mean") is not None]
    if len(ws) < p["min_windows"] or not _varies(ws, "batch_mean"):
        return None
    ws.sort(key=lambda w: w.get("batch_mean"))
    peak = max(ws, key=lambda w: w.get("throughput_tok_s"))
    if peak.get("batch_mean") <= 0:
        return None
    bigger = [w for w in ws if w.get("batch_mean") >= p["batch_growth"] * peak.get("batch_mean")]
    if not bigger:
        return None
    worst = min(bigger, key=lambda w: w.get("throughput_tok_s"))
    drop = worst.get("throughput_tok_s") / peak.get("throughput_tok_s")
    if drop > 1 - p["throughput_drop"]:
        return None
    return Evidence(
        f"throughput fell from {peak.get('throughput_tok_s'):.0f} tok/s at a batch of "
        f"{peak.get('batch_mean'):.1f} to {worst.get('throughput_tok_s'):.0f} tok/s at "
        f"{worst.get('batch_mean'):.1f} ({_when(worst)}): past the knee, a bigger batch only "
        f"slows every step",
        {
            "peak_throughput_tok_s": peak.get("throughput_tok_s"),
            "peak_batch": peak.get("batch_mean"),
            "throughput_tok_s": worst.get("throughput_tok_s"),
            "batch": worst.get("batch_mean"),
            "step_ms_p50_at_peak": peak.get("step_ms_p50"),
            "step_ms_p50": worst.get("step_ms_p50"),
        },
        (worst.start_ns, worst.end_ns),
        *_in_window(worst),
        "warning",
        _confidence((1 - drop) / p["throughput_drop"]),
    )


RULE = Rule(
    id="batch_too_large",
    title="throughput falls as the batch grows",
    symptom="tokens/s drops at larger batches: each step slows more than the batch grows",
    causes=("max_num_seqs past the knee", "memory-bandwidth bound decode at large batch"),
    checks=("step time vs batch across windows",),
    knob="--max-num-seqs down to the batch with the peak tokens/s",
    params={
        "min_windows": Param(4, "windows with traffic needed"),
        "batch_growth": Param(1.5, "batch vs the peak-throughput batch"),
        "throughput_drop": Param(0.15, "tokens/s below the peak"),
    },
    detect=detect,
    healthy_baseline="absolute",
    evidence_signals=("throughput_tok_s", "batch_mean", "step_ms_p50"),
)
