"""``quantization_no_gain``: weights quantized, yet the steps are compute-bound.

Weight-only quantization (``--quantization int8|int4``) shrinks the bytes of the weight reads;
the FLOPs stay those of the float model (activations keep their dtype, a layer's GEMM runs at
that dtype's rate). A step pays ``max(bytes / peak GB/s, FLOP / peak GFLOP/s)`` at best, so
fewer bytes help only the steps below the ridge point (``peak GFLOP/s ÷ peak GB/s``, FLOP per
byte): decodes at a small batch. A step above it (a prefill chunk; decode at a large batch)
is compute-bound, and there quantization saves nothing. When most of the forward time goes to
such steps, a quantized model serves about as fast as the float one.

With int8 compute on (``--int8-compute``: the config event's ``int8_compute_path`` names one),
the quantized layers' large steps run as int8 GEMMs, at the int8 rate rather than the float
one: the premise above does not hold and the rule stays quiet.

The companion hint reads the same numbers the other way: a float model whose decode steps read
mostly weights at close to the device's bandwidth ceiling, below the ridge, is exactly where
weight quantization pays. It is a note in the report (not a finding: nothing is wrong).
"""

from __future__ import annotations

from tokenmill.telemetry.schema import ROOFLINE_STEP_SQL, STEP_INTENSITY_SQL

from ..signals import Signals, roofline_peaks
from ._common import Evidence, Hint, Param, Rule, _confidence

_FLOAT = ("none", "", None)


def _source(sig: Signals) -> str:
    a = sig.config.device_peak_gbps_source
    b = sig.config.device_peak_gflops_source
    return str(a) if a == b else f"{a} / {b}"


def _dtype(sig: Signals) -> str:
    return str(sig.config.model_dtype or sig.config.dtype or "?")


def _busy_span(sig: Signals) -> tuple[int, int]:
    busy = sig.busy() or sig.windows
    return busy[0].start_ns, busy[-1].end_ns


def _gb(n) -> str:
    return "n/a" if n is None else (f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB")


def detect(sig: Signals, p: dict) -> Evidence | None:
    quant = sig.config.quantization
    peaks = roofline_peaks(sig.config)
    if quant in _FLOAT or peaks is None or sig.config.int8_compute_path not in _FLOAT:
        return None
    gbps, gflops, ridge = peaks
    o = sig.overall
    prefill = o.get("compute_bound_prefill_share") or 0.0
    decode_share = o.get("decode_forward_share") or 0.0
    decode_intensity = o.get("decode_intensity_p50")
    # decode-only steps count as compute-bound only clearly above the ridge: a probed GFLOP/s
    # peak on a shared machine reads low, and batch-1 int4 decode sits near a CPU's ridge
    decode_bound = (
        decode_intensity is not None and decode_intensity >= p["decode_ridge_margin"] * ridge
    )
    decode = decode_share if decode_bound else 0.0
    share = prefill + decode
    n_steps = (o.get("compute_bound_prefill_steps") or 0) + (
        o.get("decode_steps") or 0
    ) * decode_bound
    if share < p["compute_share"] or n_steps < p["min_steps"]:
        return None
    decode_heavy = decode > prefill  # the batch made decode compute-bound too
    intensity = decode_intensity if decode_heavy else o.get("prefill_intensity_p50")
    (min_chunk,) = sig.con.execute(
        "SELECT min(num_prefill_tokens) FROM engine_steps WHERE start_ns >= ? AND start_ns < ? "
        f"AND {ROOFLINE_STEP_SQL} AND num_prefill_chunks > 0 AND {STEP_INTENSITY_SQL} >= ?",
        [sig.since_ns, sig.until_ns, ridge],
    ).fetchone()
    where = "input_tokens >= ?" if min_chunk else "output_tokens > 0"
    parts = []
    if prefill:
        parts.append(
            f"prefill chunks {prefill:.0%} (median {o.get('prefill_intensity_p50') or 0:,.0f} "
            f"FLOP/byte at {o.get('prefill_gflops_p50') or 0:,.1f} GFLOP/s)"
        )
    if decode:
        parts.append(
            f"decode-only steps {decode:.0%} (median {decode_intensity:,.1f} FLOP/byte at a "
            f"batch of {o.get('batch_mean') or 0:.1f})"
        )
    summary = (
        f"weights are {quant} (activations {_dtype(sig)}), yet {share:.0%} of the forward time "
        f"went to compute-bound steps: {', '.join(parts)}, against a ridge of {ridge:,.1f} "
        f"FLOP/byte ({gflops:,.0f} GFLOP/s ÷ {gbps:,.1f} GB/s, {_source(sig)}). Weight-only "
        "quantization cuts the bytes of weight reads, not the FLOPs, so it saves little here"
        + (
            ""
            if decode
            else f"; decode-only steps, where it pays, took {decode_share:.0%} of the forward "
            f"time (median {decode_intensity or 0:,.1f} FLOP/byte)"
        )
    )
    # compute-bound prefill far under the peak GFLOP/s: the layers unpack their weights
    prefill_gflops = o.get("prefill_gflops_p50")
    slow = prefill_gflops is not None and prefill_gflops < p["dequant_gflops_share"] * gflops
    traffic, batch, dequant = RULE.causes
    if decode_heavy:
        causes = (batch, dequant, traffic) if slow else (batch, traffic, dequant)
    else:
        causes = (traffic, dequant, batch) if slow else (traffic, batch, dequant)
    return Evidence(
        summary,
        {
            "quantization": quant,
            "dtype": _dtype(sig),
            "weight_bytes_total": sig.config.weight_bytes_total,
            "weight_bytes_by_dtype": sig.config.weight_bytes_by_dtype,
            "compute_bound_share": share,
            "compute_bound_prefill_share": prefill,
            "compute_bound_decode_share": decode,
            "decode_forward_share": decode_share,
            "prefill_intensity_p50": o.get("prefill_intensity_p50"),
            "decode_intensity_p50": o.get("decode_intensity_p50"),
            "prefill_gflops_p50": prefill_gflops,
            "prefill_gflops_share_of_peak": prefill_gflops / gflops if prefill_gflops else None,
            "ridge_flop_per_byte": ridge,
            "peak_gbps": gbps,
            "peak_gflops": gflops,
            "peak_source": _source(sig),
            "prefill_token_share": o.get("prefill_token_share"),
            "prefix_hit_rate": o.get("prefix_hit_rate"),
            "smallest_compute_bound_chunk": min_chunk,
        },
        _busy_span(sig),
        where,
        [min_chunk] if min_chunk else [],
        "warning",
        _confidence(share / p["compute_share"], (intensity or ridge) / ridge),
        causes=causes,
    )


def hint(sig: Signals, p: dict) -> Hint | None:
    peaks = roofline_peaks(sig.config)
    if sig.config.quantization != "none" or peaks is None:
        return None
    gbps, _, ridge = peaks
    o = sig.overall
    decode = o.get("decode_forward_share")
    intensity = o.get("decode_intensity_p50")
    achieved = o.get("decode_gbps_p50")
    weights = o.get("decode_weight_byte_share")
    if None in (decode, intensity, achieved, weights):
        return None
    util = achieved / gbps
    if (
        decode < p["hint_decode_share"]
        or intensity >= ridge
        or util < p["hint_bandwidth_share"]
        or weights < p["hint_weight_share"]
    ):
        return None
    return Hint(
        f"weights dominate decode: decode-only steps took {decode:.0%} of the forward time, "
        f"read {weights:.0%} weights ({_gb(sig.config.weight_bytes_total)} in "
        f"{_dtype(sig)}) at {achieved:,.1f} GB/s, {util:.0%} of the {gbps:,.1f} GB/s peak, with "
        f"{intensity:,.1f} FLOP/byte, below the ridge at {ridge:,.1f}: weight quantization "
        f"(--quantization int8/int4) would cut those bytes and shorten each decode step",
        {
            "quantization": "none",
            "dtype": _dtype(sig),
            "weight_bytes_total": sig.config.weight_bytes_total,
            "decode_forward_share": decode,
            "decode_weight_byte_share": weights,
            "decode_gbps_p50": achieved,
            "peak_gbps": gbps,
            "decode_bandwidth_share": util,
            "decode_intensity_p50": intensity,
            "ridge_flop_per_byte": ridge,
            "peak_source": _source(sig),
        },
        "--quantization int8 (1 byte a weight) or int4 (under 1 byte with its scales); check "
        "output quality on your own prompts first",
    )


RULE = Rule(
    id="quantization_no_gain",
    own_test="the roofline of the dump's steps (structural)",
    title="weights quantized, yet throughput unchanged: the steps are compute-bound",
    symptom=(
        "the model runs with --quantization int8/int4, but most forward time goes to steps "
        "above the roofline's ridge (prefill chunks, or decode at a large batch), where fewer "
        "weight bytes save nothing"
    ),
    causes=(
        "prefill-heavy traffic: long prompts (or prefixes the cache misses) put most of the "
        "forward time into prefill chunks, compute-bound at any weight width",
        "a batch so large that decode itself is compute-bound (quantization moves the ridge: "
        "fewer weight bytes per FLOP)",
        "the device's kernels dequantize: a quantized layer expands its weight back to the "
        "activation dtype and runs the dense GEMM (tokenmill on CPU above 32 rows, GPU int4 "
        "kernels at large batch), paying the float FLOPs plus the unpacking",
    ),
    checks=(
        "share of forward_ms in steps with flops ≥ ridge × bytes, prefill vs decode-only",
        "median FLOP/byte of those steps vs peak GFLOP/s ÷ peak GB/s in the config event",
        "prompt vs output tokens, prefix-cache hit rate",
        "the same traffic with --quantization none: tokens/s and step time nearly equal",
    ),
    knob=(
        "skip prefill work (prefix caching, shared prompt prefixes, shorter prompts) or add "
        "compute (a faster device; W8A8/FP8 quantization that quantizes activations too); "
        "separate prefill from decode (PD disaggregation) so quantized decode pays; "
        "smaller prefill chunks do not cut FLOPs"
    ),
    params={
        "compute_share": Param(
            0.8,
            "share of forward time in compute-bound steps (seed: 'most step time'): the rest, "
            "the steps where weight-only quantization pays, is then at most a fifth of the "
            "forward time, so even halving it saves a tenth. At 0.5 the rule named healthy "
            "int8 chat traffic whose decode-only steps took 39% of the forward time, where int8 "
            "weights save about a fifth",
        ),
        "min_steps": Param(5, "compute-bound steps needed before the share means anything"),
        "dequant_gflops_share": Param(
            0.5,
            "compute-bound prefill steps under this share of the peak GFLOP/s rank the "
            "dequantizing kernels second",
        ),
        "decode_ridge_margin": Param(
            2.0,
            "decode-only steps count as compute-bound at a median intensity ≥ this × the ridge "
            "(a probed GFLOP/s peak on a shared machine reads up to ~2× low)",
        ),
        "hint_decode_share": Param(0.5, "hint: decode-only steps' share of the forward time"),
        "hint_bandwidth_share": Param(
            0.4,
            "hint: decode's median achieved GB/s / the device's peak; under it something "
            "other than bytes (launches, the host, contention) holds decode back (float32 "
            "decode on the 2-core VM: ~8 of a probed 16 GB/s; good GPU kernels: 70-90% of "
            "the datasheet)",
        ),
        "hint_weight_share": Param(0.5, "hint: weights' share of the bytes decode steps read"),
    },
    detect=detect,
    healthy_baseline="absolute",
    evidence_signals=(
        "compute_bound_prefill_share",
        "prefill_intensity_p50",
        "decode_forward_share",
    ),
    hint=hint,
    reads=("requests", "prefix", "completions", "steps", "roofline"),
)
