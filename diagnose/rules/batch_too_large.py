"""``batch_too_large``: throughput falls as the batch grows."""

from __future__ import annotations

from ..signals import Signals
from ._common import Evidence, Param, Rule, _confidence, _when

# per window, the decode-only steps: their mean batch (sequences, not draft tokens), their median
# time and the output tokens they made per second of step time (the engine's rate while it decodes; idle time and prefill
# chunks left out, so neither a lull in traffic nor a burst of new prompts reads as the batch)
_DECODE_RATE_SQL = """
WITH w AS (SELECT unnest(?::BIGINT[]) AS ws, unnest(?::BIGINT[]) AS we)
SELECT ws, avg(__DECODE_SEQS__) AS batch,
       sum(num_sampled) / (sum(end_ns - start_ns) / 1e9) AS tok_s,
       quantile_cont((end_ns - start_ns) / 1e6, 0.5) AS step_ms
FROM w JOIN engine_steps ON start_ns >= ws AND start_ns < we
WHERE num_prefill_tokens = 0 AND num_decode_tokens > 0 AND end_ns > start_ns
GROUP BY ws HAVING count(*) >= ?
ORDER BY ws
"""


def detect(sig: Signals, p: dict) -> Evidence | None:
    if not sig.windows:
        return None
    rates = sig.con.execute(
        _DECODE_RATE_SQL.replace("__DECODE_SEQS__", sig.decode_seqs_sql),
        [[w.start_ns for w in sig.windows], [w.end_ns for w in sig.windows], p["min_steps"]],
    ).fetchall()
    by_start = {w.start_ns: w for w in sig.windows}
    ws = [(by_start[r[0]], r[1], r[2], r[3]) for r in rates]
    if len(ws) < p["min_windows"] or len({round(b, 1) for _, b, _, _ in ws}) < 2:
        return None
    peak = max(ws, key=lambda x: x[2])
    bigger = [x for x in ws if x[1] >= p["batch_growth"] * peak[1]]
    if not bigger:
        return None
    worst = min(bigger, key=lambda x: x[2])
    drop = worst[2] / peak[2]
    if drop > 1 - p["throughput_drop"]:
        return None
    w = worst[0]
    weights = w.get("decode_weight_byte_share")
    return Evidence(
        f"decode ran at {peak[2]:.0f} tok/s with a batch of {peak[1]:.1f} "
        f"({_when(peak[0])}, {peak[3]:.0f} ms a step) and at {worst[2]:.0f} tok/s with "
        f"{worst[1]:.1f} ({_when(w)}, {worst[3]:.0f} ms a step): past the knee, a bigger "
        f"batch slows every step more than it adds rows"
        + (
            f"; the KV cache was {1 - weights:.0%} of the bytes those decode steps read"
            if weights is not None
            else ""
        ),
        {
            "peak_throughput_tok_s": peak[2],
            "peak_batch": peak[1],
            "throughput_tok_s": worst[2],
            "batch": worst[1],
            "step_ms_p50_at_peak": peak[3],
            "step_ms_p50": worst[3],
            "kv_share_of_decode_bytes": None if weights is None else 1 - weights,
            "windows_past_the_knee": sum(
                1 for x in bigger if x[2] <= (1 - p["throughput_drop"]) * peak[2]
            ),
        },
        (w.start_ns, w.end_ns),
        "first_token_ns < ? AND last_token_ns > ?",
        [w.end_ns, w.start_ns],
        "warning",
        _confidence((1 - drop) / p["throughput_drop"]),
    )


RULE = Rule(
    id="batch_too_large",
    own_test="decode tokens/s against batch size past the knee, over the steps",
    title="throughput falls as the batch grows",
    symptom="tokens/s drops at larger batches: each step slows more than the batch grows",
    causes=("max_num_seqs past the knee", "memory-bandwidth bound decode at large batch"),
    checks=("step time vs batch across windows",),
    knob="--max-num-seqs down to the batch with the peak tokens/s",
    params={
        "min_windows": Param(4, "windows with decode steps needed"),
        "min_steps": Param(2, "decode-only steps a window needs to count"),
        "batch_growth": Param(1.5, "decode batch vs the batch of the peak decode rate"),
        "throughput_drop": Param(
            0.15,
            "decode tokens per second of step time below the peak (seed 003 §5.2: a bigger "
            "batch need not raise throughput once KV reads outgrow the weight reads)",
        ),
    },
    detect=detect,
    healthy_baseline="absolute",
    evidence_signals=("throughput_tok_s", "batch_mean", "step_ms_p50"),
    reads=("steps", "roofline"),
    needs={"requests": ("first_token_ns", "last_token_ns")},
)
