"""``spec_decode_ineffective``: speculative decoding is on, but it does not pay.

A step that verifies draft tokens runs ``1 + K`` decode tokens for each request that drafted and
gives it ``1 + accepted`` output tokens; a plain decode step runs one token per request and
gives one. Verification is worth it only while the extra tokens are nearly free, that is while
decode is bandwidth-bound (the weights are read once for every token in the step), and while
enough drafts are accepted (seed 003 §4.4). Two ways it fails:

(a) Few drafts accepted and the draft steps slower than plain ones by more than they gain: per
window, the gain ``1 + accepted tokens per draft`` over the cost, the draft steps' mean
``forward_ms`` over the plain decode steps' at a similar batch (``spec_step_cost``,
``diagnose/signals.py``), is below 1: decode got slower per token than without drafts.

(b) The draft-verifying steps are compute-bound on the roofline (their median FLOP/byte at or
above the ridge from the ``config`` event's peaks): each extra token costs its FLOPs, so
``1 + K`` tokens cost about ``1 + K`` times one, more than ``1 + accepted`` can win back. The
measured times come first: a window whose draft and plain steps both ran and show the drafts
paying is not called compute-bound.
"""

from __future__ import annotations

from ..signals import Signals, Window, roofline_peaks
from ._common import Evidence, Param, Rule, _confidence, _in_window, _ms, _when


def _per_position(sig: Signals, w: Window) -> list[float]:
    """The window's share of drafts accepted at each draft position (0 = the first token)."""
    rows = sig.con.execute(
        """WITH s AS (SELECT num_drafts, num_accepted_tokens_per_pos AS per_pos FROM engine_steps
                      WHERE start_ns >= ? AND start_ns < ? AND num_draft_tokens > 0),
                p AS (SELECT unnest(per_pos) AS n, generate_subscripts(per_pos, 1) AS pos FROM s)
           SELECT pos, sum(n)::DOUBLE / nullif((SELECT sum(num_drafts) FROM s), 0)
           FROM p GROUP BY pos ORDER BY pos""",
        [w.start_ns, w.end_ns],
    ).fetchall()
    return [round(r or 0.0, 3) for _, r in rows]


def _enough(w: Window, p: dict, plain: bool = True) -> bool:
    return (w.get("spec_decode_steps") or 0) >= p["min_steps"] and (
        not plain or (w.get("plain_decode_steps") or 0) >= p["min_steps"]
    )


def detect(sig: Signals, p: dict) -> Evidence | None:
    if not (sig.overall.get("spec_draft_tokens") or 0):
        return None  # speculation off (or a store from before its fields)
    peaks = roofline_peaks(sig.config)
    ridge = peaks[2] if peaks else None
    # (a) measured: low acceptance, and the draft steps cost more than they gain
    slow = [
        w
        for w in sig.windows
        if _enough(w, p)
        and w.get("spec_gain_per_cost") is not None
        and (w.get("spec_accepted_per_draft") or 0) < p["max_accepted_per_draft"]
        and w.get("spec_gain_per_cost") < p["min_gain_per_cost"]
    ]

    # (b) the roofline: draft steps at or above the ridge, unless the window measured them paying
    def pays(w: Window) -> bool:
        gpc = w.get("spec_gain_per_cost")
        return _enough(w, p) and gpc is not None and gpc >= p["min_gain_per_cost"]

    bound = [
        w
        for w in sig.windows
        if ridge
        and _enough(w, p, plain=False)
        and (w.get("spec_intensity_p50") or 0) >= p["ridge_margin"] * ridge
        and not pays(w)
    ]
    if not slow and not bound:
        return None
    if slow:
        w = min(slow, key=lambda x: x.get("spec_gain_per_cost"))
    else:
        w = max(bound, key=lambda x: x.get("spec_intensity_p50"))
    rate = w.get("spec_acceptance_rate") or 0.0
    per_draft = w.get("spec_accepted_per_draft") or 0.0
    gain, cost, gpc = 1 + per_draft, w.get("spec_step_cost"), w.get("spec_gain_per_cost")
    intensity = w.get("spec_intensity_p50")
    compute_bound = w in bound or (
        ridge is not None and intensity is not None and intensity >= p["ridge_margin"] * ridge
    )
    batch = w.get("spec_batch_mean")
    per_pos = _per_position(sig, w)
    parts = [
        f"in {_when(w)} {rate:.0%} of draft tokens were accepted ({per_draft:.2f} per draft, "
        f"so a draft step gave {gain:.2f} tokens per request)"
    ]
    if cost is not None:
        parts.append(
            f"decode steps verifying drafts took {_ms(w.get('spec_step_ms'))} against "
            f"{_ms(w.get('plain_decode_step_ms'))} without ({cost:.2f}× at a similar batch, "
            f"{batch or 0:.1f} sequences): {gpc:.2f}× the tokens per unit of time"
        )
    if compute_bound and intensity is not None and ridge:
        parts.append(
            f"the draft steps ran at {intensity:,.1f} FLOP/byte, at or above the ridge "
            f"({ridge:,.1f}): compute-bound, so every draft token costs its FLOPs"
        )
    summary = "speculative decoding does not pay: " + "; ".join(parts)
    low_accept, big_k, compute, lookup = RULE.causes
    if compute_bound and not slow:
        causes = (compute, big_k, low_accept, lookup)
    elif per_pos and len(per_pos) >= 2 and per_pos[-1] < 0.5 * per_pos[0]:
        causes = (low_accept, big_k, lookup, compute)  # later positions mostly rejected
    else:
        causes = RULE.causes
    where, params = _in_window(w)
    margin = p["min_gain_per_cost"] / gpc if gpc else None
    return Evidence(
        summary,
        {
            "spec_acceptance_rate": rate,
            "spec_accepted_per_draft": per_draft,
            "spec_gain": gain,
            "spec_step_ms": w.get("spec_step_ms"),
            "plain_decode_step_ms": w.get("plain_decode_step_ms"),
            "spec_step_cost": cost,
            "spec_gain_per_cost": gpc,
            "spec_batch_mean": batch,
            "spec_drafts": w.get("spec_drafts"),
            "spec_draft_tokens": w.get("spec_draft_tokens"),
            "spec_accepted_tokens": w.get("spec_accepted_tokens"),
            "acceptance_by_position": per_pos,
            "spec_intensity_p50": intensity,
            "ridge_flop_per_byte": ridge,
            "compute_bound": compute_bound,
            "spec_forward_share": w.get("spec_forward_share"),
            "windows_not_paying": len(slow),
            "windows_compute_bound": len(bound),
            "speculative_config": sig.config.speculative_config,
        },
        (w.start_ns, w.end_ns),
        f"{where} AND spec_draft_tokens > 0",
        params,
        "critical" if gpc is not None and gpc <= p["min_gain_per_cost"] / 2 else "warning",
        _confidence(margin, (intensity / ridge) if compute_bound and intensity else None),
        causes=causes,
    )


RULE = Rule(
    id="spec_decode_ineffective",
    own_test="draft acceptance and verification cost over the steps",
    title="speculative decoding does not pay: drafts rejected or verification compute-bound",
    symptom=(
        "speculation is on (steps verify draft tokens), but few drafts are accepted and the "
        "steps that verify them are slower than plain decode steps by more than the tokens "
        "they add, or those steps are compute-bound on the roofline"
    ),
    causes=(
        "the traffic does not repeat its prompt: n-gram lookup drafts continuations that the "
        "model rejects (chat and open-ended writing, as against summarising, extracting or "
        "editing the prompt's own text)",
        "too many draft tokens per step: later draft positions are rarely accepted, yet every "
        "one is verified (num_speculative_tokens)",
        "the batch makes verification compute-bound: with many running requests each extra "
        "token costs its FLOPs, so 1 + K tokens cost about 1 + K plain ones",
        "n-gram matches too short: prompt_lookup_min of 1-2 matches common words and drafts noise",
    ),
    checks=(
        "acceptance rate (accepted / draft tokens) and accepted tokens per draft, per window",
        "acceptance by draft position: how fast it falls after position 0",
        "forward_ms of decode-only steps with drafts vs without, at the same batch",
        "median FLOP/byte of the draft steps vs peak GFLOP/s ÷ peak GB/s in the config event",
        "the same traffic without --speculative-config: ITL and tokens/s",
    ),
    knob=(
        "--speculative-config: lower num_speculative_tokens (to where acceptance by position "
        "is still high), raise prompt_lookup_min (longer matches, fewer but better drafts), or "
        "turn speculation off for this traffic or above the batch where verification turns "
        "compute-bound (vLLM: disable_by_batch_size in --speculative-config)"
    ),
    params={
        "min_gain_per_cost": Param(
            1.0,
            "seed 003 §4.4, 'verification pays only while decode is bandwidth-bound and drafts "
            "are accepted': (1 + accepted per draft) / (draft step ÷ plain step time) below 1 "
            "means fewer tokens per second than plain decode",
        ),
        "max_accepted_per_draft": Param(
            1.0,
            "accepted tokens per draft counted as low: under one, a verifying step adds less "
            "than one token to the one it samples anyway",
        ),
        "min_steps": Param(
            10,
            "decode-only steps with drafts (and, for the time comparison, without) a window "
            "needs before their step times compare",
        ),
        "ridge_margin": Param(
            1.0,
            "draft steps count as compute-bound at a median FLOP/byte ≥ this × the roofline's "
            "ridge (peak GFLOP/s ÷ peak GB/s, the config event; seed 003 §4.4)",
        ),
    },
    detect=detect,
    healthy_baseline="absolute",
    evidence_signals=("spec_acceptance_rate", "spec_gain_per_cost", "spec_step_cost"),
    reads=("spec",),
    needs={"engine_steps": ("num_accepted_tokens_per_pos",), "requests": ("spec_draft_tokens",)},
)
