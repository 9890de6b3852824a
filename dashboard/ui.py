"""Streamlit glue shared by every page: the source, the sidebar (time window, SLOs), cached
queries and number formatting.

The sidebar is drawn once per run by ``app.py`` (before the page), so its widgets and their
values in ``st.session_state`` are shared by all pages: ``tm_window`` (preset), ``tm_custom``
(a custom range), ``tm_slo_*`` (SLOs in ms); each run also leaves the chosen window in
``tm_since_ns`` / ``tm_until_ns``. "Last N minutes" counts back from the store's newest row, so
an old dump reads the same as a live one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

import pandas as pd
import streamlit as st

from . import data
from .fleet_source import ALL, FleetHandle, FleetSnapshot, is_fleet
from .source import Snapshot, SourceError, StoreHandle, from_env, telemetry_warning

NS = data.NS
PRESETS = {
    "All": None,
    "Last 1 min": 60,
    "Last 5 min": 300,
    "Last 15 min": 900,
    "Last 1 h": 3600,
    "Last 6 h": 6 * 3600,
    "Custom": None,
}


@dataclass
class Ctx:
    """What a page needs: the open store, the chosen window (ns, half-open) and settings."""

    con: object | None
    key: str
    since_ns: int
    until_ns: int
    store_range: tuple[int, int] | None
    bucket_s: float
    slo: data.GoodputSlo
    live: bool = False
    # a fleet with "all" picked: (name, dump path, connection, snapshot key) per source
    sources: list[tuple[str, str, object, str]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.store_range is None

    @property
    def window(self) -> tuple[int, int]:
        return self.since_ns, self.until_ns


@st.cache_resource(show_spinner=False)
def _handle(spec: str, api_key: str | None, refresh_s: float) -> StoreHandle | FleetHandle:
    if is_fleet(spec):
        return FleetHandle(spec)
    return StoreHandle(spec, api_key=api_key, refresh_s=refresh_s)


@st.cache_data(max_entries=512, show_spinner=False)
def _cached(_con, key: str, name: str, args: tuple, kwargs: tuple):
    return getattr(data, name)(_con, *args, **dict(kwargs))


def q(ctx: Ctx, name: str, *args, **kwargs):
    """``data.<name>(con, *args, **kwargs)``, cached per store snapshot and arguments."""
    return _cached(ctx.con, ctx.key, name, args, tuple(sorted(kwargs.items())))


def _dt(ns: int) -> datetime:
    """Naive UTC datetime (the slider's values), whole seconds."""
    return datetime.fromtimestamp(ns // NS, tz=UTC).replace(tzinfo=None)


def _ns(dt: datetime) -> int:
    return int(dt.replace(tzinfo=UTC).timestamp()) * NS


def ts(ns: int | None) -> str:
    if ns is None:
        return "?"
    return datetime.fromtimestamp(ns / NS, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def sidebar() -> Ctx | None:
    """Draw the shared sidebar and return the page context (None: the source is unreadable,
    the reason is shown)."""
    spec, api_key, refresh_s = from_env()
    with st.sidebar:
        st.markdown("### tokenmill console")
        if not spec:
            st.error("No source: start with `tokenmill dashboard --source DUMP|DB|URL`.")
            return None
        try:
            handle = _handle(spec, api_key, refresh_s)
            if handle.live and st.button("Refresh now", key="tm_refresh"):
                snap = handle.snapshot(force=True)
            elif isinstance(handle, FleetHandle):
                snap = _fleet_pick(handle)
            else:
                snap = handle.snapshot()
        except SourceError as exc:
            st.error(f"Cannot read the source: {exc}")
            return None
        _source_caption(snap, handle)
        warning = telemetry_warning(getattr(handle, "telemetry", None))
        if warning:
            st.warning(warning)
        con = snap.cursor() if isinstance(snap, FleetSnapshot) else snap.con.cursor()
        engine = _cached(con, snap.key, "engine_seen", (), ())
        if engine:
            st.caption(
                f"Engine: **{engine}**, seen from outside (its spans and scraped metrics): the "
                "pages show what it exposes; per-step and device views stay empty."
            )
        ctx = _window(con, snap)
        ctx.live = handle.live
        if isinstance(snap, FleetSnapshot) and snap.schema is None:
            ctx.sources = _fleet_sources(handle)
        if handle.live:
            _poll(handle, snap.key, refresh_s)
    st.session_state["tm_since_ns"] = ctx.since_ns
    st.session_state["tm_until_ns"] = ctx.until_ns
    return ctx


def _fleet_pick(handle: FleetHandle) -> FleetSnapshot:
    """The sidebar's source selector of a fleet: one replica, or all (``tm_source``)."""
    names = [m.name for m in handle.members]
    choice = st.selectbox(
        "Source",
        [ALL, *names],
        format_func=lambda n: f"All {len(names)} sources" if n == ALL else n,
        key="tm_source",
        help="One replica's dump, or the union of all (tables gain a `source` column; the "
        "Diagnosis page diagnoses each source on its own).",
    )
    return handle.snapshot(choice)


def _fleet_sources(handle: FleetHandle) -> list[tuple[str, str, object, str]]:
    out = []
    for m in handle.members:
        snap = handle.snapshot(m.name)
        out.append((m.name, m.path, snap.cursor(), snap.key))
    return out


def for_source(ctx: Ctx, name: str) -> Ctx:
    """The context of one source of a fleet ("all" picked); ``ctx`` itself otherwise."""
    for n, _, con, key in ctx.sources:
        if n == name:
            return replace(ctx, con=con, key=key, sources=[])
    return ctx


def fleet_diagnosis(ctx: Ctx, since_ns: int, until_ns: int, window_s: float):
    """``data.diagnosis`` of each source of a fleet on its own, merged
    (:func:`tokenmill.diagnose.fleet.merge`: findings name their source); None when no source
    had requests in the window. A single source: ``data.diagnosis`` as it is."""
    if not ctx.sources:
        return q(ctx, "diagnosis", since_ns, until_ns, window_s)
    from tokenmill.diagnose.fleet import merge

    named = []
    for name, path, _, _ in ctx.sources:
        report = q(for_source(ctx, name), "diagnosis", since_ns, until_ns, window_s)
        if report is not None:
            named.append((name, path, report))
    return merge(named) if named else None


def where(report, f) -> str:
    """``" on SOURCE"`` for a finding of a fleet's report (two or more sources), else ``""``."""
    if len(report.sources) < 2 or not f.source:
        return ""
    wide = " (fleet-wide)" if f.rule_id in report.fleet_wide else ""
    return f" on {f.source}{wide}"


def fleet_table(report) -> pd.DataFrame:
    """One row per source of a fleet's report: its name, status, rules fired, requests."""
    return pd.DataFrame(
        [
            {
                "source": s["name"],
                "status": s["status"].replace("_", " "),
                "rules fired": ", ".join(s["rules_fired"]) or "—",
                "requests": s["summary"].get("requests"),
                "dump": s["dump"],
            }
            for s in report.sources
        ]
    )


def _source_caption(snap: Snapshot, handle: StoreHandle) -> None:
    if handle.live:
        age = time.time() - snap.fetched_at
        st.caption(
            f"Live: `{snap.label}` — dump fetched {age:.0f} s ago (every {handle.refresh_s:g} s)"
        )
        if snap.error:
            st.warning(f"Last refresh failed, showing older rows: {snap.error}")
    else:
        st.caption(f"File: `{snap.label}`")


def _poll(handle: StoreHandle, key: str, refresh_s: float) -> None:
    """Rerun the app when a newer dump has been fetched (live sources)."""

    @st.fragment(run_every=max(1.0, refresh_s))
    def poll():
        if handle.snapshot().key != key:
            st.rerun()

    poll()


def _window(con, snap: Snapshot) -> Ctx:
    rng = _cached(con, snap.key, "time_range", (), ())
    choice = st.selectbox("Time window", list(PRESETS), key="tm_window")
    with st.expander("SLOs (goodput)", expanded=False):
        slo = data.GoodputSlo(
            ttft_ms=st.number_input("TTFT ≤ ms", 1.0, value=2000.0, step=100.0, key="tm_slo_ttft"),
            itl_ms=st.number_input("ITL p99 ≤ ms", 1.0, value=200.0, step=10.0, key="tm_slo_itl"),
            e2e_ms=st.number_input("E2E ≤ ms", 1.0, value=60000.0, step=1000.0, key="tm_slo_e2e"),
        )
    if rng is None:
        st.caption("The store holds no rows yet.")
        now = time.time_ns()
        return Ctx(con, snap.key, now - 60 * NS, now, None, 1.0, slo)
    lo, hi = rng
    since, until = lo, hi
    if PRESETS.get(choice):
        since = max(lo, hi - PRESETS[choice] * NS)
    elif choice == "Custom":
        a, b = _dt(lo), _dt(hi) + timedelta(seconds=1)
        if b - a >= timedelta(seconds=2):
            picked = st.slider(
                "Range (UTC)",
                min_value=a,
                max_value=b,
                value=(a, b),
                step=timedelta(seconds=1),
                format="HH:mm:ss",
                key="tm_custom",
            )
            since = max(lo, _ns(picked[0]))
            until = min(hi, _ns(picked[1]))
            if until <= since:
                until = since + NS
        else:
            st.caption("The store spans under 2 s: showing all of it.")
    bucket_s = data.pick_bucket_s(since, until)
    st.caption(
        f"{ts(since)} → {ts(until)}  \n{(until - since) / NS:,.0f} s, buckets of {bucket_s:g} s"
    )
    return Ctx(con, snap.key, since, until, rng, bucket_s, slo)


def context() -> Ctx | None:
    """The context ``app.py`` built for this run (``app.py`` stores it before the page runs)."""
    return st.session_state.get("tm_ctx")


def begin(title: str) -> Ctx | None:
    """Page header; returns the context, or None after saying why there is nothing to show."""
    st.header(title)
    ctx = context()
    if ctx is None:
        st.info("No data: the source could not be read (see the sidebar).")
        return None
    if ctx.empty:
        st.info("No data: the store holds no requests, steps or samples yet.")
        return None
    return ctx


# ----- formatting (tiles and tables) -----


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA


def fmt_ms(v) -> str:
    """A latency: "123.4 ms" below a second, "12.35 s" from there (tiles stay narrow)."""
    if _missing(v):
        return "—"
    return f"{v:,.1f} ms" if abs(v) < 1000 else f"{v / 1000:,.2f} s"


def fmt_pct(v) -> str:
    return "—" if _missing(v) else f"{100 * v:.1f} %"


def fmt_num(v, unit: str = "", digits: int = 1) -> str:
    if _missing(v):
        return "—"
    return f"{v:,.{digits}f}{' ' + unit if unit else ''}"


def chart(fig, key: str) -> None:
    """A plotly figure across the page width."""
    st.plotly_chart(fig, width="stretch", key=key)


def trace_links(trace_ids) -> None:
    """Each trace id as a link to the Requests page opened on it (``?trace=<id>``: its
    waterfall); "none" when there is none."""
    if not trace_ids:
        st.markdown("none")
        return
    for t in trace_ids:
        st.page_link(
            "views/requests.py",
            label=f"`{t}`",
            icon=":material/waterfall_chart:",
            query_params={"trace": t},
            help="Open this request's waterfall on the Requests page",
        )
