"""Requests: a searchable table (tenant, status, finish reason; slowest first) and, for the
selected request, its eight stations as a waterfall with token times, chunks and preemptions
(and, for a request moved from the prefill to the decode core, its KV transfer and wait), its
critical path (``tokenmill explain``: the parts that add up to its E2E as a row of the
waterfall and a table, who it waited behind, its prompt blocks' cache misses).

A request can be opened directly with ``?trace=<trace id>`` in the page URL."""

import streamlit as st

from tokenmill.dashboard import charts, ui

SORT_LABELS = {
    "e2e": "slowest E2E first",
    "ttft": "slowest TTFT first",
    "itl": "worst ITL p99 first",
    "latest": "latest first",
}
ANY = "(any)"


def _critical_path(ex: dict) -> None:
    """The explanation under the waterfall: the headline, the parts, the cache's misses."""
    st.markdown("**Critical path**")
    head = (
        f"{len(ex['parts'])} parts add up to {ui.fmt_ms(ex['parts_ms'])} "
        f"(E2E {ui.fmt_ms(ex['e2e_ms'])})."
    )
    if ex["waited_behind"]:
        top = ex["waited_behind"][0]
        tenant = f" (tenant {top['tenant']})" if top.get("tenant") else ""
        head += (
            f" Waited behind `{top['request_id']}`{tenant} for {ui.fmt_ms(top['ms'])} "
            f"({', '.join(top['reasons'])})."
        )
    st.caption(head)
    st.dataframe(
        [
            {
                "start ms": p["start_ms"],
                "ms": p["ms"],
                "share": p["share"],
                "phase": p["phase"],
                "part": p["text"],
            }
            for p in ex["parts"]
        ],
        hide_index=True,
        key="rq_path",
        column_config={
            "start ms": st.column_config.NumberColumn(format="%.1f"),
            "ms": st.column_config.NumberColumn(format="%.1f"),
            "share": st.column_config.NumberColumn(format="percent"),
        },
    )
    cache = ex.get("cache")
    if cache:
        lines = "; ".join(m["text"] for m in cache["misses"])
        st.caption(
            f"Prefix cache: {cache['cached_blocks']} of {cache['prompt_blocks']} prompt blocks "
            f"served from the cache. Computed: {lines}."
        )
    for note in ex.get("notes") or []:
        st.caption(f"Note: {note}")


ctx = ui.begin("Requests")
if ctx is not None:
    since, until = ctx.window
    opts = ui.q(ctx, "filter_options", since, until)
    c = st.columns([2, 1, 1, 1, 1])
    search = c[0].text_input(
        "Trace / request id starts with",
        value=st.query_params.get("trace", ""),
        key="rq_search",
    )
    tenant = c[1].selectbox("Tenant", [ANY, *opts["tenants"]], key="rq_tenant")
    status = c[2].selectbox("Status", [ANY, *opts["statuses"]], key="rq_status")
    reason = c[3].selectbox("Finish reason", [ANY, *opts["finish_reasons"]], key="rq_reason")
    sort = c[4].selectbox("Sort", list(SORT_LABELS), format_func=SORT_LABELS.get, key="rq_sort")
    table, total = ui.q(
        ctx,
        "requests_table",
        since,
        until,
        tenant=None if tenant == ANY else tenant,
        status=None if status == ANY else status,
        finish_reason=None if reason == ANY else reason,
        search=search or None,
        sort=sort,
        limit=500,
    )
    if table.empty:
        st.info("No data: no request in this window matches the filters.")
    else:
        st.caption(f"{total:,} requests match; showing the first {len(table):,}.")
        event = st.dataframe(
            table,
            hide_index=True,
            on_select="rerun",
            selection_mode="single-row",
            key="rq_table",
            height=min(320, 40 + 35 * len(table)),
            column_config={
                "arrival": st.column_config.DatetimeColumn("arrival (UTC)", format="HH:mm:ss.SSS"),
                "ttft_ms": st.column_config.NumberColumn("TTFT ms", format="%.1f"),
                "itl_p99_ms": st.column_config.NumberColumn("ITL p99 ms", format="%.1f"),
                "e2e_ms": st.column_config.NumberColumn("E2E ms", format="%.1f"),
                "queue_ms": st.column_config.NumberColumn("queue ms", format="%.1f"),
                "prefill_ms": st.column_config.NumberColumn("prefill ms", format="%.1f"),
                "decode_ms": st.column_config.NumberColumn("decode ms", format="%.1f"),
            },
        )
        rows = list(getattr(getattr(event, "selection", None), "rows", None) or [])
        ids = list(table["trace_id"])
        picked = ids[rows[0]] if rows and rows[0] < len(ids) else None
        trace_id = st.selectbox(
            "Request (trace id)",
            ids,
            index=ids.index(picked) if picked in ids else 0,
            key=f"rq_pick_{picked or ''}",
            help="Pick a row in the table, or choose here.",
        )
        detail = ui.q(ctx, "request_detail", trace_id)
        if detail is None:
            st.info("No data: this trace has no spans in the store.")
        else:
            r = detail["request"] or {}
            st.subheader(f"Request {r.get('request_id') or trace_id}")
            c = st.columns(6)
            c[0].metric("TTFT", ui.fmt_ms(r.get("ttft_ms")))
            c[1].metric("ITL p99", ui.fmt_ms(r.get("itl_p99_ms")))
            c[2].metric("E2E", ui.fmt_ms(r.get("e2e_ms")))
            c[3].metric(
                "Tokens in / out", f"{r.get('input_tokens') or 0} / {r.get('output_tokens') or 0}"
            )
            c[4].metric("Preemptions", f"{r.get('preemptions') or 0}")
            c[5].metric("Finish", str(r.get("finish_reason") or r.get("error_type") or "—"))
            ex = ui.q(ctx, "request_explanation", trace_id)
            if detail["spans"].empty:
                st.info("No data: the request has a row but no spans.")
            else:
                ui.chart(charts.waterfall(detail, ex), key="request_waterfall")
            moved = detail["kv_transfer"]
            if moved is not None:
                mb = f"{moved['bytes'] / 1e6:,.1f} MB" if moved["bytes"] is not None else "its KV"
                st.caption(
                    f"Prefilled on the prefill core, decoded on the decode core: {mb} moved in "
                    f"{ui.fmt_ms(moved['end_ms'] - moved['start_ms'])}, then waited "
                    f"{ui.fmt_ms(moved['waited_ms'])} for room on the decode side."
                )
            if ex is not None:
                _critical_path(ex)
            st.caption(
                f"trace `{trace_id}` · tenant {r.get('tenant') or '—'} · "
                f"error {r.get('error_type') or 'none'} · HTTP {r.get('http_status') or '—'}"
            )
            with st.expander("Spans and events"):
                st.dataframe(
                    detail["spans"][
                        ["name", "start_ms", "end_ms", "duration_ms", "status_code", "error_type"]
                    ],
                    hide_index=True,
                )
                if detail["events"]:
                    events = [
                        {
                            **e,
                            "attributes": ", ".join(f"{k}={v}" for k, v in e["attributes"].items()),
                        }
                        for e in detail["events"]
                    ]
                    st.dataframe(events, hide_index=True)
