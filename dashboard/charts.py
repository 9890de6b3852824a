"""Plotly figures of the console, built from the frames of :mod:`.data` (no Streamlit here).

Time axes are UTC datetimes; a figure with several rows shares one time axis so that a spike
can be followed from row to row. Units are in the axis titles (ms, tokens, blocks, W, J/token,
MHz, %, °C, GiB; the roofline's FLOP/byte and GFLOP/s).
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

_CONC = "rgba(120, 120, 120, 0.25)"
_THROTTLE = "rgba(220, 40, 40, 0.18)"
_COLORS = {
    "p50": "#1f77b4",
    "p99": "#d62728",
    "prefill": "#ff7f0e",
    "decode": "#1f77b4",
    "schedule": "#9467bd",
    "forward": "#2ca02c",
    "sample": "#8c564b",
    "prepare": "#17becf",
    "detokenize": "#e377c2",
    "send": "#7f7f7f",
    "write": "#bcbd22",
    "kv_transfer": "#f58518",
    "kv_wait": "#fdae6b",
}


def _layout(fig: go.Figure, height: int, title: str | None = None) -> go.Figure:
    fig.update_layout(
        height=height,
        title=title,
        margin={"l": 60, "r": 60, "t": 50 if title else 30, "b": 60},
        hovermode="x unified",
        legend={"orientation": "h", "y": -0.06, "yanchor": "top", "x": 0},
    )
    return fig


def latency_concurrency(df: pd.DataFrame) -> go.Figure:
    """TTFT (top) and ITL (bottom) p50/p99 in ms over time, each with the mean number of
    running requests (concurrency) shaded behind it on a right-hand axis."""
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        specs=[[{"secondary_y": True}], [{"secondary_y": True}]],
        subplot_titles=("TTFT (by arrival)", "ITL (per-request p50 / p99)"),
    )
    for row, metric in ((1, "ttft"), (2, "itl")):
        fig.add_trace(
            go.Scatter(
                x=df["time"],
                y=df["running_mean"],
                name="concurrency (running)",
                fill="tozeroy",
                mode="none",
                fillcolor=_CONC,
                legendgroup="conc",
                showlegend=row == 1,
                connectgaps=False,
            ),
            row=row,
            col=1,
            secondary_y=True,
        )
        for q in ("p50", "p99"):
            fig.add_trace(
                go.Scatter(
                    x=df["time"],
                    y=df[f"{metric}_{q}_ms"],
                    name=f"{metric.upper()} {q}",
                    mode="lines+markers",
                    marker={"size": 4},
                    line={"color": _COLORS[q], "dash": "solid" if metric == "ttft" else "dot"},
                ),
                row=row,
                col=1,
                secondary_y=False,
            )
        fig.update_yaxes(title_text=f"{metric.upper()} ms", row=row, col=1, secondary_y=False)
        fig.update_yaxes(
            title_text="running",
            row=row,
            col=1,
            secondary_y=True,
            showgrid=False,
            rangemode="tozero",
        )
    return _layout(fig, 560)


#: the critical path's bars, by phase (``tokenmill explain``)
PATH_ROW = "critical path"
_PHASE_COLORS = {
    "api": "#9ecae9",
    "queue": "#e45756",
    "prefill": "#ff7f0e",
    "decode": "#4c78a8",
    "stream": "#54a24b",
}


def waterfall(detail: dict, explanation: dict | None = None) -> go.Figure:
    """One request's stations as a Gantt (ms since arrival): a bar per span, token times as
    ticks on the decode row, prefill chunks as diamonds, preemptions as red crosses with the
    preempted stretch shaded, resumes as green triangles, a client disconnect as a star. A
    request moved between engine cores (``detail["kv_transfer"]``) gets a row under prefill
    with the KV transfer's bar and, after it, the wait for room on the decode side. With its
    ``explanation`` (``data.request_explanation``), a last row, ``critical path``, holds its
    parts end to end, coloured by phase, each part's cause in its hover."""
    spans = detail["spans"]
    rows = list(dict.fromkeys(spans["name"]))  # data.request_detail's order
    if explanation is not None and explanation["parts"]:
        rows.append(PATH_ROW)
    moved = detail.get("kv_transfer")
    spans = spans[spans["name"] != "kv_transfer"]
    fig = go.Figure()
    colors = ["#7f7f7f" if k == "SERVER" else "#4c78a8" for k in spans["kind"]]  # the root
    colors = [
        "#e45756" if s == "ERROR" else c for c, s in zip(colors, spans["status_code"], strict=True)
    ]
    fig.add_trace(
        go.Bar(
            y=spans["name"],
            x=spans["duration_ms"],
            base=spans["start_ms"],
            orientation="h",
            marker={"color": colors},
            name="stations",
            text=[f"{d:,.1f} ms" for d in spans["duration_ms"]],
            textposition="auto",
            hovertemplate="%{y}: %{base:,.1f} → %{x:,.1f} ms long<extra></extra>",
        )
    )
    if moved is not None:
        _kv_transfer_bars(fig, moved)
    if explanation is not None:
        _critical_path_bars(fig, explanation)
    _token_ticks(fig, detail["token_times_ms"])
    _event_marks(fig, detail["events"])
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(rows)))
    fig.update_xaxes(title_text="ms since arrival")
    fig = _layout(fig, 480 if PATH_ROW in rows else 440)
    # below the x-axis title, which the shared layout does not have
    fig.update_layout(
        hovermode="closest", bargap=0.35, barmode="overlay", legend_y=-0.2, margin_b=90
    )
    return fig


#: the waterfall's span events: marker symbol, colour and legend label
_EVENT_MARKS = {
    "chunk": ("diamond", "#ff7f0e", "prefill chunk"),
    "preempted": ("x", "#d62728", "preempted"),
    "resumed": ("triangle-right", "#2ca02c", "resumed"),
    "client_disconnect": ("star", "#9467bd", "client disconnect"),
    "abort": ("x-open", "#d62728", "abort"),
}


def _token_ticks(fig: go.Figure, tokens: list[float]) -> None:
    """The waterfall's token times (ms since arrival) as ticks on the decode row."""
    if not tokens:
        return
    fig.add_trace(
        go.Scatter(
            x=tokens,
            y=["decode"] * len(tokens),
            mode="markers",
            name=f"tokens ({len(tokens)})",
            marker={"symbol": "line-ns-open", "size": 14, "color": "#222"},
            hovertemplate="token at %{x:,.1f} ms<extra></extra>",
        )
    )


def _event_marks(fig: go.Figure, events: list[dict]) -> None:
    """The waterfall's span events as markers on their span's row (:data:`_EVENT_MARKS`), and
    each preempted stretch (to its resume, if any) shaded."""
    for name, (symbol, color, label) in _EVENT_MARKS.items():
        evs = [e for e in events if e["name"] == name]
        if not evs:
            continue
        fig.add_trace(
            go.Scatter(
                x=[e["time_ms"] for e in evs],
                y=[e["span"] for e in evs],
                mode="markers",
                name=label,
                marker={"symbol": symbol, "size": 13, "color": color},
                text=[", ".join(f"{k}={v}" for k, v in e["attributes"].items()) for e in evs],
                hovertemplate=label + " at %{x:,.1f} ms<br>%{text}<extra></extra>",
            )
        )
    for i, e in enumerate(events):
        if e["name"] != "preempted":
            continue
        resumed = next((r for r in events[i + 1 :] if r["name"] == "resumed"), None)
        end = resumed["time_ms"] if resumed else e["time_ms"]
        fig.add_vrect(x0=e["time_ms"], x1=end, fillcolor=_THROTTLE, line_width=0, layer="below")


def _critical_path_bars(fig: go.Figure, ex: dict) -> None:
    """The ``critical path`` row: one bar trace per phase, a bar per part (its text and ms in
    the hover, the longest parts labelled)."""
    e2e = ex["e2e_ms"] or 1.0
    for phase, color in _PHASE_COLORS.items():
        parts = [p for p in ex["parts"] if p["phase"] == phase]
        if not parts:
            continue
        fig.add_trace(
            go.Bar(
                y=[PATH_ROW] * len(parts),
                x=[p["ms"] for p in parts],
                base=[p["start_ms"] for p in parts],
                orientation="h",
                marker={"color": color, "line": {"color": "white", "width": 1}},
                name=f"path: {phase}",
                text=[f"{p['ms']:,.0f} ms" if p["ms"] >= 0.08 * e2e else None for p in parts],
                textposition="inside",
                customdata=[p["text"] for p in parts],
                hovertemplate="%{customdata}<br>%{base:,.1f} ms + %{x:,.1f} ms<extra></extra>",
            )
        )


def _kv_transfer_bars(fig: go.Figure, moved: dict) -> None:
    """The waterfall's ``kv_transfer`` row: the transfer (bytes in its hover) and the wait,
    labelled together at the row's end."""
    mb = f"{moved['bytes'] / 1e6:,.1f} MB" if moved["bytes"] is not None else "? MB"
    length = moved["end_ms"] - moved["start_ms"]
    label = f"{length:,.1f} ms"
    waited = moved["waited_ms"] > 0
    fig.add_trace(
        go.Bar(
            y=["kv_transfer"], x=[length], base=[moved["start_ms"]], orientation="h",
            marker={"color": _COLORS["kv_transfer"]}, name="KV transfer",
            text=[None if waited else label], textposition="outside",
            hovertemplate=f"KV transfer ({mb}): %{{base:,.1f}} → %{{x:,.1f}} ms long<extra></extra>",
        )
    )  # fmt: skip
    if waited:
        fig.add_trace(
            go.Bar(
                y=["kv_transfer"], x=[moved["waited_ms"]], base=[moved["end_ms"]],
                orientation="h", name="KV wait (decode side full)",
                marker={"color": _COLORS["kv_wait"], "pattern": {"shape": "/"}},
                text=[f"{label} + wait {moved['waited_ms']:,.1f} ms"], textposition="outside",
                hovertemplate="waited for room: %{base:,.1f} → %{x:,.1f} ms long<extra></extra>",
            )
        )  # fmt: skip


def engine(steps: pd.DataFrame, hits: pd.DataFrame, per_step: bool) -> go.Figure:
    """Engine steps over time, five rows: batch composition (prefill vs decode tokens per step),
    step time split (schedule / prepare / forward / sample / detokenize ms, then the outputs'
    send to the API process, ``output_send_ms``, and the API writing them to the streams,
    ``stream_write_ms``, where the store has them; a store from before prepare and detokenize
    had their own fields shows them inside forward and sample), running vs waiting, KV blocks
    (used, free, cached), preemptions with the prefix-cache hit rate."""
    fig = make_subplots(
        rows=5,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.04,
        specs=[[{}], [{}], [{}], [{}], [{"secondary_y": True}]],
        subplot_titles=(
            "Batch composition (tokens per step)",
            "Step time split (ms)",
            "Requests running / waiting",
            "KV cache blocks",
            "Preemptions and prefix-cache hit rate",
        ),
    )
    _batch_and_split(fig, steps)
    _queue_and_kv(fig, steps)
    _preemptions_and_hits(fig, steps, hits)
    fig.update_layout(barmode="stack")
    unit = "per step" if per_step else "mean per step"
    fig.update_yaxes(title_text=f"tokens ({unit})", row=1, col=1)
    fig.update_yaxes(title_text="ms", row=2, col=1)
    fig.update_yaxes(title_text="requests", row=3, col=1)
    fig.update_yaxes(title_text="blocks", row=4, col=1)
    fig.update_yaxes(title_text="preemptions", row=5, col=1)
    fig.update_yaxes(
        title_text="hit rate", row=5, col=1, secondary_y=True, range=[0, 1], tickformat=".0%"
    )
    return _layout(fig, 1150)


def _batch_and_split(fig: go.Figure, steps: pd.DataFrame) -> None:
    """The engine chart's rows 1 and 2: prefill vs decode tokens per step, and the step time
    split (the parts the store has)."""
    x = steps["time"]
    for col in ("prefill", "decode"):
        fig.add_trace(
            go.Bar(x=x, y=steps[f"{col}_tokens"], name=f"{col} tokens", marker_color=_COLORS[col]),
            row=1,
            col=1,
        )
    for col in ("schedule", "prepare", "forward", "sample", "detokenize", "send", "write"):
        if f"{col}_ms" not in steps or steps[f"{col}_ms"].isna().all():
            continue
        fig.add_trace(
            go.Scatter(
                x=x,
                y=steps[f"{col}_ms"],
                name=f"{col} ms",
                stackgroup="split",
                mode="lines",
                line={"width": 0.5, "color": _COLORS[col]},
            ),
            row=2,
            col=1,
        )


def _queue_and_kv(fig: go.Figure, steps: pd.DataFrame) -> None:
    """The engine chart's rows 3 and 4: requests running vs waiting, and the KV blocks (used,
    cached, free) stacked."""
    x = steps["time"]
    for col, color in (("running", "#1f77b4"), ("waiting", "#d62728")):
        fig.add_trace(
            go.Scatter(x=x, y=steps[col], name=col, mode="lines", line={"color": color}),
            row=3,
            col=1,
        )
    for col, color in (("kv_used", "#1f77b4"), ("kv_cached", "#2ca02c"), ("kv_free", "#bbbbbb")):
        fig.add_trace(
            go.Scatter(
                x=x,
                y=steps[col],
                name=col.replace("kv_", "KV ") + " blocks",
                stackgroup="kv",
                mode="lines",
                line={"width": 0.5, "color": color},
            ),
            row=4,
            col=1,
        )


def _preemptions_and_hits(fig: go.Figure, steps: pd.DataFrame, hits: pd.DataFrame) -> None:
    """The engine chart's row 5: preemptions, with the prefix-cache hit rate on its right axis."""
    x = steps["time"]
    fig.add_trace(
        go.Bar(x=x, y=steps["preempted"], name="preemptions", marker_color="#d62728"),
        row=5,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=hits["time"],
            y=hits["prefix_hit_rate"],
            name="prefix-cache hit rate",
            mode="lines+markers",
            marker={"size": 4},
            line={"color": "#2ca02c"},
        ),
        row=5,
        col=1,
        secondary_y=True,
    )


def fmt_peak(x: float) -> str:
    """A peak figure for a label: thousands separated from 100 up (``4,800``), else 3 digits."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def roofline(steps: pd.DataFrame, peaks: dict, per_step: bool) -> go.Figure:
    """Engine steps on a log-log roofline: x = arithmetic intensity (FLOP/byte), y = achieved
    GFLOP/s over the forward; prefill-containing and decode-only steps in their own colours.
    With the device's peaks (``data.device_peaks``): the bandwidth ceiling ``y = peak GB/s × x``
    up to the ridge point, the compute ceiling ``y = peak GFLOP/s`` from it, and the ridge
    point (FLOP/byte) marked; with int8 compute on, its own ceiling (the bandwidth line on to
    the int8 ridge, then the int8 GEMM peak)."""
    fig = go.Figure()
    what = "step" if per_step else "bucket"
    for kind, label in (("prefill", "prefill-containing steps"), ("decode", "decode-only steps")):
        d = steps[steps["kind"] == kind]
        fig.add_trace(
            go.Scatter(
                x=d["arith_intensity"],
                y=d["achieved_gflops"],
                name=label,
                mode="markers",
                marker={"color": _COLORS[kind], "size": 6, "opacity": 0.6},
                customdata=d[["achieved_gbps", "steps"]],
                hovertemplate=(
                    f"{kind} {what}<br>%{{x:.3g}} FLOP/byte<br>%{{y:.4g}} GFLOP/s"
                    "<br>%{customdata[0]:.4g} GB/s<br>%{customdata[1]} step(s)<extra></extra>"
                ),
            )
        )
    gbps, gflops, ridge = peaks.get("peak_gbps"), peaks.get("peak_gflops"), peaks.get("ridge")
    if ridge:
        xs = [x for x in steps["arith_intensity"].dropna() if x > 0]
        lo = min([*xs, ridge]) / 4
        hi = max([*xs, ridge]) * 4
        sources = {peaks.get("peak_gbps_source"), peaks.get("peak_gflops_source")}
        src = ", ".join(sorted(str(s) for s in sources if s))
        fig.add_trace(
            go.Scatter(
                x=[lo, ridge],
                y=[gbps * lo, gflops],
                name=f"bandwidth ceiling {fmt_peak(gbps)} GB/s",
                mode="lines",
                line={"color": "#444444", "width": 2},
            )
        )
        fig.add_trace(
            go.Scatter(
                x=[ridge, hi],
                y=[gflops, gflops],
                name=f"compute ceiling {fmt_peak(gflops)} GFLOP/s",
                mode="lines",
                line={"color": "#444444", "width": 2, "dash": "dash"},
            )
        )
        fig.add_trace(
            go.Scatter(
                x=[ridge],
                y=[gflops],
                name=f"ridge point {fmt_peak(ridge)} FLOP/byte",
                mode="markers+text",
                marker={"color": "#d62728", "size": 10, "symbol": "diamond"},
                text=[f"ridge {fmt_peak(ridge)} FLOP/byte"],
                textposition="bottom right",
            )
        )
        _int8_ceiling(fig, peaks, hi)
        title = f"Roofline ({peaks.get('device_name') or 'device'}; peaks: {src})"
    else:
        title = "Roofline (no device peaks recorded: steps only)"
    fig.update_xaxes(type="log", title_text="arithmetic intensity (FLOP/byte)")
    fig.update_yaxes(type="log", title_text="achieved GFLOP/s")
    fig = _layout(fig, 450, title)
    fig.update_layout(hovermode="closest")
    return fig


def _int8_ceiling(fig: go.Figure, peaks: dict, hi: float) -> None:
    """int8 compute's ceiling on the roofline, where the peaks have one: the bandwidth roof on
    from the float ridge to the int8 ridge, then the int8 GEMM peak."""
    int8, int8_ridge = peaks.get("peak_int8_gops"), peaks.get("int8_ridge")
    if not (int8 and int8_ridge):
        return
    ridge, gbps = peaks["ridge"], peaks["peak_gbps"]
    fig.add_trace(
        go.Scatter(
            x=[ridge, int8_ridge, max(hi, int8_ridge * 4)],
            y=[gbps * ridge, int8, int8],
            name=f"int8 compute ceiling {fmt_peak(int8)} GOP/s "
            f"(ridge {fmt_peak(int8_ridge)} op/byte)",
            mode="lines",
            line={"color": "#9467bd", "width": 2, "dash": "dot"},
        )
    )


def step_field(df: pd.DataFrame, field: str, per_step: bool) -> go.Figure:
    """One engine-step field over time (per step, or the bucket mean); the unit is in its name."""
    fig = go.Figure(
        go.Scatter(
            x=df["time"],
            y=df["value"],
            name=field,
            mode="markers" if per_step else "lines",
            marker={"size": 4},
        )
    )
    fig.update_yaxes(title_text=field)
    return _layout(fig, 300, f"{field} per step" if per_step else f"{field}, mean per bucket")


def spec_decode(df: pd.DataFrame) -> go.Figure:
    """Speculative decoding over time (``data.spec_decode_series``): the acceptance rate
    (accepted / draft tokens per bucket) with the accepted tokens per draft, and output tokens
    per decode sequence in decode-only steps with drafts vs without."""
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.1,
        specs=[[{"secondary_y": True}], [{}]],
        subplot_titles=(
            "Draft acceptance rate (accepted / draft tokens)",
            "Output tokens per decode sequence per step",
        ),
    )
    x = df["time"]
    fig.add_trace(
        go.Scatter(
            x=x, y=df["spec_acceptance_rate"], name="acceptance rate", mode="lines+markers",
            marker={"size": 4}, line={"color": "#2ca02c"},
        ),
        row=1, col=1,
    )  # fmt: skip
    fig.add_trace(
        go.Scatter(
            x=x, y=df["spec_accepted_per_draft"], name="accepted tokens per draft",
            mode="lines", line={"color": "#9467bd", "dash": "dot"},
        ),
        row=1, col=1, secondary_y=True,
    )  # fmt: skip
    for col, name, color in (
        ("tokens_per_seq_draft_steps", "steps with drafts", "#ff7f0e"),
        ("tokens_per_seq_plain_steps", "steps without drafts", "#1f77b4"),
    ):
        fig.add_trace(
            go.Scatter(x=x, y=df[col], name=name, mode="lines+markers", marker={"size": 4},
                       line={"color": color}),
            row=2, col=1,
        )  # fmt: skip
    fig.update_yaxes(title_text="rate", range=[0, 1], tickformat=".0%", row=1, col=1)
    fig.update_yaxes(
        title_text="tokens / draft", row=1, col=1, secondary_y=True, rangemode="tozero"
    )
    fig.update_yaxes(title_text="tokens", rangemode="tozero", row=2, col=1)
    return _layout(fig, 520)


def parallelism(coll: pd.DataFrame, replicas: pd.DataFrame) -> go.Figure:
    """Parallelism over time, side by side: the collectives' share of the forward in decode-only
    and prefill steps (``data.collective_series``; tensor parallelism) and each replica's mean
    running and waiting requests (``data.replica_series``; data parallelism). A side without
    data says so in its title."""
    fig = make_subplots(
        rows=1,
        cols=2,
        horizontal_spacing=0.08,
        subplot_titles=(
            "Collectives' share of the forward" if not coll.empty else "No collectives (one rank)",
            "Requests per replica" if not replicas.empty else "One replica",
        ),
    )
    for col, name, color in (
        ("decode_share", "decode steps", "#d62728"),
        ("prefill_share", "prefill steps", "#1f77b4"),
    ):
        if not coll.empty:
            fig.add_trace(
                go.Scatter(
                    x=coll["time"], y=coll[col], name=f"collectives: {name}",
                    mode="lines+markers", marker={"size": 4}, line={"color": color},
                ),
                row=1, col=1,
            )  # fmt: skip
    palette = ("#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
    for i, (replica, d) in enumerate(replicas.groupby("replica")):
        color = palette[i % len(palette)]
        fig.add_trace(
            go.Scatter(
                x=d["time"], y=d["running"], name=f"replica {replica} running", mode="lines",
                line={"color": color},
            ),
            row=1, col=2,
        )  # fmt: skip
        fig.add_trace(
            go.Scatter(
                x=d["time"], y=d["waiting"], name=f"replica {replica} waiting", mode="lines",
                line={"color": color, "dash": "dot"},
            ),
            row=1, col=2,
        )  # fmt: skip
    fig.update_yaxes(title_text="share of forward", tickformat=".0%", range=[0, 1], row=1, col=1)
    fig.update_yaxes(title_text="requests", rangemode="tozero", row=1, col=2)
    return _layout(fig, 320, "Parallelism")


def pd_pools(pools: pd.DataFrame) -> go.Figure:
    """Prefill/decode disaggregation's two pools side by side (``data.pd_pool_series``), a
    column per side (prefill left) over one time axis: requests waiting (solid), running
    (dotted) and, on the decode side, hand-offs held for room (dashed); the share of wall time
    in working steps; the share of KV blocks in use."""
    roles = [r for r in ("prefill", "decode") if r in set(pools["role"])]
    roles += sorted(r for r in set(pools["role"]) if r not in roles)
    fig = make_subplots(
        rows=3,
        cols=len(roles),
        shared_xaxes=True,
        shared_yaxes="rows",
        vertical_spacing=0.08,
        horizontal_spacing=0.06,
        subplot_titles=[
            f"{role}: {what}"
            for what in (
                "requests waiting / running",
                "busy (share of wall time)",
                "KV blocks used",
            )
            for role in roles
        ],
    )
    for col, role in enumerate(roles, start=1):
        d = pools[pools["role"] == role]
        color = _COLORS.get(role, "#2ca02c")
        for row, y, name, dash in (
            (1, "waiting", "waiting", "solid"),
            (1, "running", "running", "dot"),
            (1, "held", "hand-offs held", "dash"),
            (2, "busy", "busy", "solid"),
            (3, "kv_use", "KV use", "solid"),
        ):
            if d[y].isna().all():
                continue
            fig.add_trace(
                go.Scatter(
                    x=d["time"], y=d[y], name=f"{role} {name}", mode="lines",
                    line={"color": color, "dash": dash},
                ),
                row=row, col=col,
            )  # fmt: skip
        fig.update_yaxes(rangemode="tozero", row=1, col=col)
        for row in (2, 3):
            fig.update_yaxes(range=[0, 1], tickformat=".0%", row=row, col=col)
    fig.update_yaxes(title_text="requests", row=1, col=1)
    fig.update_yaxes(title_text="busy", row=2, col=1)
    fig.update_yaxes(title_text="KV used", row=3, col=1)
    return _layout(fig, 560, "Prefill and decode pools")


def spec_by_position(df: pd.DataFrame) -> go.Figure:
    """Acceptance by draft position (``data.spec_acceptance_by_position``): the share of drafts
    whose token at that position was accepted (position 0 = the first draft token)."""
    fig = go.Figure(
        go.Bar(
            x=df["position"], y=df["rate"], name="accepted share", marker_color="#2ca02c",
            customdata=df[["accepted"]],
            hovertemplate="position %{x}<br>%{y:.1%} of drafts<br>%{customdata[0]:,.0f} "
            "tokens accepted<extra></extra>",
        )
    )  # fmt: skip
    fig.update_xaxes(title_text="draft position (0 = first draft token)", dtick=1)
    fig.update_yaxes(title_text="share of drafts accepted", range=[0, 1], tickformat=".0%")
    return _layout(fig, 300, "Acceptance by draft position")


def _throttle_band(fig, d: pd.DataFrame, top: float, row: int, first: bool) -> None:
    fig.add_trace(
        go.Scatter(
            x=d["time"],
            y=[top if t else 0 for t in d["throttled"].fillna(False)],
            name="throttled (power/thermal)",
            mode="none",
            fill="tozeroy",
            fillcolor=_THROTTLE,
            line_shape="hv",
            text=d["reasons"],
            hovertemplate="reasons: %{text}<extra></extra>",
            legendgroup="throttle",
            showlegend=first,
        ),
        row=row,
        col=1,
    )


def gpus(df: pd.DataFrame, energy: pd.DataFrame) -> go.Figure:
    """Per GPU over time: power (W), energy per output token (J/token), SM and memory clocks
    (MHz) with throttling shaded, DRAM bandwidth and SM utilization (%), temperature (°C),
    memory used / total (GiB)."""
    fig = make_subplots(
        rows=6,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.04,
        subplot_titles=(
            "Power (W)",
            "Energy per output token (J/token, all GPUs)",
            "Clocks (MHz); red: throttled by power or heat",
            "DRAM bandwidth and SM utilization (%)",
            "Temperature (°C)",
            "Memory (GiB)",
        ),
    )
    top = float(df["sm_clock_mhz"].max() or 0) if not df.empty else 0.0
    for i, (dev, d) in enumerate(df.groupby("device_index", dropna=False)):
        name = f"GPU {dev}"
        fig.add_trace(go.Scatter(x=d["time"], y=d["power_w"], name=f"{name} power"), row=1, col=1)
        _throttle_band(fig, d, top, 3, i == 0)
        fig.add_trace(go.Scatter(x=d["time"], y=d["sm_clock_mhz"], name=f"{name} SM clock"), 3, 1)
        fig.add_trace(go.Scatter(x=d["time"], y=d["mem_clock_mhz"], name=f"{name} mem clock"), 3, 1)
        fig.add_trace(
            go.Scatter(x=d["time"], y=d["dram_bw_util_pct"], name=f"{name} DRAM bw %"), 4, 1
        )
        fig.add_trace(
            go.Scatter(
                x=d["time"], y=d["sm_util_pct"], name=f"{name} SM util %", line={"dash": "dot"}
            ),
            4,
            1,
        )
        fig.add_trace(go.Scatter(x=d["time"], y=d["temperature_c"], name=f"{name} °C"), 5, 1)
        fig.add_trace(go.Scatter(x=d["time"], y=d["mem_used_gib"], name=f"{name} used GiB"), 6, 1)
        fig.add_trace(
            go.Scatter(
                x=d["time"], y=d["mem_total_gib"], name=f"{name} total GiB", line={"dash": "dash"}
            ),
            6,
            1,
        )
    fig.add_trace(
        go.Scatter(x=energy["time"], y=energy["j_per_token"], name="J/token", mode="lines+markers"),
        row=2,
        col=1,
    )
    fig.update_yaxes(title_text="W", row=1, col=1)
    fig.update_yaxes(title_text="J/token", row=2, col=1)
    fig.update_yaxes(title_text="MHz", row=3, col=1)
    fig.update_yaxes(title_text="%", row=4, col=1, range=[0, 100])
    fig.update_yaxes(title_text="°C", row=5, col=1)
    fig.update_yaxes(title_text="GiB", row=6, col=1)
    return _layout(fig, 1300)


def host(df: pd.DataFrame) -> go.Figure:
    """Host rows (no GPU): CPU % of all cores, 1-minute load, server RSS and host memory (GiB)."""
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.07,
        subplot_titles=(
            "HOST CPU (% of all cores)",
            "HOST load average (1 min)",
            "HOST memory (GiB): server process RSS and machine",
        ),
    )
    fig.add_trace(go.Scatter(x=df["time"], y=df["cpu_pct"], name="host CPU %"), 1, 1)
    fig.add_trace(go.Scatter(x=df["time"], y=df["load_1m"], name="host load 1m"), 2, 1)
    fig.add_trace(go.Scatter(x=df["time"], y=df["rss_gib"], name="server RSS GiB"), 3, 1)
    fig.add_trace(go.Scatter(x=df["time"], y=df["mem_used_gib"], name="host used GiB"), 3, 1)
    fig.add_trace(
        go.Scatter(
            x=df["time"], y=df["mem_total_gib"], name="host total GiB", line={"dash": "dash"}
        ),
        3,
        1,
    )
    fig.update_yaxes(title_text="%", row=1, col=1)
    fig.update_yaxes(title_text="GiB", row=3, col=1)
    return _layout(fig, 700)


def errors(df: pd.DataFrame) -> go.Figure:
    """Errors per second by type over time (stacked bars, by request end)."""
    fig = go.Figure()
    for etype, d in df.groupby("error_type"):
        fig.add_trace(
            go.Bar(x=d["time"], y=d["rate_per_s"], name=str(etype), customdata=d["errors"],
                   hovertemplate="%{y:.3f}/s (%{customdata} errors)"),
        )  # fmt: skip
    fig.update_layout(barmode="stack", showlegend=True)
    fig.update_yaxes(title_text="errors / s")
    return _layout(fig, 380)


def evidence(windows: pd.DataFrame, series: list[str], start_ns, end_ns) -> go.Figure:
    """The diagnoser's per-window values of ``series`` (one row each, the baseline dashed) with
    the finding's window shaded."""
    fig = make_subplots(
        rows=len(series), cols=1, shared_xaxes=True, vertical_spacing=0.08, subplot_titles=series
    )
    for i, name in enumerate(series, 1):
        fig.add_trace(
            go.Scatter(x=windows["time"], y=windows[name], name=name, mode="lines+markers"), i, 1
        )
        base = f"{name}__baseline"
        if base in windows and windows[base].notna().any():
            fig.add_trace(
                go.Scatter(
                    x=windows["time"],
                    y=windows[base],
                    name=f"{name} baseline",
                    mode="lines",
                    line={"dash": "dash", "color": "#999"},
                ),
                i,
                1,
            )
    if start_ns is not None and end_ns is not None:
        fig.add_vrect(
            x0=pd.Timestamp(int(start_ns), unit="ns", tz="UTC"),
            x1=pd.Timestamp(int(end_ns), unit="ns", tz="UTC"),
            fillcolor=_THROTTLE,
            line_width=0,
            layer="below",
        )
    return _layout(fig, 180 + 170 * len(series))


_SIDES = {"BEFORE": "#7f7f7f", "AFTER": "#d62728"}


def compare_distributions(before: pd.DataFrame, after: pd.DataFrame, metrics: list[str],
                          title: str) -> go.Figure:  # fmt: skip
    """BEFORE and AFTER overlaid: one box per side for each of ``metrics`` (rows of
    ``data.latency_samples``: ``metric``, ``ms``), on a log ms axis (a station of 0.05 ms and
    one of 20 s in one chart)."""
    fig = go.Figure()
    for side, df in (("BEFORE", before), ("AFTER", after)):
        d = df[df["metric"].isin(metrics)]
        fig.add_trace(
            go.Box(
                x=d["metric"],
                y=d["ms"].clip(lower=1e-3),
                name=side,
                marker_color=_SIDES[side],
                boxpoints="outliers",
            )
        )
    fig.update_xaxes(categoryorder="array", categoryarray=metrics)
    fig.update_yaxes(type="log", title_text="ms (log)")
    fig = _layout(fig, 420, title).update_layout(boxmode="group", hovermode="closest")
    return fig.update_layout(legend={"y": -0.14})  # below the station names


def whatif_curve(df: pd.DataFrame, knee: float | None) -> go.Figure:
    """Predicted goodput (share of requests within the SLO, left axis) and TTFT/ITL p99 (ms,
    right axis, log) against the arrival rate (requests/s), from ``tokenmill plan``'s replays;
    the recorded rate and the knee (the last rate before goodput falls below 90% of its best)
    marked."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(
        go.Scatter(
            x=df["rate_per_s"],
            y=df["goodput_share"] * 100,
            name="goodput (% of requests within the SLO)",
            mode="lines+markers",
            line={"color": "#2ca02c", "width": 3},
        )
    )
    for key, label, color in (
        ("ttft_p99_ms", "TTFT p99", _COLORS["p99"]),
        ("itl_p99_ms", "ITL p99", _COLORS["p50"]),
    ):
        fig.add_trace(
            go.Scatter(
                x=df["rate_per_s"],
                y=df[key],
                name=f"{label} (ms)",
                mode="lines+markers",
                line={"color": color, "dash": "dot"},
            ),
            secondary_y=True,
        )
    recorded = df.loc[df["factor"] == 1.0, "rate_per_s"]
    if len(recorded):
        fig.add_vline(x=float(recorded.iloc[0]), line={"color": "#7f7f7f", "dash": "dash"},
                      annotation_text="recorded")  # fmt: skip
    if knee is not None:
        fig.add_vline(x=knee, line={"color": "#d62728"}, annotation_text="knee")
    fig.update_xaxes(title_text="arrival rate (requests/s)")
    fig.update_yaxes(title_text="goodput (%)", range=[0, 105], secondary_y=False)
    fig.update_yaxes(title_text="ms (p99)", type="log", secondary_y=True)
    return _layout(fig, 420)


def capacity_curve(doc: dict) -> go.Figure:
    """``tokenmill plan --capacity``'s replays as :func:`whatif_curve` draws them, with the
    highest rate that meets the SLO marked and its band (steps off by the fit's typical error)
    shaded."""
    df = pd.DataFrame(doc["curve"])
    fig = whatif_curve(df, doc.get("knee_rate_per_s"))
    lo, hi = doc["band_rate_per_s"]
    if lo is not None and hi is not None and hi > lo:
        fig.add_vrect(x0=lo, x1=hi, fillcolor="#1f77b4", opacity=0.12, line_width=0)
    fig.add_vline(x=doc["capacity_rate_per_s"], line={"color": "#1f77b4", "width": 3},
                  annotation_text="capacity")  # fmt: skip
    return fig


#: a finding's segment colour, by severity (``diagnose/findings.py``)
SEVERITY_COLORS = {"critical": "#d62728", "warning": "#ff7f0e"}
FINDINGS_ROW = "findings"


def _ts(ns) -> pd.Timestamp:
    return pd.Timestamp(int(ns), unit="ns", tz="UTC")


def _finding_segments(fig: go.Figure, spans: pd.DataFrame, now_ns: int) -> None:
    """One thick segment per finding on row 1, at its rule's row: opened (circle) to resolved
    (square) or to now (an arrow: still open), coloured by severity."""
    shown: set[str] = set()
    for f in spans.itertuples(index=False):
        is_open = f.status == "open"
        sev = f.severity if f.severity in SEVERITY_COLORS else "warning"
        hover = (
            f"<b>{f.rule}</b> ({f.severity}, {'open' if is_open else 'resolved'})<br>{f.title}"
            f"<br>opened {_ts(f.start_ns):%H:%M:%S}, "
            + ("still open" if is_open else f"resolved {_ts(f.end_ns):%H:%M:%S}")
            + f" ({f.duration_s:,.0f} s)<extra></extra>"
        )
        fig.add_trace(
            go.Scatter(
                x=[_ts(f.start_ns), _ts(min(f.end_ns, now_ns) if is_open else f.end_ns)],
                y=[f.rule, f.rule],
                mode="lines+markers",
                line={"color": SEVERITY_COLORS[sev], "width": 12},
                marker={"size": 13, "color": SEVERITY_COLORS[sev],
                        "symbol": ["circle", "triangle-right" if is_open else "square"]},
                name=sev,
                legendgroup=f"sev-{sev}",
                showlegend=sev not in shown,
                hovertemplate=hover,
                meta={"finding_id": f.finding_id, "status": f.status},
            ),
            row=1,
            col=1,
        )  # fmt: skip
        shown.add(sev)


def findings_timeline(
    spans: pd.DataFrame, series: pd.DataFrame, since_ns: int, until_ns: int
) -> go.Figure:
    """The Now page's timeline over ``[since_ns, until_ns]``: the findings (``spans``:
    ``data.findings_spans``) as one segment each on its rule's row, above TTFT p50/p99, ITL
    p50/p99 and the queue (queue time p50/p99 in ms, the mean of waiting requests shaded on a
    right-hand axis) from ``data.now_series``, on one shared time axis."""
    rules = list(dict.fromkeys(spans["rule"])) if not spans.empty else []
    top = max(0.14, min(0.4, 0.06 * (len(rules) + 1)))
    fig = make_subplots(
        rows=4,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.06,
        row_heights=[top, (1 - top) / 3, (1 - top) / 3, (1 - top) / 3],
        specs=[[{}], [{}], [{}], [{"secondary_y": True}]],
        subplot_titles=(
            "Findings (opened → resolved, or still open)",
            "TTFT (by arrival)",
            "ITL (per-request p50 / p99)",
            "Queue",
        ),
    )
    _finding_segments(fig, spans, until_ns)
    if not rules:  # an empty row keeps its place (and says so)
        fig.add_annotation(text="no finding in this span", showarrow=False, xref="x domain",
                           yref="y domain", x=0.5, y=0.5, row=1, col=1)  # fmt: skip
    for row, metric in ((2, "ttft"), (3, "itl")):
        for q in ("p50", "p99"):
            fig.add_trace(
                go.Scatter(x=series["time"], y=series[f"{metric}_{q}_ms"],
                           name=f"{metric.upper()} {q}", mode="lines+markers",
                           marker={"size": 4}, line={"color": _COLORS[q]}),
                row=row, col=1,
            )  # fmt: skip
        fig.update_yaxes(title_text=f"{metric.upper()} ms", row=row, col=1)
    fig.add_trace(
        go.Scatter(x=series["time"], y=series["waiting_mean"], name="waiting (mean)",
                   fill="tozeroy", mode="none", fillcolor=_CONC, connectgaps=False),
        row=4, col=1, secondary_y=True,
    )  # fmt: skip
    for q in ("p50", "p99"):
        fig.add_trace(
            go.Scatter(x=series["time"], y=series[f"queue_{q}_ms"], name=f"queue {q}",
                       mode="lines+markers", marker={"size": 4},
                       line={"color": _COLORS[q], "dash": "dot"}),
            row=4, col=1, secondary_y=False,
        )  # fmt: skip
    fig.update_yaxes(title_text="queue ms", row=4, col=1, secondary_y=False)
    fig.update_yaxes(title_text="waiting", row=4, col=1, secondary_y=True, showgrid=False,
                     rangemode="tozero")  # fmt: skip
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=rules[::-1],
                     row=1, col=1, showgrid=False)  # fmt: skip
    pad = (until_ns - since_ns) // 100  # room for a still-open finding's arrow at now
    fig.update_xaxes(range=[_ts(since_ns), _ts(until_ns + pad)])
    fig = _layout(fig, 760 + 24 * len(rules))
    fig.update_layout(hovermode="closest")
    return fig
