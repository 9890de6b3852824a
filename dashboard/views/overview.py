"""Overview: the tiles (TTFT/ITL p50/p99, throughput, goodput against the SLOs, error rate, KV
usage, active diagnoses) and TTFT and ITL over time with concurrency laid over them."""

import streamlit as st

from tokenmill.dashboard import charts, ui

ctx = ui.begin("Overview")
if ctx is not None:
    since, until = ctx.window
    o = ui.q(ctx, "overview", since, until, ctx.slo)
    c = st.columns(5)
    c[0].metric("TTFT p50", ui.fmt_ms(o["ttft_p50_ms"]))
    c[1].metric("TTFT p99", ui.fmt_ms(o["ttft_p99_ms"]))
    c[2].metric("ITL p50", ui.fmt_ms(o["itl_p50_ms"]))
    c[3].metric("ITL p99", ui.fmt_ms(o["itl_p99_ms"]))
    c[4].metric(
        "Throughput",
        ui.fmt_num(o["throughput_tok_s"], "tok/s"),
        help="Output tokens sampled by the engine in the window / window length.",
    )
    c = st.columns(5)
    c[0].metric(
        "Goodput",
        ui.fmt_pct(o["goodput_share"]),
        help=(
            f"Requests that completed with TTFT ≤ {ctx.slo.ttft_ms:g} ms, their own ITL p99 ≤ "
            f"{ctx.slo.itl_ms:g} ms and E2E ≤ {ctx.slo.e2e_ms:g} ms, as a share of all "
            f"requests (set the SLOs in the sidebar); "
            f"{ui.fmt_num(o['goodput_rate_per_s'], 'req/s', 2)}."
        ),
    )
    c[1].metric("Goodput rate", ui.fmt_num(o["goodput_rate_per_s"], "req/s", 2))
    c[2].metric(
        "Error rate",
        ui.fmt_pct(o["error_rate"]),
        help=f"{o['errors'] or 0} of {o['requests'] or 0} requests carry an error type.",
    )
    c[3].metric(
        "KV usage",
        ui.fmt_pct(o["kv_usage_mean"]),
        help=f"Mean share of KV blocks in use; peak {ui.fmt_pct(o['kv_usage_max'])}, "
        f"last {ui.fmt_pct(o['kv_usage_last'])}.",
    )
    c[4].metric("Requests", f"{o['requests'] or 0:,}", help=f"{o['completed'] or 0:,} completed")

    report = ui.q(ctx, "diagnosis", since, until, float(st.session_state.get("tm_diag_s", 10.0)))
    findings = report.findings if report is not None else []
    st.subheader(f"Active diagnoses: {len(findings)}")
    if not findings:
        st.success("No rule fired in this window." if report else "No requests in this window.")
    for f in findings:
        line = f"**{f.rule_id}** — {f.title} ({f.severity}, confidence {f.confidence:.0%})"
        (st.error if f.severity == "critical" else st.warning)(line)

    st.subheader("TTFT and ITL with concurrency")
    series = ui.q(ctx, "latency_series", since, until, ctx.bucket_s)
    if series.empty:
        st.info("No data: no requests or engine steps in this window.")
    else:
        ui.chart(charts.latency_concurrency(series), key="overview_latency")
        st.caption(
            f"Buckets of {ctx.bucket_s:g} s. Latencies by arrival; concurrency is the mean "
            "number of requests running in the engine's steps (shaded, right axis)."
        )
