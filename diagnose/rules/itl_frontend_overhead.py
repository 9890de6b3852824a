"""``itl_frontend_overhead``: the output path is slower than the engine."""

from __future__ import annotations

from ..signals import Signals
from ._common import Evidence, Param, Rule, _ms, _when, _window_evidence, _worst


def detect(sig: Signals, p: dict) -> Evidence | None:
    w = _worst(sig, "stream_vs_engine_tpot", lambda w: w.get("stream_vs_engine_tpot") >= p["ratio"])
    if w is None:
        return None
    r = w.get("stream_vs_engine_tpot")
    write = w.get("stream_write_ms_mean")
    return _window_evidence(
        f"the stream delivered tokens {r:.1f}x slower than the engine produced them in {_when(w)} "
        f"(engine TPOT p50 {_ms(w.get('tpot_p50'))}"
        + (f"; the API took {_ms(write)} a step to write the outputs" if write is not None else "")
        + "): detokenize/serialize/write is the bottleneck",
        {
            "stream_vs_engine_tpot": r,
            "engine_tpot_p50_ms": w.get("tpot_p50"),
            "step_ms_p50": w.get("step_ms_p50"),
            "stream_write_ms_mean": write,
        },
        w,
        " AND output_tokens >= 8",
        r,
        p["ratio"],
    )


RULE = Rule(
    id="itl_frontend_overhead",
    own_test="stream-side time per token against the engine's, request by request",
    title="the output path is slower than the engine",
    symptom="stream-side time per token well above the engine's TPOT",
    causes=(
        "detokenization cost growing with length",
        "JSON/SSE serialization or a slow client socket",
        "the API event loop is saturated (too many streams per process)",
    ),
    checks=(
        "stream vs engine TPOT per request length (growing = detokenizer)",
        "engine_steps.stream_write_ms: the API's time from a step's outputs to their last write",
        "API process CPU in the host samples",
    ),
    knob="more API processes / fewer streams per process; check the detokenizer (symptom case C03)",
    params={
        "ratio": Param(1.5, "stream-side TPOT / engine TPOT; 1.0 when the output path keeps up")
    },
    detect=detect,
    healthy_baseline="absolute",
    evidence_signals=("stream_vs_engine_tpot", "tpot_p50"),
    reads=("requests", "stream", "completions", "steps", "step_split"),
)
