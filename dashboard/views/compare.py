"""Compare: a baseline dump (BEFORE) beside the console's source (AFTER, the sidebar's window),
as ``tokenmill diagnose --baseline`` compares them (``diagnose/compare.py``): the verdict, the
config difference, each station's and each request latency's distribution overlaid, the
traffic and host checks, the shifts and the rules whose findings or signals moved.

The baseline comes from ``tokenmill dashboard --baseline PATH`` or the text box. Example trace
ids of AFTER link to their waterfall on the Requests page; BEFORE's open their waterfall here
(the Requests page reads the source, not the baseline)."""

import os

import pandas as pd
import streamlit as st

from tokenmill.dashboard import charts, data, ui
from tokenmill.dashboard.source import ENV_BASELINE, SourceError, StoreHandle
from tokenmill.diagnose.compare import DEFAULT_REGRESSION_PCT, GATED
from tokenmill.diagnose.compare_report import headline, pct, to_json, to_markdown
from tokenmill.diagnose.report import format_evidence, format_value

REQUEST_METRICS = ["TTFT", "ITL p99", "TPOT", "E2E"]


@st.cache_resource(show_spinner=False)
def _baseline(spec: str) -> StoreHandle:
    return StoreHandle(spec)


@st.cache_data(max_entries=8, show_spinner="Comparing the two runs…")
def _comparison(_before, before_key, _after, after_key, before_label, after_label, since, until,
                slo: tuple, threshold: float):  # fmt: skip
    return data.comparison(
        _before,
        _after,
        before_label=before_label,
        after_label=after_label,
        since_ns=since,
        until_ns=until,
        slo=data.GoodputSlo(*slo),
        threshold_pct=threshold,
    )


@st.cache_data(max_entries=16, show_spinner=False)
def _samples(_con, key, since, until) -> pd.DataFrame:
    return data.latency_samples(_con, since, until)


@st.cache_data(max_entries=64, show_spinner=False)
def _detail(_con, key, trace_id):
    return data.request_detail(_con, trace_id)


def _shift_table(shifts) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "": s.label + (" (gated)" if s.key in GATED else ""),
                "BEFORE": format_value(s.key, s.before),
                "AFTER": format_value(s.key, s.after),
                "change": pct(s.change_pct),
                "status": "" if s.status == "same" else s.status,
            }
            for s in shifts
        ]
    )


ctx = ui.begin("Compare")
if ctx is not None:
    c = st.columns([3, 1])
    spec = c[0].text_input(
        "Baseline (BEFORE): a dump or closed trace-store file",
        value=os.environ.get(ENV_BASELINE, ""),
        key="cp_baseline",
        help="The source in the sidebar is AFTER (its chosen window); the baseline is read whole.",
    )
    threshold = c[1].number_input(
        "Regression threshold %",
        min_value=0.0,
        value=DEFAULT_REGRESSION_PCT,
        step=5.0,
        key="cp_threshold",
        help="A gated metric worse than BEFORE by more than this is a regression "
        "(tokenmill diagnose --fail-on-regression).",
    )
    snap = None
    if not spec.strip():
        st.info(
            "No data: name a baseline dump above, or start the console with "
            "`tokenmill dashboard --source AFTER --baseline BEFORE`."
        )
    else:
        try:
            snap = _baseline(spec.strip()).snapshot()
        except SourceError as exc:
            st.error(f"Cannot read the baseline: {exc}")
    if snap is not None:
        before_con = snap.con.cursor()
        since, until = ctx.window
        slo = (ctx.slo.ttft_ms, ctx.slo.itl_ms, ctx.slo.e2e_ms)
        cmp = _comparison(before_con, snap.key, ctx.con, ctx.key, snap.label, "source",
                          since, until, slo, float(threshold))  # fmt: skip
        if cmp is None:
            st.info("No data: the baseline or this window holds no requests.")
        else:
            verdict = {"regression": st.error, "not_comparable": st.warning}
            verdict.get(cmp.verdict, st.success)(headline(cmp))
            st.caption(
                f"BEFORE `{snap.label}`: {cmp.before.traffic['requests']:,} requests, "
                f"{ui.ts(cmp.before.start_ns)} – {ui.ts(cmp.before.end_ns)} · AFTER (source, "
                f"sidebar window): {cmp.after.traffic['requests']:,} requests, "
                f"{ui.ts(cmp.after.start_ns)} – {ui.ts(cmp.after.end_ns)}"
            )
            tiles = [s for s in (*cmp.latency, *cmp.throughput) if s.key in GATED]
            cols = st.columns(len(tiles))
            for col, s in zip(cols, tiles, strict=True):
                col.metric(
                    s.label,
                    format_value(s.key, s.after),
                    delta=None if s.change_pct is None else pct(s.change_pct),
                    delta_color="inverse" if GATED[s.key] == "up" else "normal",
                    help=f"BEFORE {format_value(s.key, s.before)}",
                )

            st.subheader("Config difference")
            if cmp.config_diff:
                st.table(
                    pd.DataFrame(
                        [
                            {
                                "setting": x.name,
                                "kind": x.kind,
                                "BEFORE": "(absent)" if x.before is None else str(x.before),
                                "AFTER": "(absent)" if x.after is None else str(x.after),
                            }
                            for x in cmp.config_diff
                        ]
                    ).set_index("setting")
                )
            else:
                st.markdown("No difference in the engine flags, model, device or versions.")

            before_samples = _samples(before_con, snap.key, None, None)
            after_samples = _samples(ctx.con, ctx.key, since, until)
            stations = [s for s in data.STATIONS if s in set(after_samples["metric"])]
            ui.chart(
                charts.compare_distributions(
                    before_samples, after_samples, stations, "Station span times, BEFORE vs AFTER"
                ),
                key="cp_stations",
            )
            ui.chart(
                charts.compare_distributions(
                    before_samples,
                    after_samples,
                    REQUEST_METRICS,
                    "Request latency, BEFORE vs AFTER",
                ),
                key="cp_requests",
            )

            st.subheader("Traffic and host: comparable?")
            st.dataframe(
                pd.DataFrame(
                    [
                        {
                            "figure": x.label,
                            "BEFORE": format_value(x.key, x.before),
                            "AFTER": format_value(x.key, x.after),
                            "change": pct(x.change),
                            "tolerance": f"{x.tolerance:g} %",
                            "comparable": "ok" if x.ok else "differs",
                            "why it matters": x.reason,
                        }
                        for x in cmp.checks
                    ]
                ),
                hide_index=True,
                key="cp_checks",
            )
            c = st.columns(2)
            with c[0]:
                st.subheader("Latency")
                st.dataframe(_shift_table(cmp.latency), hide_index=True, key="cp_latency")
            with c[1]:
                st.subheader("Throughput and goodput")
                st.dataframe(_shift_table(cmp.throughput), hide_index=True, key="cp_tput")
            st.subheader("Stations (span time)")
            st.dataframe(
                _shift_table([s for qs in cmp.stations.values() for s in qs.values()]),
                hide_index=True,
                key="cp_station_table",
            )

            st.subheader("Rules whose findings or signals moved")
            before_ids: list[str] = list(cmp.before.slowest)
            if not cmp.rules:
                st.markdown("None: no rule fired in either run and no rule's signals moved.")
            for i, m in enumerate(cmp.rules):
                head = (
                    f"{m.rule_id} — {m.change} (BEFORE {m.before or 'silent'}, "
                    f"AFTER {m.after or 'silent'})"
                )
                with st.expander(head, expanded=i == 0):
                    st.caption(m.title)
                    for s in m.moved:
                        st.markdown(
                            f"- `{s.key}` {format_value(s.key, s.before)} → "
                            f"{format_value(s.key, s.after)} ({pct(s.change_pct)})"
                        )
                    if m.evidence_before:
                        st.markdown("**Evidence BEFORE** " + format_evidence(m.evidence_before))
                    if m.evidence_after:
                        st.markdown("**Evidence AFTER** " + format_evidence(m.evidence_after))
                    if m.examples_from == "after":
                        st.markdown("**Example traces (AFTER)**")
                        ui.trace_links(m.example_trace_ids)
                    elif m.examples_from == "before":
                        st.markdown(
                            "**Example traces (BEFORE)**: "
                            + ", ".join(f"`{t}`" for t in m.example_trace_ids)
                        )
                        before_ids += [t for t in m.example_trace_ids if t not in before_ids]

            st.subheader("Slowest requests (TTFT)")
            c = st.columns(2)
            with c[0]:
                st.markdown("**AFTER** (each opens its waterfall on the Requests page)")
                ui.trace_links(cmp.after.slowest)
            with c[1]:
                st.markdown("**BEFORE** (the baseline's requests open here)")
                if before_ids:
                    picked = st.selectbox("BEFORE request (trace id)", before_ids, key="cp_before")
                    detail = _detail(before_con, snap.key, picked)
                    if detail is None or detail["spans"].empty:
                        st.info("No data: this trace has no spans in the baseline.")
                    else:
                        ui.chart(charts.waterfall(detail), key="cp_before_waterfall")
                else:
                    st.markdown("none")
            for n in cmp.notes:
                st.caption(n)
            c = st.columns(2)
            c[0].download_button(
                "Comparison (Markdown)", to_markdown(cmp), file_name="compare.md", key="cp_md"
            )
            c[1].download_button(
                "Comparison (JSON)", to_json(cmp), file_name="compare.json", key="cp_json"
            )
