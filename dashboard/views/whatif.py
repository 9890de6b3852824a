"""What if: the store's recorded traffic replayed through the engine's own scheduler, KV pool
and router at other arrival rates, knob settings and host paces (``tokenmill plan``,
docs/planning.md):
goodput under the sidebar's SLOs against the rate, with its knee, TTFT and ITL p99 beside it,
and each replay's numbers. The whole store is the recording (the sidebar's window is not
applied: the step-cost model wants every step)."""

import pandas as pd
import streamlit as st

from tokenmill.dashboard import charts, ui
from tokenmill.plan.predict import PlanError, predict, recording_from
from tokenmill.plan.recommend import knee
from tokenmill.plan.whatif import Slo, parse_whatif

FACTORS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)


@st.cache_resource(max_entries=4, show_spinner="Fitting step costs on the recorded steps…")
def _recording(_con, key):
    return recording_from(_con, "this store")


@st.cache_data(max_entries=16, show_spinner="Replaying the recorded traffic…")
def _curve(_rec, key, knobs: str, factors: tuple, slo: tuple) -> pd.DataFrame:
    rows = []
    target = Slo("", {}, *slo)
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


ctx = ui.begin("What if")
if ctx is not None:
    try:
        rec = _recording(ctx.con, ctx.key)
    except PlanError as exc:
        st.info(f"No replay: {exc}")
        rec = None
    if rec is not None:
        cfg = rec.config
        c = st.columns(5)
        seqs = c[0].number_input("max_num_seqs", 1, 4096, int(cfg.max_num_seqs))
        budget = c[1].number_input(
            "max_num_batched_tokens", 16, 1 << 20, int(cfg.max_num_batched_tokens)
        )
        chunked = c[2].toggle("chunked prefill", bool(cfg.enable_chunked_prefill))
        hosts = c[3].number_input("hosts like this one", 1, 64, 1)
        pace = c[4].number_input(
            "step time ×",
            0.1,
            10.0,
            1.0,
            0.05,
            help="every step's time times this: a host slower (above 1) or faster than the "
            "recorded one. A shared host drifts by tens of percent.",
        )
        knobs = []
        if seqs != cfg.max_num_seqs:
            knobs.append(f"max_num_seqs={seqs}")
        if budget != cfg.max_num_batched_tokens:
            knobs.append(f"max_num_batched_tokens={budget}")
        if chunked != cfg.enable_chunked_prefill:
            knobs.append(f"chunked_prefill={'on' if chunked else 'off'}")
        if hosts > 1:
            knobs.append(f"hosts={hosts}")
        if pace != 1.0:
            knobs.append(f"step_time={pace:g}")
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
