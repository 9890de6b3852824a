"""Now: what the live diagnosis loop (``serve``, ``proxy``, ``collect`` with
``--diagnose-every``) holds open right now, from the store's ``findings`` table: each open
finding with its rule, severity, confidence, since when it is open, summary, evidence with units
(``diagnose/report.py``: ``format_evidence``), example traces (each opens its waterfall) and
runbook; a timeline of the findings opening and resolving above TTFT, ITL and the queue over
the last 15 min, 1 h or 6 h; the findings resolved in that span with how long each lasted.

"Now" is the store's newest row (as the sidebar's "Last N minutes" counts). On a live source
it is the first page and refreshes with the sidebar's poll (``ui._poll``: a rerun whenever a
newer dump has been fetched); a dump or closed store shows the findings it holds, and the page
says it is not live."""

import pandas as pd
import streamlit as st

from tokenmill.dashboard import charts, data, ui
from tokenmill.diagnose.report import format_evidence

SPANS_S = {"15 min": 900, "1 h": 3600, "6 h": 6 * 3600}
NO_FINDINGS = (
    "No findings recorded (the live diagnosis runs in serve/proxy/collect with --diagnose-every)."
)


def _age(seconds: float) -> str:
    """``3 min 20 s``, ``2 h 5 min``, ``12 s``."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def _open_finding(f, now_ns: int) -> None:
    """One open finding: its head, summary, evidence, traces and runbook."""
    with st.container(border=True):
        where = f" on {f['source']}" if isinstance(f.get("source"), str) else ""
        st.markdown(
            f"#### {f['rule']}{where} — {f['title']}\n"
            f"**{f['severity']}**, confidence {f['confidence']:.0%} · open since "
            f"{ui.ts(f['start_ns'])} (for {_age((now_ns - f['start_ns']) / data.NS)}) · "
            f"last held {ui.ts(f['last_seen_ns'])}"
        )
        (st.error if f["severity"] == "critical" else st.warning)(f["summary"])
        if f["explained_by"]:
            st.caption("Explained by: " + ", ".join(f["explained_by"]))
        if f["evidence"]:
            st.markdown("**Evidence** " + format_evidence(f["evidence"], code=True))
        if f["knob"]:
            st.markdown(f"**Knob** {f['knob']}")
        st.markdown("**Example traces** (each opens its waterfall)")
        ui.trace_links(f["example_trace_ids"])
        text = data.runbook(f["rule"])
        with st.expander(f"Runbook: {f['runbook'] or f['rule']}"):
            if text:
                st.markdown(text)
            else:
                st.info(f"No runbook shipped for {f['rule']}.")


def _resolved_table(resolved: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "rule": resolved["rule"],
            "title": resolved["title"],
            "severity": resolved["severity"],
            "opened": [ui.ts(t) for t in resolved["start_ns"]],
            "resolved": [ui.ts(t) for t in resolved["resolved_ns"]],
            "lasted": [_age(s) for s in resolved["duration_s"]],
        }
    )


def _page(ctx: ui.Ctx) -> None:
    now_ns = ui.q(ctx, "store_now_ns")
    current = ui.q(ctx, "findings_current")
    if current is None or current.empty:
        st.info(NO_FINDINGS)
    if now_ns is None:  # nothing at all in the store
        st.info("No data: the store holds no requests, steps, samples or findings yet.")
        return
    if ctx.live:
        st.caption(
            f"Live, as of the newest row fetched ({ui.ts(now_ns)}); the page follows each fetch."
        )
    else:
        st.info(
            f"Not live: the findings this store holds, as of its newest row ({ui.ts(now_ns)}); "
            "open means still open when it was written. Attach to a running server, proxy or "
            "collector with `tokenmill dashboard --source URL` to follow them."
        )
    opened = current[current["status"] == "open"] if current is not None else None
    n_open = 0 if opened is None else len(opened)
    st.subheader(f"Open findings: {n_open}")
    if n_open == 0 and current is not None and not current.empty:
        st.success("No finding is open.")
    for _, f in opened.iterrows() if n_open else []:
        _open_finding(f, now_ns)

    label = st.segmented_control(
        "Last", list(SPANS_S), default="15 min", key="nw_span", help="The timeline's span, back "
        "from the store's newest row (the sidebar's time window does not apply here)."
    )  # fmt: skip
    since = now_ns - SPANS_S[label or "15 min"] * data.NS
    bucket_s = data.pick_bucket_s(since, now_ns)
    since -= since % int(bucket_s * data.NS)  # buckets on round times
    st.subheader("Timeline")
    spans = ui.q(ctx, "findings_spans", since, now_ns + 1, now_ns)
    series = ui.q(ctx, "now_series", since, now_ns + 1, bucket_s)
    ui.chart(charts.findings_timeline(spans, series, since, now_ns), key="now_timeline")
    st.caption(
        f"Buckets of {bucket_s:g} s. Each finding is a segment on its rule's row, from when it "
        "opened to when it resolved (an arrow: still open), red when critical, orange when a "
        "warning. Latencies by arrival; the queue is each request's queue time and, shaded, "
        "the mean of waiting requests in the engine's steps."
    )

    st.subheader("Recently resolved")
    resolved = ui.q(ctx, "resolved_findings", since, now_ns + 1)
    if resolved.empty:
        st.caption("No finding resolved in this span.")
    else:
        st.table(_resolved_table(resolved))


st.header("Now")
_ctx = ui.context()
if _ctx is None:
    st.info("No data: the source could not be read (see the sidebar).")
else:
    _page(_ctx)
