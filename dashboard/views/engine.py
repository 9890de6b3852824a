"""Engine: per-step batch composition (prefill vs decode tokens), step time split, running vs
waiting, KV blocks used/free/cached, preemptions and the prefix-cache hit rate; the steps on a
roofline against the device's peaks; parallelism (collectives' share of the forward, requests
per replica side by side); prefill/decode disaggregation (each side's queue, busy share and KV
use side by side, KV transfer and wait percentiles); speculative decoding (acceptance over time
and by draft position, tokens per decode sequence with and without drafts)."""

import streamlit as st

from tokenmill.dashboard import charts, data, ui

ctx = ui.begin("Engine")
if ctx is not None:
    since, until = ctx.window
    s = ui.q(ctx, "engine_summary", since, until)
    if not s["steps"]:
        st.info("No data: no engine steps in this window.")
    else:
        c = st.columns(6)
        c[0].metric("Steps", f"{s['steps']:,}")
        c[1].metric("Step time mean", ui.fmt_ms(s["step_ms_mean"]))
        c[2].metric("Step time p99", ui.fmt_ms(s["step_ms_p99"]))
        c[3].metric("Prefill token share", ui.fmt_pct(s["prefill_token_share"]))
        c[4].metric("Preemptions", f"{s['preemptions'] or 0:,}")
        c[5].metric("Prefix-cache hit rate", ui.fmt_pct(s["prefix_hit_rate"]))
        c = st.columns(6)
        c[0].metric("Peak running", f"{s['running_max'] or 0:,}")
        c[1].metric("Peak waiting", f"{s['waiting_max'] or 0:,}")
        c[2].metric("KV use peak", ui.fmt_pct(s["kv_usage_max"]))
        c[3].metric("KV blocks", f"{s['kv_blocks_total'] or 0:,}")
        c[4].metric("Allocation failures", f"{s['allocation_failures'] or 0:,}")
        steps, bucket_s = ui.q(ctx, "engine_steps", since, until)
        hits = ui.q(ctx, "prefix_hit_series", since, until, ctx.bucket_s)
        ui.chart(charts.engine(steps, hits, per_step=bucket_s is None), key="engine_steps")
        st.caption(
            "One point per engine step."
            if bucket_s is None
            else f"{s['steps']:,} steps: averaged per {bucket_s:g} s bucket (preemptions summed); "
            "narrow the time window to see single steps."
        )
        roof, roof_bucket_s = ui.q(ctx, "roofline_steps", since, until)
        if roof.empty:
            st.info(
                "No roofline: the steps in this window carry no bytes/FLOPs (a store written "
                "before the engine counted them)."
            )
        else:
            peaks = ui.q(ctx, "device_peaks")
            ui.chart(charts.roofline(roof, peaks, per_step=roof_bucket_s is None), key="roofline")
            if peaks["ridge"]:
                gbps, gflops = (
                    charts.fmt_peak(peaks["peak_gbps"]),
                    charts.fmt_peak(peaks["peak_gflops"]),
                )
                ceilings = (
                    f"Ceilings: {gbps} GB/s ({peaks['peak_gbps_source']}) and {gflops} GFLOP/s "
                    f"({peaks['peak_gflops_source']}) on {peaks['device_name']}; steps left of the "
                    f"ridge ({charts.fmt_peak(peaks['ridge'])} FLOP/byte) are bound by memory "
                    "bandwidth, right of it by compute."
                )
            else:
                ceilings = "The store records no device peaks (no config event with them)."
            st.caption(
                "x: FLOP per byte moved (weights + KV read + KV written); y: FLOP per second of "
                "the step's forward. "
                + (
                    "One point per step. "
                    if roof_bucket_s is None
                    else f"Steps summed per {roof_bucket_s:g} s bucket and kind. "
                )
                + ceilings
            )
        st.subheader("Parallelism")
        coll = ui.q(ctx, "collective_series", since, until, ctx.bucket_s)
        replicas = ui.q(ctx, "replica_series", since, until, ctx.bucket_s)
        pools = ui.q(ctx, "pd_pool_series", since, until, ctx.bucket_s)
        if coll.empty and replicas.empty:
            st.info(
                (
                    "One engine on one rank in this window: "
                    if pools.empty
                    else "Prefill and decode engine cores (below), each on one rank: "
                )
                + "no collectives and no replicas (`--tensor-parallel-size`, "
                "`--data-parallel-size`)."
            )
        else:
            ui.chart(charts.parallelism(coll, replicas), key="parallelism")
            st.caption(
                f"Per {ctx.bucket_s:g} s bucket. Left: rank 0's time in collectives (the step's "
                "broadcast and two all-reduces a layer) over its forward time; decode steps "
                "show what prefill hides. Right: each replica's mean running (solid) and "
                "waiting (dotted) requests: one busy while another idles is what "
                "replica_imbalance names."
            )
        st.subheader("Prefill/decode disaggregation")
        if pools.empty:
            st.info(
                "Colocated in this window: prefill and decode share each engine core "
                "(`--disaggregation prefill=1,decode=1` splits them)."
            )
        else:
            moved = ui.q(ctx, "pd_transfer_summary", since, until)
            c = st.columns(5)
            c[0].metric("KV transfers", f"{moved['transfers'] or 0:,}")
            c[1].metric("KV transfer p50", ui.fmt_ms(moved["transfer_ms_p50"]))
            c[2].metric("KV transfer p99", ui.fmt_ms(moved["transfer_ms_p99"]))
            c[3].metric("KV wait p50", ui.fmt_ms(moved["wait_ms_p50"]))
            c[4].metric("KV wait p99", ui.fmt_ms(moved["wait_ms_p99"]))
            ui.chart(charts.pd_pools(pools), key="pd_pools")
            mb = moved["transfer_bytes_mean"]
            st.caption(
                f"Per {ctx.bucket_s:g} s bucket, each side's own steps. Busy: the share of wall "
                "time in working steps; a busy prefill side with a queue while decode idles (or "
                "the reverse) says the split is off. Transfer: the KV's time from the prefill "
                "to the decode core (requests.kv_transfer_ms); wait: held on the decode side "
                "until it had room (kv_wait_ms)"
                + (f"; {mb / 1e6:,.1f} MB a request on average." if mb else ".")
            )
        st.subheader("Speculative decoding")
        spec = ui.q(ctx, "spec_decode_summary", since, until)
        if not spec["spec_steps"]:
            st.info(
                "Speculation is off in this store: no step in this window verified draft tokens "
                "(`--speculative-config` turns it on)."
            )
        else:
            c = st.columns(5)
            c[0].metric("Acceptance rate", ui.fmt_pct(spec["spec_acceptance_rate"]))
            c[1].metric("Accepted per draft", f"{spec['spec_accepted_per_draft'] or 0:.2f}")
            c[2].metric("Steps with drafts", f"{spec['spec_steps']:,}")
            c[3].metric(
                "Tokens/seq/step with drafts", f"{spec['tokens_per_seq_draft_steps'] or 0:.2f}"
            )
            c[4].metric(
                "Forward ms with / without",
                f"{ui.fmt_ms(spec['forward_ms_draft_steps'])} / "
                f"{ui.fmt_ms(spec['forward_ms_plain_steps'])}",
            )
            series = ui.q(ctx, "spec_decode_series", since, until, ctx.bucket_s)
            ui.chart(charts.spec_decode(series), key="spec_decode")
            by_pos = ui.q(ctx, "spec_acceptance_by_position", since, until)
            ui.chart(charts.spec_by_position(by_pos), key="spec_by_position")
            st.caption(
                f"Per {ctx.bucket_s:g} s bucket. A step with drafts pays when its output tokens "
                "per decode sequence (1 + accepted) outgrow its forward time over a step without "
                "drafts (decode-only steps, prefill left out)."
            )
        field = st.selectbox(
            "Chart any step field",
            data.STEP_FIELDS,
            index=None,
            placeholder="choose a field of the engine's step record",
            key="tm_step_field",
            help="Every numeric field of the engine's step record (the engine_steps columns).",
        )
        if field is not None:
            series, field_bucket_s = ui.q(ctx, "step_field_series", since, until, field)
            ui.chart(
                charts.step_field(series, field, per_step=field_bucket_s is None),
                key="step_field",
            )
