"""``pd_ratio_imbalance``: one side of a disaggregated server is the bottleneck while the other
idles; the P:D ratio (or the cores given to each side) does not fit the traffic.

Two shapes (seed 003 §4.1, prefill vs decode; seed 000 on a token factory's P:D ratio):

- **prefill-starved**: the prefill cores are busy nearly all the window and requests spend
  most of their TTFT queued there, while the decode cores sit mostly idle (long prompts,
  short answers);
- **decode-starved**: prefilled requests wait at the decode side for room (``kv_wait_ms``,
  as long as several decode steps) while the decode pool is full or its batch at
  ``max_num_seqs``, and the prefill cores sit mostly idle (short prompts, long answers).
"""

from __future__ import annotations

from ..signals import Signals, Window
from ._common import Evidence, Param, Rule, _confidence, _in_window, _ms, _severity, _when


def prefill_wait_share(w: Window) -> float | None:
    """The share of the median TTFT a request spent waiting for other requests' prompts on
    the prefill side: 1 − (its own prefill at the side's pace) / TTFT p50. Its own prefill is
    the median prompt's uncached tokens over ``pd_prefill_tok_per_s``; the wait is queueing
    in the scheduler and sharing prefill steps with other prompts alike (a prefill core that
    batches four prompts gives each a TTFT of four prefills with no queue time at all)."""
    pace, ttft, prompt = w.get("pd_prefill_tok_per_s"), w.get("ttft_p50"), w.get("input_p50")
    if not pace or not ttft or prompt is None:
        return None
    own_ms = prompt * (1 - (w.get("prefix_hit_rate") or 0.0)) / pace * 1e3
    return max(0.0, 1 - own_ms / ttft)


def _prefill_starved(w: Window, p: dict) -> float | None:
    """The margin (smallest of value/threshold) when the prefill side is the bottleneck."""
    busy, idle, wait = w.get("pd_prefill_busy"), w.get("pd_decode_busy"), prefill_wait_share(w)
    if busy is None or idle is None or wait is None:
        return None
    if busy < p["busy_share"] or idle > p["idle_share"] or wait < p["wait_share"]:
        return None
    return min(busy / p["busy_share"], p["idle_share"] / max(idle, 1e-3), wait / p["wait_share"])


def _decode_starved(w: Window, p: dict, max_num_seqs: int | None) -> float | None:
    """The margin when prefilled requests wait for the decode side's room."""
    wait, itl = w.get("kv_wait_p50"), w.get("itl_p50")
    idle = w.get("pd_prefill_busy")
    kv = w.get("pd_decode_kv_use_max") or 0.0
    full_batch = bool(max_num_seqs) and (w.get("pd_decode_running_max") or 0) >= max_num_seqs
    if wait is None or not itl or idle is None:
        return None
    steps = wait / itl
    # a wait of severe_wait_steps decode steps or more is the decode side's shortage whatever
    # the prefill side does: a busy prefill side only adds that the whole line is short
    severe = steps >= p["severe_wait_steps"]
    if steps < p["wait_steps"] or (idle > p["idle_share"] and not severe):
        return None
    if kv < p["kv_full"] and not full_batch:
        return None
    return min(steps / p["wait_steps"], max(1.0, p["idle_share"] / max(idle, 1e-3)))


def _stalls_were_preemptions(evidence: dict) -> bool:
    """A ``midstream_stall`` whose stalled requests were mostly preempted: on a disaggregated
    server, the decode side's shortage of room is what preempted them."""
    stalled = evidence.get("stalled_requests") or 0
    return stalled > 0 and (evidence.get("stalled_and_preempted") or 0) >= 0.5 * stalled


def detect(sig: Signals, p: dict) -> Evidence | None:
    max_seqs = sig.config.max_num_seqs
    found: list[tuple[float, str, Window]] = []
    for w in sig.busy():
        if (w.get("completed_arrivals") or 0) < p["min_requests"]:
            continue
        for side, margin in (
            ("prefill", _prefill_starved(w, p)),
            ("decode", _decode_starved(w, p, max_seqs)),
        ):
            if margin is not None:
                found.append((margin, side, w))
    if not found:
        return None
    margin, side, w = max(found, key=lambda f: f[0])
    where, params = _in_window(w)
    p_busy, d_busy = w.get("pd_prefill_busy"), w.get("pd_decode_busy")
    pw, dw = w.get("pd_prefill_workers") or 1, w.get("pd_decode_workers") or 1
    numbers = {
        "bottleneck": side,
        "prefill_workers": pw,
        "decode_workers": dw,
        "prefill_busy_share": p_busy,
        "decode_busy_share": d_busy,
        "prefill_waiting_mean": w.get("pd_prefill_waiting_mean"),
        "prefill_wait_share_of_ttft": prefill_wait_share(w),
        "prefill_tok_per_s": w.get("pd_prefill_tok_per_s"),
        "prompt_tokens_p50": w.get("input_p50"),
        "queue_share_of_ttft": w.get("queue_share_of_ttft"),
        "queue_p50_ms": w.get("queue_p50"),
        "ttft_p50_ms": w.get("ttft_p50"),
        "kv_wait_p50_ms": w.get("kv_wait_p50"),
        "itl_p50_ms": w.get("itl_p50"),
        "decode_kv_use_max": w.get("pd_decode_kv_use_max"),
        "decode_running_max": w.get("pd_decode_running_max"),
        "decode_kv_waiting_mean": w.get("pd_decode_kv_waiting_mean"),
        "max_num_seqs": max_seqs,
    }
    if side == "prefill":
        summary = (
            f"in {_when(w)} the prefill side ({pw} core(s)) was busy {p_busy:.0%} of the time and "
            f"requests spent {prefill_wait_share(w):.0%} of their TTFT "
            f"({_ms(w.get('ttft_p50'))} p50) waiting there for other requests' prompts (their "
            f"own {w.get('input_p50'):.0f}-token prefill takes "
            f"{_ms(w.get('input_p50') / w.get('pd_prefill_tok_per_s') * 1e3)} at the side's "
            f"{w.get('pd_prefill_tok_per_s'):.0f} tokens/s), while the decode side ({dw} "
            f"core(s)) was busy only {d_busy:.0%}: the line is short of prefill"
        )
        example = where + " AND ttft_ms >= ?"
        example_params = [*params, w.get("ttft_p50")]
        knob = (
            "more prefill workers against decode (--disaggregation prefill=P+1,decode=D-1), or "
            "more cores on the prefill side (--prefill-devices); for long prompts with short "
            "answers colocated chunked prefill may use both cores better"
        )
        causes = RULE.causes
    else:
        kv = w.get("pd_decode_kv_use_max")
        summary = (
            f"in {_when(w)} prefilled requests waited {_ms(w.get('kv_wait_p50'))} (p50) at the "
            f"decode side for room, {w.get('kv_wait_p50') / w.get('itl_p50'):.0f} decode steps, "
            f"its KV {kv:.0%} full at the peak, while the prefill side ({pw} core(s)) was busy "
            f"only {p_busy:.0%}: the line is short of decode"
        )
        example = where + " AND kv_wait_ms >= ? * itl_p50_ms"
        example_params = [*params, p["wait_steps"]]
        knob = (
            "more decode workers against prefill (--disaggregation prefill=P-1,decode=D+1), a "
            "larger decode KV pool, or a narrower KV (--dtype bfloat16) so more requests fit"
        )
        causes = (RULE.causes[1], RULE.causes[0], *RULE.causes[2:])
    threshold = 1.0
    return Evidence(
        summary,
        numbers,
        (w.start_ns, w.end_ns),
        example,
        example_params,
        _severity(margin, threshold),
        _confidence(margin),
        causes=causes,
        knob=knob,
    )


RULE = Rule(
    id="pd_ratio_imbalance",
    own_test="each side's busy share of the window",
    title="one side of the disaggregated line is the bottleneck while the other idles",
    symptom=(
        "with --disaggregation, the prefill side queues while the decode side sits idle, or "
        "prefilled requests wait for the decode side's room while the prefill side idles"
    ),
    causes=(
        "too few prefill workers (or cores) for the traffic's prompt tokens: long prompts with "
        "short answers",
        "too few decode workers, or a decode KV pool too small, for the traffic's output "
        "tokens: short prompts with long answers",
        "a placement that gives one side slower cores or fewer threads than the other",
    ),
    checks=(
        "engine_steps by role: each side's share of the window in working steps, its queue",
        "requests.ttft_ms against the prompt's own prefill at the prefill side's tokens/s, "
        "kv_wait_ms against itl_p50_ms (decode side)",
        "the decode side's kv_blocks_used / kv_blocks_total and num_kv_waiting",
    ),
    knob="the P:D ratio (--disaggregation prefill=P,decode=D) or each side's cores",
    params={
        "busy_share": Param(
            0.8,
            "the bottleneck side's share of the window in working steps, at least (a side "
            "that is busy 80%+ of the time has no slack to absorb a burst)",
        ),
        "idle_share": Param(
            0.35,
            "the other side's share of the window in working steps, at most (it idles two "
            "thirds of the time: moving capacity to the busy side would pay)",
        ),
        "wait_share": Param(
            0.5,
            "the share of TTFT p50 spent waiting for other requests' prompts on the prefill "
            "side (1 − own prefill / TTFT): at 0.5 a request waits as long as its own prefill "
            "takes",
        ),
        "wait_steps": Param(
            5.0,
            "a prefilled request's wait for the decode side's room, in decode steps "
            "(kv_wait_ms / itl_p50), at least",
        ),
        "severe_wait_steps": Param(
            20.0,
            "a wait this many decode steps long names the decode side even while the prefill "
            "side is busy too (prefilled requests that wait seconds for room)",
        ),
        "kv_full": Param(
            0.9,
            "the decode side's peak KV use when requests wait for its room (as "
            "kv_pressure_preemption's)",
        ),
        "min_requests": Param(5, "completed requests in the window, at least"),
    },
    detect=detect,
    healthy_baseline="absolute",
    explains=("ttft_queueing", "ttft_prefill_bound", "overload", "head_of_line_blocking"),
    # a decode side short of room preempts its running requests: their streams stall mid-way
    # (the pd_decode_starved scenario: 13 stalled requests, all preempted at the decode side)
    explains_when={"midstream_stall": _stalls_were_preemptions},
    evidence_signals=(
        "pd_prefill_busy",
        "pd_decode_busy",
        "pd_prefill_tok_per_s",
        "kv_wait_p50",
        "pd_decode_kv_use_max",
    ),
    reads=("requests", "prefix", "kv_transfer", "completions", "pd"),
)
