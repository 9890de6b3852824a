"""Diagnosis: the findings of ``tokenmill diagnose`` for the selected window, each with its
evidence, an evidence chart (the diagnoser's per-window signals, the finding's window shaded)
and its runbook rendered. Evidence numbers show with their units
(``diagnose/report.py``: ``format_evidence``); each example trace id links to its waterfall on
the Requests page."""

import json

import streamlit as st

from tokenmill.dashboard import charts, data, ui
from tokenmill.diagnose.report import (
    SAME_WORK_FROM_REQUESTS,
    format_evidence,
    scraped_families,
    to_markdown,
)
from tokenmill.diagnose.signals import ran_from_requests

WINDOWS_S = (5.0, 10.0, 30.0, 60.0, 300.0)

ctx = ui.begin("Diagnosis")
if ctx is not None:
    since, until = ctx.window
    current = float(st.session_state.get("tm_diag_s", 10.0))
    window_s = st.selectbox(
        "Signal window",
        WINDOWS_S,
        index=WINDOWS_S.index(current) if current in WINDOWS_S else 1,
        format_func=lambda s: f"{s:g} s",
        key="dg_window",
        help="Length of the windows the rules compare (tokenmill diagnose --window).",
    )
    st.session_state["tm_diag_s"] = float(window_s)
    report = ui.fleet_diagnosis(ctx, since, until, float(window_s))
    if report is None:
        st.info("No data: no requests arrived in this window, so there is nothing to diagnose.")
    else:
        s = report.summary
        c = st.columns(5)
        c[0].metric("Findings", f"{len(report.findings)}")
        c[1].metric("Requests", f"{s.get('requests') or 0:,}")
        c[2].metric("Errors", f"{s.get('errors') or 0:,}")
        c[3].metric("TTFT p99", ui.fmt_ms(s.get("ttft_p99_ms")))
        c[4].metric("ITL p99", ui.fmt_ms(s.get("itl_p99_ms")))
        for rule_id, msg in report.rule_errors.items():
            st.error(f"Rule {rule_id} failed: {msg}")
        if len(report.sources) > 1:  # a fleet: each source diagnosed on its own
            st.dataframe(ui.fleet_table(report), hide_index=True, key="dg_sources")
        if not report.findings and report.not_assessed:
            st.success(
                "No problems found among the rules this store lets us assess in this window."
            )
        elif not report.findings:
            st.success("No problems found in this window.")
        if scraped := scraped_families(report.signal_sources):
            st.caption(
                "No per-step records in this store: the engine's queue and KV-cache signals "
                "come from its scraped /metrics (" + ", ".join(scraped) + ")."
            )
        if ran_from_requests(report.signal_sources):
            st.caption(SAME_WORK_FROM_REQUESTS)
        if report.not_assessed:
            with st.expander(f"Not assessed: {len(report.not_assessed)} rules"):
                st.caption(
                    "This store lacks what they read (another engine's store holds no "
                    "per-step records or device samples of ours)."
                )
                st.markdown(
                    "\n".join(f"- `{r}`: {why}" for r, why in sorted(report.not_assessed.items()))
                )
        windows = ui.q(ctx, "signal_windows", since, until, float(window_s))
        for i, f in enumerate(report.findings):
            head = (
                f"{i + 1}. {f.rule_id}{ui.where(report, f)} — {f.title} "
                f"({f.severity}, confidence {f.confidence:.0%})"
            )
            if ctx.sources:  # the evidence of a fleet's finding: its own source's windows
                windows = ui.q(
                    ui.for_source(ctx, f.source), "signal_windows", since, until, float(window_s)
                )
            with st.expander(head, expanded=i == 0):
                (st.error if f.severity == "critical" else st.warning)(f.summary)
                if f.explained_by:
                    st.caption("Explained by: " + ", ".join(f.explained_by))
                st.markdown(
                    f"**Window** {ui.ts(f.window_start_ns)} – {ui.ts(f.window_end_ns)}  \n"
                    f"**Knob** {f.knob}"
                )
                st.markdown("**Evidence** " + format_evidence(f.evidence, code=True))
                if f.support:
                    st.markdown("**Test** " + f.support["line"])
                st.markdown("**Example traces** (each opens its waterfall)")
                ui.trace_links(f.example_trace_ids)
                series = data.evidence_signals(f.rule_id, windows)
                if series:
                    fig = charts.evidence(windows, series, f.window_start_ns, f.window_end_ns)
                    ui.chart(fig, key=f"evidence_{f.rule_id}" + (f"_{i}" if ctx.sources else ""))
                else:
                    st.info("No data: no per-window signal to chart for this rule.")
                st.markdown("**Likely causes**\n" + "\n".join(f"1. {c}" for c in f.causes))
                st.markdown("**Checks**\n" + "\n".join(f"- {c}" for c in f.checks))
                text = data.runbook(f.rule_id)
                st.markdown("---\n**Runbook**")
                if text:
                    st.markdown(text)
                else:
                    st.info(f"No runbook shipped for {f.rule_id}.")
        for f in report.inconclusive:  # too little evidence: listed apart, not findings
            st.caption(
                f"Inconclusive ({f.rule_id}): {f.summary} — {f.support['reason']}; "
                f"{f.support['line']}"
            )
        for note in report.notes:
            st.info(f"Hint ({note.rule_id}{ui.where(report, note)}): {note.summary}")
            st.caption(f"Knob: {note.knob} · Evidence: " + format_evidence(note.evidence))
        c = st.columns(2)
        c[0].download_button(
            "Report (Markdown)", to_markdown(report), file_name="diagnosis.md", key="dg_md"
        )
        c[1].download_button(
            "Report (JSON)",
            json.dumps(report.to_json(), indent=2, default=str),
            file_name="diagnosis.json",
            key="dg_json",
        )
