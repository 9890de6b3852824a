"""What if: the store's recorded traffic replayed through the engine's own scheduler, KV pool
and router at other arrival rates, knob settings and host paces (``tokenmill plan``,
docs/planning.md):
goodput under the sidebar's SLOs against the rate, with its knee, TTFT and ITL p99 beside it,
and each replay's numbers; then the capacity (``tokenmill plan --capacity``): the highest rate
whose TTFT p99 and ITL p99 stay within the sidebar's SLOs, its band, the
concurrent users it means and what binds first. The whole store is the recording (the sidebar's window is not
applied: the step-cost model wants every step)."""

import pandas as pd
import streamlit as st

from tokenmill.dashboard import charts, ui
from tokenmill.plan.capacity import NoRateMeets, capacity, p99_slo
from tokenmill.plan.predict import PlanError, predict, recording_from
from tokenmill.plan.recommend import knee
from tokenmill.plan.whatif import SloBounds, knob_fields, knob_type, parse_slo, parse_whatif
from tokenmill.telemetry.goodput import GoodputSlo

FACTORS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)
#: the knobs the page offers, in its order; each one's widget (label, bounds), tooltip and
#: value as recorded come from its field in plan/whatif.py (``Knobs``)
PAGE_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "chunked_prefill", "hosts", "step_time")


@st.cache_resource(max_entries=4, show_spinner="Fitting step costs on the recorded steps…")
def _recording(_con, key):
    return recording_from(_con, "this store")


@st.cache_data(max_entries=16, show_spinner="Replaying the recorded traffic…")
def _curve(_rec, key, knobs: str, factors: tuple, slo: tuple) -> pd.DataFrame:
    rows = []
    target = SloBounds("", {}, GoodputSlo(*slo))
    for f in factors:
        text = ",".join(p for p in (f"rate={f:g}" if f != 1.0 else "", knobs) if p)
        p = predict(_rec, parse_whatif(text), target)
        rows.append(
            {
                "factor": f,
                "rate_per_s": p.setup["rate_per_s"],
                **{k: p.summary[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                                             "itl_p99_ms", "e2e_p99_ms", "goodput_share")},
                "preemptions": p.replay["preemptions"],
                "waiting_mean": p.replay["waiting_mean"],
                "kv_usage_max": p.replay["kv_usage_max"],
                "notes": "; ".join(p.notes),
            }
        )  # fmt: skip
    return pd.DataFrame(rows)


@st.cache_data(max_entries=8, show_spinner="Searching the highest rate that meets the SLOs…")
def _capacity(_rec, key, slo_text: str) -> dict | str:
    try:
        return capacity(_rec, parse_slo(slo_text))
    except NoRateMeets as exc:
        return str(exc)


def _knob_widgets(cfg) -> list[str]:
    """One widget per :data:`PAGE_KNOBS` knob, set to the recording's value; the
    ``knob=value`` of each one moved off it."""
    meta = knob_fields()
    changed = []
    for column, name in zip(st.columns(len(PAGE_KNOBS)), PAGE_KNOBS, strict=True):
        m = meta[name].metadata
        kind, widget = knob_type(name), m["console"]
        field = m.get("config_field")
        recorded = kind(getattr(cfg, field)) if field else m["recorded"]
        if kind is bool:
            value = column.toggle(widget["label"], recorded, help=m["help"])
            shown = "on" if value else "off"
        else:
            value = column.number_input(
                widget["label"],
                min_value=kind(widget["min"]),
                max_value=kind(widget["max"]),
                value=recorded,
                step=kind(widget.get("step", 1)),
                help=m["help"],
            )
            shown = f"{value:g}" if kind is float else str(value)
        if value != recorded:
            changed.append(f"{name}={shown}")
    return changed


ctx = ui.begin("What if")
if ctx is not None:
    try:
        rec = _recording(ctx.con, ctx.key)
    except PlanError as exc:
        st.info(f"No replay: {exc}")
        rec = None
    if rec is not None:
        knobs = _knob_widgets(rec.config)
        slo = (ctx.slo.ttft_ms, ctx.slo.itl_ms, ctx.slo.e2e_ms)
        df = _curve(rec, ctx.key, ",".join(knobs), FACTORS, slo)
        k = knee(list(df["rate_per_s"]), list(df["goodput_share"]))
        ui.chart(charts.whatif_curve(df, k), key="whatif_curve")
        st.caption(
            f"The recording's {len(rec.workload):,} requests at "
            f"{', '.join(f'{f:g}x' for f in FACTORS)} their rate"
            + (f" with {', '.join(knobs)}" if knobs else "")
            + f"; goodput: TTFT ≤ {slo[0]:,.0f} ms, ITL p99 ≤ {slo[1]:,.0f} ms, E2E ≤ "
            f"{slo[2]:,.0f} ms (the sidebar's SLOs). "
            + (f"Knee: {k:.2f} requests/s." if k is not None else "No knee in this range.")
        )
        st.dataframe(
            df.drop(columns=["factor"]),
            hide_index=True,
            column_config={
                "rate_per_s": st.column_config.NumberColumn("requests/s", format="%.2f"),
                "goodput_share": st.column_config.NumberColumn("goodput", format="percent"),
                "kv_usage_max": st.column_config.NumberColumn("KV use, max", format="percent"),
            },
        )
        est = rec.model.holdout.get("all", {})
        if est.get("median_abs_err_pct") is not None:
            st.caption(
                f"Step-cost model: median error {est['median_abs_err_pct']:.0f}% on "
                f"{est['steps']} held-out steps. `tokenmill plan` prints the error estimate "
                "on the recording's last quarter of requests."
            )
        st.subheader("Capacity")
        slo_text = p99_slo(slo[0], slo[1])
        cap = _capacity(rec, ctx.key, slo_text)
        if isinstance(cap, str):
            st.warning(cap)
        else:
            lo, hi = (f"{v:.2f}" if v is not None else "none" for v in cap["band_rate_per_s"])
            cols = st.columns(4)
            cols[0].metric(
                "requests/s within the SLO", f"{cap['capacity_rate_per_s']:.2f}",
                help=f"{slo_text}; with steps {cap['band_step_error_pct']:.0f}% dearer or cheaper: {lo}-{hi}",
            )  # fmt: skip
            cols[1].metric("concurrent users", f"{cap['concurrent_users']:.1f}",
                           help="closed loop, no think time: requests in the engine at once")  # fmt: skip
            miss = cap.get("first_miss")
            cols[2].metric("binds first", miss["binds"] if miss else "none in range")
            cols[3].metric(
                "goodput knee",
                f"{cap['knee_rate_per_s']:.2f}" if cap["knee_rate_per_s"] is not None else "none",
            )
            ui.chart(charts.capacity_curve(cap), key="capacity_curve")
            st.caption(
                f"TTFT p99 and ITL p99 within {slo_text} up to {cap['capacity_rate_per_s']:.2f} "
                f"requests/s (x{cap['capacity_factor']:.2f} the recorded rate; {lo}-{hi} with "
                f"every step {cap['band_step_error_pct']:.0f}% dearer or cheaper, the fit's "
                "median error on held-out steps)"
                + (f"; past it, {miss['binds']} binds first: {miss['why']}." if miss else ".")
            )
