"""The start line of ``tokenmill serve``: engine cores, memory, roofline, decoding, keys."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """``n`` bytes as MiB (under 1 GiB) or GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def spec_line(config) -> str:
    """``"speculative decoding ngram K=4 (n-grams 2-4); "`` when ``--speculative-config`` is
    set, else ``""`` (the start line)."""
    from ..spec_config import parse_speculative_config

    spec = parse_speculative_config(config.speculative_config)
    if spec is None:
        return ""
    cut = f", off above {spec.disable_by_batch_size} running" if spec.disable_by_batch_size else ""
    return (
        f"speculative decoding {spec.method} K={spec.num_speculative_tokens} "
        f"(n-grams {spec.prompt_lookup_min}-{spec.prompt_lookup_max}{cut}); "
    )


def engine_line(info: dict, kv_tokens: int) -> str:
    """The start line's engine part: ``engine pid 123, KV capacity 4096 tokens in 256 blocks``;
    with data parallelism every replica's pid and the capacity as each replica's; with
    disaggregation the prefill and the decode core's pids."""
    pids = info.get("pids") or [info["pid"]]
    blocks = f"{kv_tokens} tokens in {info['num_blocks']} blocks"
    if info.get("roles") and len(info["roles"]) == len(pids):  # --disaggregation
        cores = ", ".join(f"{role} core pid {pid}" for role, pid in zip(info["roles"], pids))
        return f"{cores}, KV capacity {blocks} each"
    if len(pids) == 1:
        return f"engine pid {pids[0]}, KV capacity {blocks}"
    return (
        f"{len(pids)} engine replicas, pids {', '.join(map(str, pids))}, KV capacity {blocks} each"
    )


def memory_line(model_info: dict) -> str:
    """The startup line's memory and roofline part: weight bytes by dtype, the KV pool, the
    device's peaks and their sources, whether the compiled decode step is on
    (``EngineReady.model_info``); empty without it."""
    if not model_info.get("weight_bytes_by_dtype"):
        return ""
    by_dtype = ", ".join(
        f"{dtype} {fmt_bytes(n)}" for dtype, n in model_info["weight_bytes_by_dtype"].items()
    )
    line = f"weights {fmt_bytes(model_info['weight_bytes_total'])} ({by_dtype})"
    if model_info.get("kv_cache_bytes"):
        line += f", KV cache {fmt_bytes(model_info['kv_cache_bytes'])}"
    gbps, gflops = model_info.get("device_peak_gbps"), model_info.get("device_peak_gflops")
    if gbps and gflops:
        sources = {
            model_info.get("device_peak_gbps_source"),
            model_info.get("device_peak_gflops_source"),
        }
        line += (
            f"; roofline peaks {gbps:,.0f} GB/s, {gflops:,.0f} GFLOP/s "
            f"({', '.join(sorted(s for s in sources if s))})"
        )
    compiled = model_info.get("compiled_decode")
    if compiled:
        line += f"; compiled decode step {compiled if compiled == 'on' else f'off ({compiled})'}"
    if model_info.get("int4_activations_used"):
        line += f"; int4 on {model_info['int4_activations_used']} activations"
    if model_info.get("int8_compute_path"):
        line += f"; int8 compute on {model_info['int8_compute_path']}"
        if model_info.get("device_peak_int8_gops"):
            line += f" (peak {model_info['device_peak_int8_gops']:,.0f} GOP/s)"
    kernels = model_info.get("cpu_kernels")
    if kernels:
        line += f"; C kernels {kernels if kernels == 'on' else f'off ({kernels})'}"
    return line + "; "


def auth_line(tenants_file: str | None, tenants, metrics_keyed: bool) -> str:
    """How the server authenticates, for its start line (never a key)."""
    if tenants_file:
        line = f"tenants from {tenants_file}"
    elif tenants is not None:
        line = "one API key" + (" and an admin key" if tenants.admin_key_sha256 else "")
    else:
        line = "open local mode, no API keys"
    if metrics_keyed:
        return line + ", keyed /metrics"
    return line + (", open /metrics" if tenants is not None else "")
