"""Synthetic trace stores for testing the rules: a small serving model that writes realistic
rows (requests with their nine spans, engine steps, device samples, events) through the real
:class:`~tokenmill.telemetry.store.TraceStore` writer.

A run is a list of :class:`Phase`\\ s. Each phase sets the traffic (arrival rate, prompt and
output lengths) and the health of the server (queueing, prefill speed, ITL, spikes, KV use,
preemption, errors, client-side gaps, GPU clocks, ...). Healthy defaults are scaled like the
default model on a CPU; only ratios matter to the rules.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from tokenmill.engine.api.timeline import RequestTimeline, block_hashes, head_hashes
from tokenmill.engine.request import RequestEvent
from tokenmill.telemetry.hub import Telemetry

MS = 1_000_000
S = 1_000_000_000
T0 = 1_790_000_000 * S  # a fixed wall-clock origin (2026-09-21)
# the default model's roofline constants (engine/roofline.py for SmolLM2-135M's shapes)
PARAMS = 134_500_000  # decoder linear layers + LM head
KV_BYTES_PER_TOKEN = 46_080  # K and V, 30 layers x 3 KV heads x 64 dims x float32
ATTN_FLOP_PER_PAIR = 69_120  # 4 x 9 heads x 64 dims x 30 layers, per (query, key) pair


@dataclass
class Phase:
    """One stretch of traffic and server behaviour. Times in ms unless named ``_s``."""

    duration_s: float = 30.0
    rate_per_s: float = 2.0
    prompt_tokens: tuple[int, int] = (40, 120)
    output_tokens: tuple[int, int] = (30, 60)
    long_prompt_every: int = 0  # every Nth request gets a long prompt (0 = none)
    long_prompt_tokens: int = 1500
    queue_ms: float = 5.0  # engine queue wait (each request)
    queue_growth_ms_per_s: float = 0.0  # the wait grows this much per second of the phase
    waiting_growth_per_s: float = 0.0
    short_queue_ms: float | None = None  # queue wait of short prompts (head-of-line blocking)
    prefill_tok_per_s: float = 2000.0
    itl_ms: float = 40.0
    itl_jitter: float = 0.1
    prefill_spike_ms: float = 0.0  # extra step time when a step carries a long prefill
    periodic_spike_s: float = 0.0  # a step spike every N s (0 = none)
    periodic_spike_ms: float = 0.0
    # a job on the host that slows every step (and token gap) by host_burst_slowdown for
    # host_burst_s out of every host_burst_every_s (0 = none)
    host_burst_every_s: float = 0.0
    host_burst_s: float = 0.0
    host_burst_slowdown: float = 1.0
    running: int = 8
    waiting: float = 0.0
    max_num_seqs: int = 64
    kv_usage: float = 0.3
    idle_kv_usage: float = 0.0  # KV share still used with nothing running (a leak)
    preempt_share: float = 0.0  # requests preempted once, mid-decode
    preempt_gap_ms: float = 2000.0
    alloc_failures_per_step: float = 0.0
    error_share: float = 0.0
    error_type: str = "nan_logits"
    # the engine core killed this many seconds into the phase (SIGKILL, as the OOM killer
    # sends it): requests in flight then end with engine_died, an engine_crash event lists
    # them and an engine_restart follows 1.5 s later (None: no crash)
    crash_at_s: float | None = None
    # the engine stopped (SIGSTOP): no step ends and no request ends for the whole phase; its
    # arrivals wait, seen by the API's waiting samples each second, and host samples go on
    frozen: bool = False
    client_ttft_factor: float | None = None  # client TTFT / server TTFT (None: not recorded)
    text_holdback_ms: float = 0.0  # the server withholds the first text this long (stop strings)
    # prefill/decode disaggregation: each request's KV takes this long from the prefill to the
    # decode core after its first token (0 = colocated), delaying its second token as much
    kv_transfer_ms: float = 0.0
    # its two sides (engine_steps.role): pd_busy = (prefill, decode) share of the time each
    # side's one core spends in working steps; the steps then come from two cores (replica 0
    # prefill with the phase's `waiting`, replica 1 decode with its `running` and `kv_usage`,
    # idle heartbeats between); kv_wait_ms is each request's wait at the decode side for room
    pd_busy: tuple[float, float] | None = None
    kv_wait_ms: float = 0.0
    stream_slowdown: float = 1.0  # stream-side time per token / engine TPOT
    prefix_cached_share: float = 0.5  # share of prompt tokens from the prefix cache
    first_block_varies: bool = False  # prompts share blocks 2.. but differ in block 0
    shared_head_tokens: int = 0  # prompts share only their first N tokens (hashes from tokens)
    host_share: float = 0.05  # (schedule + sample) / step time
    cpu_others_pct: float = 2.0  # host CPU % used outside the server (a noisy neighbour)
    gpu_other_processes: int = 0  # processes on the GPU that are not the server's
    step_ms: float | None = None  # decode step time (default: itl_ms)
    gpu: bool = False
    sm_clock_mhz: float = 1980.0
    throttle_reasons: tuple[str, ...] = ()
    gpu_util: float = 90.0
    # roofline (engine_steps.weight_bytes/kv_*_bytes/flops, the config event's peaks): the
    # default model's shapes; the run's quantization and peaks come from its first phase
    quantization: str = "none"
    int8_compute: str | None = None  # the int8 GEMM path of the quantized layers (None: off)
    weight_bytes: int = 538_000_000  # weights read per step (float32 SmolLM2-135M)
    peak_gbps: float = 40.0
    peak_gflops: float = 400.0  # ridge 10 FLOP/byte
    context_tokens: int = 150  # KV context of each running decode
    # speculative decoding (engine_steps.num_drafts/num_draft_tokens/num_accepted_tokens[_per_pos]
    # and the requests' spec_* columns): spec_k draft tokens per request in a share of the
    # decode-only steps; each draft token accepted with spec_accept_rate (accepted ones counted
    # from position 0); those steps take spec_step_slowdown x a plain decode step. 0: off.
    spec_k: int = 0
    spec_draft_share: float = 0.7
    spec_accept_rate: float = 0.0
    spec_step_slowdown: float = 1.0
    # data parallelism (requests.replica, engine_steps.replica, the config event's
    # data_parallel_size): replicas > 1 sends hot_share of the requests to replica 0 (with
    # hot_queue_ms more queue wait each) and the rest spread over the others; the step rows
    # alternate between the replicas, replica 0's with `running` and the others' with
    # cool_running (None: `running` too)
    replicas: int = 1
    # tensor parallelism (engine_steps.collective_ms/collective_bytes, the config event's
    # tensor_parallel_size): tp_size > 1 gives every step collectives taking collective_share
    # of a decode step's forward and a quarter of that share of a prefill step's
    tp_size: int = 1
    collective_share: float = 0.0
    # every 16th step's rank_compute_ms: each rank's forward_ms outside collectives, the
    # straggler's (None: none) straggler_slowdown times that, the others waiting for it
    straggler_rank: int | None = None
    straggler_slowdown: float = 1.0
    hot_share: float | None = None
    hot_queue_ms: float = 0.0
    cool_running: float | None = None

    def but(self, **changes) -> Phase:
        return replace(self, **changes)


@dataclass
class SyntheticRun:
    """Generate a store: ``SyntheticRun(seed).run(path, [Phase(...), ...])``."""

    seed: int = 0
    model: str = "smollm2-135m-instruct"
    shared_system_blocks: int = 8
    counts: dict = field(default_factory=dict)
    cut: list = field(default_factory=list)  # ids of the requests the next crash ends

    def run(self, path: str | Path, phases: list[Phase], *, spans: bool = True) -> dict:
        """Write the phases' rows into a fresh store at ``path``; returns row counts."""
        rng = random.Random(self.seed)
        tel = Telemetry(self.model, trace_db=str(path), device_sample_interval_s=0)
        if not spans:
            tel.provider = tel.tracer = None
        first = phases[0]
        cfg = {
            "max_num_seqs": first.max_num_seqs,
            "max_num_batched_tokens": 2048,
            "enable_chunked_prefill": True,
            "enable_prefix_caching": True,
            "dtype": "auto",
            "quantization": first.quantization,
            "int8_compute_path": first.int8_compute,
            "model_dtype": "float32",
            "weight_bytes_total": first.weight_bytes,
            "weight_bytes_by_dtype": {
                "float32" if first.quantization == "none" else first.quantization: (
                    first.weight_bytes
                )
            },
            "device_peak_gbps": first.peak_gbps,
            "device_peak_gflops": first.peak_gflops,
            "device_peak_gbps_source": "probe",
            "device_peak_gflops_source": "probe",
            "data_parallel_size": max(ph.replicas for ph in phases),
            "tensor_parallel_size": max(ph.tp_size for ph in phases),
        }
        spec_k = next((ph.spec_k for ph in phases if ph.spec_k), 0)
        # the server's flag as the config event carries it: vLLM's JSON, or None when off
        cfg["speculative_config"] = (
            json.dumps(
                {
                    "method": "ngram",
                    "num_speculative_tokens": spec_k,
                    "prompt_lookup_min": 2,
                    "prompt_lookup_max": 4,
                }
            )
            if spec_k
            else None
        )
        tel.store.submit(
            "events",
            {
                "time_ns": T0,
                "kind": "config",
                "severity": "info",
                "message": "engine flags at start",
                "attributes": json.dumps(cfg),
            },
        )
        t = T0
        n_req = 0
        step_id = 0
        for ph in phases:
            end = t + int(ph.duration_s * S)
            self._device(tel, ph, t, end)
            self._phase_start = t
            if ph.frozen:
                n_req = self._frozen(tel, rng, ph, t, end, n_req)
                t = end
                continue
            step_id = self._steps(tel, rng, ph, t, end, step_id)
            if ph.rate_per_s > 0:
                gap = S / ph.rate_per_s
                at = t + rng.random() * gap
                while at < end:
                    n_req += 1
                    self._request(tel, rng, ph, int(at), n_req)
                    at += rng.expovariate(1.0) * gap
            if ph.crash_at_s is not None:
                self._crash(tel, self._phase_start + int(ph.crash_at_s * S))
            t = end
        tel.store.flush(600)
        counts = {k: v for k, v in tel.store.written.items()}
        tel.close()
        return counts

    # ----- rows -----
    @staticmethod
    def _frozen(tel, rng, ph: Phase, start: int, end: int, n_req: int) -> int:
        """A stopped engine: arrivals that never start, sampled waiting each second."""
        arrivals = []
        at = start + rng.random() * S / max(ph.rate_per_s, 1e-9)
        while ph.rate_per_s > 0 and at < end:
            n_req += 1
            arrivals.append((f"req-{n_req}", int(at), rng.randint(*ph.prompt_tokens)))
            at += rng.expovariate(1.0) * S / ph.rate_per_s
        t = start + S
        while t < end:
            for rid, arrived, prompt in arrivals:
                if arrived < t:
                    row = {"time_ns": t, "request_id": rid, "arrival_ns": arrived}
                    row.update(wait_ms=(t - arrived) / MS, prompt_tokens=prompt, scheduled=False)
                    tel.store.submit("waiting_samples", row)
            t += S
        return n_req

    @staticmethod
    def _burst(ph: Phase, since_phase_start_ns: int) -> float:
        """The slowdown of work that starts this far into the phase (1.0 outside a burst)."""
        if not ph.host_burst_every_s:
            return 1.0
        into = (since_phase_start_ns / S) % ph.host_burst_every_s
        return ph.host_burst_slowdown if into < ph.host_burst_s else 1.0

    def _pd_steps(self, tel, rng, ph: Phase, start: int, end: int, step_id: int) -> int:
        """Disaggregated steps: each side's core works ``pd_busy`` of the time (a working step,
        then an idle gap with a heartbeat every 0.5 s), tagged with its role."""
        total = 1000
        for replica, (role, busy) in enumerate(zip(("prefill", "decode"), ph.pd_busy)):
            t = start
            while t < end:
                if role == "prefill":
                    prefill = rng.randint(*ph.prompt_tokens)
                    dur = prefill / ph.prefill_tok_per_s * 1000
                    running, decode, waiting, kv = 1, 0, round(ph.waiting), 0.05
                else:
                    prefill, running = 0, ph.running
                    dur = (ph.step_ms or ph.itl_ms) * (1 + ph.itl_jitter * (rng.random() - 0.5))
                    decode, waiting, kv = running, 0, ph.kv_usage * (0.9 + 0.1 * rng.random())
                rows = [(t, dur, prefill, decode, running, waiting)]
                gap_ms = dur * (1 - busy) / busy
                idle_t = t + int(dur * MS)
                while idle_t + S // 2 < t + int((dur + gap_ms) * MS):
                    idle_t += S // 2
                    rows.append((idle_t, 0.0, 0, 0, 0, waiting))
                for at, d, pf, dc, run, wait in rows:
                    used = round((kv if d else kv * 0.5) * total)
                    row = {
                        "step_id": step_id,
                        "engine_pid": 5000 + replica,
                        "start_ns": at,
                        "end_ns": at + int(d * MS),
                        "schedule_ms": ph.host_share * d / 2,
                        "forward_ms": d * (1 - ph.host_share),
                        "sample_ms": ph.host_share * d / 2,
                        "num_running": run,
                        "num_waiting": wait,
                        "num_prefill_tokens": pf,
                        "num_decode_tokens": dc,
                        "num_prefill_chunks": 1 if pf else 0,
                        "num_sampled": run if d else 0,
                        "kv_blocks_total": total,
                        "kv_blocks_used": used,
                        "kv_blocks_free": total - used,
                        "replica": replica,
                        "role": role,
                        "num_kv_waiting": (2 if ph.kv_wait_ms else 0) if role == "decode" else None,
                    }
                    row.update(self._roofline(ph, pf, dc))
                    tel.store.submit("engine_steps", row)
                    step_id += 1
                t += int((dur + gap_ms) * MS)
        return step_id

    def _steps(self, tel, rng, ph: Phase, start: int, end: int, step_id: int) -> int:
        if ph.pd_busy is not None and ph.rate_per_s > 0:
            return self._pd_steps(tel, rng, ph, start, end, step_id)
        step_ms = ph.step_ms or ph.itl_ms
        total = 1000
        t = start
        next_spike = start + int(ph.periodic_spike_s * S) if ph.periodic_spike_s else None
        i = 0
        while t < end:
            i += 1
            idle = ph.rate_per_s == 0
            # idle rows are heartbeats as the real engine writes them: no tokens, no duration
            dur = 0.0 if idle else step_ms * (1 + ph.itl_jitter * (rng.random() - 0.5))
            prefill = 0
            if not idle and i % 10 == 0:
                prefill = rng.randint(*ph.prompt_tokens)
                dur += prefill / ph.prefill_tok_per_s * 1000
            if not idle and ph.long_prompt_every and i % (10 * ph.long_prompt_every) == 5:
                prefill = ph.long_prompt_tokens
                dur += ph.prefill_spike_ms
            running = 0 if idle else ph.running
            replica = i % ph.replicas
            if replica and ph.cool_running is not None and not idle:
                running = round(ph.cool_running)
            decode_tokens, spec = running, {}
            if not idle and not prefill and ph.spec_k and rng.random() < ph.spec_draft_share:
                per_pos = [0] * ph.spec_k
                for _ in range(running):
                    n_acc = sum(rng.random() < ph.spec_accept_rate for _ in range(ph.spec_k))
                    for j in range(n_acc):
                        per_pos[j] += 1
                decode_tokens = running * (1 + ph.spec_k)
                spec = {
                    "num_drafts": running,
                    "num_draft_tokens": running * ph.spec_k,
                    "num_accepted_tokens": sum(per_pos),
                    "num_accepted_tokens_per_pos": per_pos,
                }
                dur *= ph.spec_step_slowdown
            dur *= self._burst(ph, t - start)
            if next_spike is not None and t >= next_spike:
                dur += ph.periodic_spike_ms
                next_spike += int(ph.periodic_spike_s * S)
            kv = ph.idle_kv_usage if idle else ph.kv_usage * (0.9 + 0.1 * rng.random())
            used = round(kv * total)
            host = ph.host_share * dur
            row = {
                "step_id": step_id,
                "engine_pid": 4242,
                "start_ns": t,
                "end_ns": t + int(dur * MS),
                "schedule_ms": host / 2,
                "forward_ms": dur - host,
                "sample_ms": host / 2,
                "num_running": running,
                "num_waiting": 0 if idle else round(ph.waiting),
                "num_prefill_tokens": prefill,
                "num_decode_tokens": decode_tokens,
                "num_prefill_chunks": 1 if prefill else 0,
                "num_sampled": running + spec.get("num_accepted_tokens", 0),
                "num_preempted": 1 if (not idle and rng.random() < ph.preempt_share / 5) else 0,
                "kv_blocks_total": total,
                "kv_blocks_used": used,
                "kv_blocks_free": total - used,
                "kv_blocks_cached": 0,
                "prefix_hit_tokens": 0,
                "allocation_failures": int(ph.alloc_failures_per_step > rng.random()),
                "num_finished": 0,
                "replica": replica if ph.replicas > 1 else None,
            }
            row["num_waiting"] += int(ph.waiting_growth_per_s * (t - start) / S) if not idle else 0
            row.update(spec)
            row.update(self._roofline(ph, prefill, decode_tokens))
            if ph.tp_size > 1 and not idle:
                share = ph.collective_share / (4 if prefill else 1)
                row["collective_ms"] = share * row["forward_ms"]
                row["collective_bytes"] = 2 * 30 * (prefill + decode_tokens) * 576 * 4
                if step_id % 16 == 15:
                    compute = row["forward_ms"] - row["collective_ms"]
                    times = [compute * (1 + 0.05 * rng.random()) for _ in range(ph.tp_size)]
                    if ph.straggler_rank is not None:
                        times[ph.straggler_rank] = compute * ph.straggler_slowdown
                    row["rank_compute_ms"] = times
            tel.store.submit("engine_steps", row)
            step_id += 1
            t += int(dur * MS) + (int(0.5 * S) if idle else 0)
        return step_id

    @staticmethod
    def _roofline(ph: Phase, prefill: int, running: int) -> dict:
        """A step's bytes and FLOPs as ``engine/roofline.py`` counts them (one prefill chunk of
        ``prefill`` tokens from position 0, ``running`` decode tokens at ``context_tokens``,
        draft tokens included)."""
        tokens = prefill + running
        if not tokens:
            return {"weight_bytes": 0, "kv_read_bytes": 0, "kv_write_bytes": 0, "flops": 0}
        pairs = prefill * (prefill + 1) // 2 + running * ph.context_tokens
        return {
            "weight_bytes": ph.weight_bytes,
            "kv_read_bytes": (prefill + running * ph.context_tokens) * KV_BYTES_PER_TOKEN,
            "kv_write_bytes": tokens * KV_BYTES_PER_TOKEN,
            "flops": 2 * PARAMS * tokens + ATTN_FLOP_PER_PAIR * pairs,
        }

    def _device(self, tel, ph: Phase, start: int, end: int) -> None:
        t = start
        while t < end:
            if ph.gpu:
                row = {
                    "time_ns": t,
                    "kind": "gpu",
                    "device_index": 0,
                    "device_name": "NVIDIA H200",
                    "power_w": 500.0 if not ph.throttle_reasons else 700.0,
                    "gpu_util_pct": ph.gpu_util,
                    "sm_clock_mhz": int(ph.sm_clock_mhz),
                    "mem_clock_mhz": 2619,
                    "temperature_c": 85.0 if ph.throttle_reasons else 60.0,
                    "clock_event_reasons": list(ph.throttle_reasons),
                    "mem_used_bytes": 100 << 30,
                    "mem_total_bytes": 141 << 30,
                    "other_processes": ph.gpu_other_processes,
                }
            else:
                row = {
                    "time_ns": t,
                    "kind": "host",
                    "device_name": "synthetic",
                    "cpu_pct": min(100.0, 90.0 + ph.cpu_others_pct),
                    "cpu_others_pct": ph.cpu_others_pct,
                    "steal_pct": 0.0,
                    "run_queue": 2 + round(ph.cpu_others_pct / 50),
                    "rss_bytes": 2 << 30,
                    "load_1m": 2.0,
                    "mem_used_bytes": 4 << 30,
                    "mem_total_bytes": 24 << 30,
                }
            tel.store.submit("device_samples", row)
            t += S // 2

    def _request(self, tel, rng, ph: Phase, arrival: int, n: int) -> None:
        long = ph.long_prompt_every and n % ph.long_prompt_every == 0
        n_in = ph.long_prompt_tokens if long else rng.randint(*ph.prompt_tokens)
        n_out = rng.randint(*ph.output_tokens)
        tl = RequestTimeline(arrival_ns=arrival, method="POST", path="/v1/chat/completions")
        tl.endpoint, tl.model, tl.tenant = "chat", self.model, "acme"
        tl.request_id = f"cmpl-{n:08d}"
        tl.client_request_id = f"req-{n}"
        tl.stream, tl.max_tokens, tl.stats.input_tokens = True, n_out, n_in
        tl.gateway_end_ns = arrival + 200_000
        tl.tokenize_end_ns = tl.gateway_end_ns + 300_000
        tl.admission_end_ns = tl.tokenize_end_ns + 50_000
        tl.stats.queued_ns = tl.admission_end_ns + 200_000
        short = ph.short_queue_ms is not None and n_in <= ph.prompt_tokens[1]
        queue = (ph.short_queue_ms if short else ph.queue_ms) * (0.8 + 0.4 * rng.random())
        queue += ph.queue_growth_ms_per_s * (arrival - self._phase_start) / S
        if ph.replicas > 1:
            share = 1 / ph.replicas if ph.hot_share is None else ph.hot_share
            tl.replica = 0 if rng.random() < share else rng.randrange(1, ph.replicas)
            queue += ph.hot_queue_ms * (0.8 + 0.4 * rng.random()) if tl.replica == 0 else 0.0
        tl.stats.scheduled_ns = tl.stats.queued_ns + int(queue * MS)
        cached = int(n_in * ph.prefix_cached_share) // 16 * 16
        prefill_ms = (n_in - cached) / ph.prefill_tok_per_s * 1000 + ph.itl_ms
        tl.stats.first_token_ns = tl.stats.scheduled_ns + int(prefill_ms * MS)
        tl.stats.cached_tokens = cached
        preempted = rng.random() < ph.preempt_share
        tokens = [tl.stats.first_token_ns]
        stall_at = rng.randint(2, max(2, n_out - 2)) if preempted and n_out > 4 else None
        # a long prefill sharing steps with this request's decode (interference)
        spike_at = rng.randint(2, max(2, n_out - 2)) if ph.prefill_spike_ms and n_out > 4 else None
        moved = ph.kv_transfer_ms * (0.9 + 0.2 * rng.random()) if ph.kv_transfer_ms else 0.0
        if moved:
            kv_bytes = -(-n_in // 16) * 16 * 46_080  # SmolLM2 float32: 46,080 bytes a token
            waited = ph.kv_wait_ms * (0.8 + 0.4 * rng.random()) if ph.kv_wait_ms else 0.0
            attrs = {"bytes": kv_bytes, "ms": moved, "waited_ms": waited}
            moved += waited  # the second token waits for the room as well
            tl.events.append(
                RequestEvent("kv_transfer", n, tl.stats.first_token_ns + int(moved * MS), attrs)
            )
        for k in range(1, n_out):
            gap = ph.itl_ms * (1 + ph.itl_jitter * (rng.random() - 0.5))
            if k == 1:
                gap += moved  # the second token waits for the hand-off
            if stall_at is not None and k == stall_at:
                gap += ph.preempt_gap_ms
                tl.events.append(
                    RequestEvent("preempted", n, tokens[-1] + MS, {"recompute_tokens": n_in + k})
                )
                tl.events.append(RequestEvent("resumed", n + 1, tokens[-1] + int(gap * MS / 2), {}))
            if spike_at is not None and k == spike_at:
                gap += ph.prefill_spike_ms
            gap *= self._burst(ph, tokens[-1] - self._phase_start)
            tokens.append(tokens[-1] + int(gap * MS))
        tl.token_ns = tokens
        tl.first_text_ns = tl.stats.first_token_ns + int(ph.text_holdback_ms * MS)
        tl.stats.output_tokens = n_out
        if ph.spec_k:
            tl.stats.spec_drafts = round((n_out - 1) * ph.spec_draft_share)
            tl.stats.spec_draft_tokens = tl.stats.spec_drafts * ph.spec_k
            tl.stats.spec_accepted_tokens = round(tl.stats.spec_draft_tokens * ph.spec_accept_rate)
        tl.stats.preemptions = 1 if stall_at is not None else 0
        tl.stats.recomputed_tokens = (n_in + (stall_at or 0)) if stall_at is not None else 0
        tl.events.insert(
            0, RequestEvent("chunk", n, tl.stats.first_token_ns - MS, {"tokens": n_in - cached})
        )
        crash_ns = self._phase_start + int(ph.crash_at_s * S) if ph.crash_at_s is not None else None
        if crash_ns is not None and tl.stats.first_token_ns < crash_ns < tokens[-1]:
            tokens[:] = [x for x in tokens if x < crash_ns]
            tl.stats.output_tokens = len(tokens)
            tl.finish_reason, tl.error_type, tl.finished_ns = "error", "engine_died", crash_ns
            self.cut.append(tl.request_id)
        elif rng.random() < ph.error_share:
            tl.finish_reason = "error"
            tl.error_type = ph.error_type
            tl.finished_ns = tokens[-1]
        else:
            tl.finish_reason = "length"
            tl.finished_ns = tokens[-1]
        tl.first_byte_ns = tl.stats.first_token_ns + 300_000
        engine_span = tokens[-1] - tl.stats.first_token_ns
        tl.last_byte_ns = tl.stats.first_token_ns + int(engine_span * ph.stream_slowdown) + 500_000
        tl.http_status = 200
        tl.usage = {"prompt_tokens": n_in, "completion_tokens": n_out}
        tl.metering_start_ns = tl.last_byte_ns + 10_000
        tl.metering_end_ns = tl.metering_start_ns + 20_000
        if ph.shared_head_tokens:
            ids = list(range(1, ph.shared_head_tokens + 1))
            ids += [rng.randrange(1000, 50000) for _ in range(n_in - len(ids))]
            tl.prompt_block_hashes = block_hashes(ids, 16)
            tl.prompt_head_hashes = head_hashes(ids, 16)
        else:
            tl.prompt_block_hashes = self._blocks(rng, n_in, ph.first_block_varies, n)
        tel.on_request(tl)
        if ph.client_ttft_factor is not None:
            # what the load generator measured on its side; write_store adds it to the row
            # the way the bench tool does (an UPDATE keyed by request id)
            server_ttft = (tl.stats.first_token_ns - tl.arrival_ns) / MS
            self.counts.setdefault("client_ttft", []).append(
                (tl.request_id, server_ttft * ph.client_ttft_factor + ph.text_holdback_ms)
            )

    def _crash(self, tel, at_ns: int) -> None:
        """The engine core's death as the server records it, and its restart."""
        cut, self.cut = self.cut, []
        attrs = {"replica": "engine", "pid": 5000, "exit_code": -9, "signal": "SIGKILL",
                 "last_step_id": 0, "cut_requests": cut}  # fmt: skip
        for kind, t, a in (
            ("engine_crash", at_ns, attrs),
            ("engine_restart", at_ns + S * 3 // 2, {}),
        ):
            tel.store.submit(
                "events",
                {
                    "time_ns": t,
                    "kind": kind,
                    "severity": "error",
                    "message": kind,
                    "attributes": json.dumps(a),
                },
            )

    def _blocks(self, rng, n_in: int, first_varies: bool, n: int) -> list[int]:
        n_blocks = min(n_in // 16, 32)
        shared = [1000 + b for b in range(self.shared_system_blocks)]
        out = []
        for b in range(n_blocks):
            if b == 0 and first_varies:
                out.append(rng.getrandbits(62))
            elif b < len(shared):
                out.append(shared[b])
            else:
                out.append(rng.getrandbits(62))
        return out


def write_store(path: str | Path, phases: list[Phase], seed: int = 0) -> dict:
    """Generate ``phases`` into a new store at ``path`` (client TTFTs included); row counts."""
    import duckdb

    gen = SyntheticRun(seed)
    counts = gen.run(path, phases)
    client = gen.counts.get("client_ttft")
    if client:
        con = duckdb.connect(str(path))
        con.executemany(
            "UPDATE requests SET client_ttft_ms = ? WHERE request_id = ?",
            [(v, k) for k, v in client],
        )
        con.close()
    return counts
