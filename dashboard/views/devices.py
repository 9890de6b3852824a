"""Devices: per-GPU power, energy per output token, clocks with throttling shaded, DRAM
bandwidth and SM utilization, temperature, memory; the host's CPU and memory when the server
ran without a GPU (labelled as host)."""

import streamlit as st

from tokenmill.dashboard import charts, ui

ctx = ui.begin("Devices")
if ctx is not None:
    since, until = ctx.window
    dev = ui.q(ctx, "device_series", since, until)
    df = dev["df"]
    if dev["kind"] is None or df.empty:
        st.info("No data: no device samples in this window (was --device-sample-interval 0?).")
    elif dev["kind"] == "gpu":
        energy = ui.q(ctx, "energy_per_token", since, until, ctx.bucket_s)
        n = df["device_index"].nunique()
        c = st.columns(5)
        c[0].metric("GPUs", f"{n}", help=", ".join(sorted(set(df["device_name"].dropna()))))
        c[1].metric("Power mean", ui.fmt_num(df["power_w"].mean(), "W"))
        c[2].metric("Energy / output token", ui.fmt_num(energy["j_per_token"], "J/token", 3))
        c[3].metric("Throttled time", ui.fmt_pct(float(df["throttled"].fillna(False).mean())))
        c[4].metric("Temperature max", ui.fmt_num(df["temperature_c"].max(), "°C"))
        ui.chart(charts.gpus(df, energy["df"]), key="devices_gpu")
        st.caption(f"Samples averaged per {dev['bucket_s']:g} s per GPU.")
    else:
        st.warning(
            "HOST, not GPU: the server ran without a GPU (or NVML was unavailable), so these "
            "are the host machine's CPU and memory samples."
        )
        c = st.columns(4)
        c[0].metric(
            "Host",
            str(df["device_name"].dropna().iloc[0]) if df["device_name"].notna().any() else "—",
        )
        c[1].metric("Host CPU mean", ui.fmt_num(df["cpu_pct"].mean(), "%"))
        c[2].metric("Server RSS max", ui.fmt_num(df["rss_gib"].max(), "GiB", 2))
        c[3].metric("Host memory used max", ui.fmt_num(df["mem_used_gib"].max(), "GiB", 2))
        ui.chart(charts.host(df), key="devices_host")
        st.caption(f"Host samples averaged per {dev['bucket_s']:g} s. No power sensor: no J/token.")
