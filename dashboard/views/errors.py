"""Errors: error rate by type over time and, per type, counts with example trace ids; server
and engine events of severity warning or error."""

import streamlit as st

from tokenmill.dashboard import charts, ui

ctx = ui.begin("Errors")
if ctx is not None:
    since, until = ctx.window
    examples = ui.q(ctx, "error_examples", since, until)
    if examples.empty:
        st.success("No request errors in this window.")
    else:
        total = int(examples["errors"].sum())
        c = st.columns(3)
        c[0].metric("Errors", f"{total:,}")
        c[1].metric("Error types", f"{len(examples)}")
        c[2].metric("Most common", str(examples["error_type"].iloc[0]))
        series = ui.q(ctx, "errors_series", since, until, ctx.bucket_s)
        ui.chart(charts.errors(series), key="errors_rate")
        st.caption(f"Errors per second in buckets of {ctx.bucket_s:g} s, by request end.")
        st.subheader("By type, with example traces")
        shown = examples.assign(
            open=examples["example_trace_ids"].map(lambda ids: f"requests?trace={ids[0]}"),
            example_trace_ids=examples["example_trace_ids"].map(lambda ids: " ".join(ids)),
            http_statuses=examples["http_statuses"].map(
                lambda s: ", ".join(str(x) for x in s if x is not None)
            ),
        )[["error_type", "errors", "share", "open", "example_trace_ids", "http_statuses",
            "first_seen", "last_seen"]]  # fmt: skip
        st.dataframe(
            shown,
            hide_index=True,
            column_config={
                "share": st.column_config.NumberColumn("share of ended", format="percent"),
                "open": st.column_config.LinkColumn(
                    "latest example", display_text="open waterfall", width="small"
                ),
                "first_seen": st.column_config.DatetimeColumn(format="HH:mm:ss"),
                "last_seen": st.column_config.DatetimeColumn(format="HH:mm:ss"),
            },
        )
        st.caption(
            "“open waterfall” shows the latest example on the Requests page; any other id can "
            "be pasted into its search box."
        )
    events = ui.q(ctx, "error_events", since, until)
    st.subheader("Server and engine events (warning, error)")
    if events.empty:
        st.info("No data: no warning or error events in this window.")
    else:
        st.dataframe(events[["time", "kind", "severity", "message", "attributes"]], hide_index=True)
