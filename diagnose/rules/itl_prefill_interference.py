"""``itl_prefill_interference``: ITL spikes while prefills run."""

from __future__ import annotations

from ..signals import Signals, Window
from ._common import (
    _BASE,
    Evidence,
    Param,
    Rule,
    _confidence,
    _in_window,
    _ms,
    _ratio,
    _severity,
    _when,
    _worst,
)


def detect(sig: Signals, p: dict) -> Evidence | None:
    base_itl = sig.baseline.get("itl_p50")
    base_step = sig.baseline.get("decode_step_ms_p50")

    def spike(w: Window) -> float | None:
        # a gap longer than the slowest prefill step is not this rule's (preemption, stalls)
        if w.get("itl_max") is None or w.get("mixed_step_ms_max") is None:
            return None
        return min(w.get("itl_max"), w.get("mixed_step_ms_max"))

    def hit(w: Window) -> bool:
        step_r = _ratio(w.get("mixed_step_ms_max"), base_step)
        itl_r = _ratio(spike(w), base_itl)
        return (
            step_r is not None
            and step_r >= p["mixed_step_rise"]
            and itl_r is not None
            and itl_r >= p["itl_spike"]
        )

    w = _worst(sig, "itl_max", hit)
    if w is None:
        return None
    r = _ratio(spike(w), base_itl)
    cfg = sig.config
    _where, _params = _in_window(w)
    return Evidence(
        f"ITL spiked to {_ms(w.get('itl_max'))} (baseline p50 {_ms(base_itl)}) in {_when(w)}; "
        f"steps carrying prefill took up to {_ms(w.get('mixed_step_ms_max'))} against "
        f"{_ms(base_step)} for decode-only steps (largest prefill in a step: "
        f"{w.get('prefill_tokens_max') or 0:.0f} tokens; chunked prefill "
        f"{'on' if cfg.get('enable_chunked_prefill', True) else 'off'}, step budget "
        f"{cfg.get('max_num_batched_tokens', '?')} tokens)",
        {
            "itl_max_ms": w.get("itl_max"),
            "baseline_itl_p50_ms": base_itl,
            "mixed_step_ms_max": w.get("mixed_step_ms_max"),
            "decode_step_ms_p50": base_step,
            "prefill_tokens_max_per_step": w.get("prefill_tokens_max"),
            "max_num_batched_tokens": cfg.get("max_num_batched_tokens"),
            "enable_chunked_prefill": cfg.get("enable_chunked_prefill"),
        },
        (w.start_ns, w.end_ns),
        f"first_token_ns < {w.end_ns} AND last_token_ns > {w.start_ns} "
        f"AND itl_max_ms >= {p['itl_spike']} * itl_p50_ms",
        [],
        _severity(r, p["itl_spike"]),
        _confidence(r / p["itl_spike"]),
    )


RULE = Rule(
    id="itl_prefill_interference",
    title="ITL spikes while prefills run",
    symptom="running streams' ITL jumps when steps carry prefill tokens",
    causes=(
        "chunked prefill off: a whole prompt's prefill shares one step with decodes",
        "max_num_batched_tokens too large: big prefill chunks per step",
    ),
    checks=(
        "enable_chunked_prefill and max_num_batched_tokens in the config event",
        "prefill tokens in the slow steps",
    ),
    knob="--enable-chunked-prefill with a smaller --max-num-batched-tokens or --long-prefill-token-threshold",
    params={
        "mixed_step_rise": Param(
            4.0, "steps with prefill vs decode-only steps (seed: PD interference)"
        ),
        "itl_spike": Param(8.0, f"max ITL {_BASE} of ITL p50 (case C02: an order of magnitude)"),
    },
    detect=detect,
    healthy_baseline="needs",
    explains=("periodic_itl_spikes",),
    evidence_signals=("itl_max", "mixed_step_ms_max", "prefill_tokens_max"),
)
