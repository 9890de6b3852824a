"""DeviceSampler: host rows on this machine, the NVML path through a fake pynvml module (two
devices, one with GPM), fallback to host mode, and a failing sink that does not stop sampling."""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import types

import duckdb
import psutil
import pynvml as real_nvml
import pytest

from tokenmill.telemetry import schema
from tokenmill.telemetry.sampler import COLUMNS, DeviceSampler


def _wait_until(pred, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def _store_rows(rows: list[dict]) -> list[dict]:
    """Insert rows into a fresh in-memory store's device_samples and read them back."""
    con = duckdb.connect(":memory:")
    schema.apply_schema(con)
    cols = list(COLUMNS)
    con.executemany(
        f"INSERT INTO device_samples ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
        [[r[c] for c in cols] for r in rows],
    )
    out = con.execute(
        f"SELECT {', '.join(cols)} FROM device_samples ORDER BY time_ns, device_index"
    )
    return [dict(zip(cols, t)) for t in out.fetchall()]


def _sleeping_child() -> subprocess.Popen:
    """A child Python process that has finished starting up (its RSS no longer grows)."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "ready"
    return child


class FakeNVMLError(Exception):
    def __init__(self, value: int = real_nvml.NVML_ERROR_NOT_SUPPORTED):
        super().__init__(f"fake NVML error {value}")
        self.value = value


class FakeNVML:
    """A stand-in for the pynvml module: 2 devices, device 0 with GPM, device 1 without.

    Constants and the ctypes GPM structures come from the real pynvml, so field names and ids
    the sampler uses must match the real module. ``fail`` holds (function name, device index)
    pairs that raise FakeNVMLError; it can be changed between ticks.
    """

    NVMLError = FakeNVMLError

    def __init__(self, *, devices: int = 2, init_raises: bool = False, dram_bw: float = 42.5):
        for name in dir(real_nvml):
            if name.startswith(("NVML_", "nvmlClocksEventReason", "nvmlClocksThrottleReason")):
                setattr(self, name, getattr(real_nvml, name))
        self.c_nvmlGpmMetricsGet_t = real_nvml.c_nvmlGpmMetricsGet_t
        self.devices = devices
        self.init_raises = init_raises
        self.dram_bw = dram_bw
        self.fail: set[tuple[str, int]] = set()
        self.shutdowns = 0
        self.energy_mj = {0: [1_000_000, 1_500_000, 1_750_000], 1: [20_000, 20_000, 23_000]}
        self.power_mw = {0: 350_000, 1: 75_500}
        self.event_reasons = {
            0: real_nvml.nvmlClocksEventReasonSwPowerCap
            | real_nvml.nvmlClocksEventReasonHwThermalSlowdown,
            1: None,  # the new call is missing on device 1: fall back to the throttle call
        }
        self.throttle_reasons = {0: 0, 1: real_nvml.nvmlClocksThrottleReasonGpuIdle}
        self._next_addr = 0x1000
        self._seq = 0
        self.gpm_samples: dict[int, tuple[int, int]] = {}  # address -> (device, seq)
        self.gpm_allocated: list[int] = []
        self.gpm_freed: list[int] = []
        self.gpm_last_seq: dict[int, int] = {}
        self.gpm_pairs: list[tuple[int, int, int]] = []  # (device, seq1, seq2) per MetricsGet

    def _idx(self, handle) -> int:
        assert isinstance(handle, str) and handle.startswith("handle-"), handle
        return int(handle.removeprefix("handle-"))

    def _check(self, fn: str, handle) -> int:
        i = self._idx(handle)
        if (fn, i) in self.fail:
            raise FakeNVMLError()
        return i

    # init / enumeration
    def nvmlInit(self):
        if self.init_raises:
            raise FakeNVMLError(real_nvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return self.devices

    def nvmlDeviceGetHandleByIndex(self, i):
        assert 0 <= i < self.devices
        return f"handle-{i}"

    def nvmlDeviceGetName(self, h):
        return ["NVIDIA H200", "NVIDIA A100-SXM4-80GB"][self._check("nvmlDeviceGetName", h)]

    # per-tick queries
    def nvmlDeviceGetPowerUsage(self, h):
        return self.power_mw[self._check("nvmlDeviceGetPowerUsage", h)]

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        seq = self.energy_mj[self._check("nvmlDeviceGetTotalEnergyConsumption", h)]
        return seq.pop(0) if len(seq) > 1 else seq[0]

    def nvmlDeviceGetUtilizationRates(self, h):
        i = self._check("nvmlDeviceGetUtilizationRates", h)
        return types.SimpleNamespace(gpu=[87, 3][i], memory=[41, 0][i])

    def nvmlDeviceGetMemoryInfo(self, h):
        i = self._check("nvmlDeviceGetMemoryInfo", h)
        total = [150_000_000_000, 85_000_000_000][i]
        used = [120_000_000_000, 1_000_000][i]
        return types.SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetClockInfo(self, h, clock_type):
        i = self._check("nvmlDeviceGetClockInfo", h)
        clocks = {
            real_nvml.NVML_CLOCK_SM: [1980, 210][i],
            real_nvml.NVML_CLOCK_MEM: [2619, 1593][i],
        }
        if clock_type not in clocks:
            raise FakeNVMLError(real_nvml.NVML_ERROR_INVALID_ARGUMENT)
        return clocks[clock_type]

    def nvmlDeviceGetTemperature(self, h, sensor):
        i = self._check("nvmlDeviceGetTemperature", h)
        if sensor != real_nvml.NVML_TEMPERATURE_GPU:
            raise FakeNVMLError(real_nvml.NVML_ERROR_INVALID_ARGUMENT)
        return [71, 33][i]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        mask = self.event_reasons[self._check("nvmlDeviceGetCurrentClocksEventReasons", h)]
        if mask is None:
            raise FakeNVMLError(real_nvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return mask

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return self.throttle_reasons[self._check("nvmlDeviceGetCurrentClocksThrottleReasons", h)]

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        # device 0: this process (the server) and one stranger; device 1: nothing
        i = self._check("nvmlDeviceGetComputeRunningProcesses", h)
        procs = [os.getpid(), 2**31 - 3] if i == 0 else []
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=1 << 30) for pid in procs]

    def nvmlDeviceGetPcieThroughput(self, h, counter):
        i = self._check("nvmlDeviceGetPcieThroughput", h)
        values = {
            real_nvml.NVML_PCIE_UTIL_RX_BYTES: [2000, 10][i],
            real_nvml.NVML_PCIE_UTIL_TX_BYTES: [500, 0][i],
        }
        if counter not in values:
            raise FakeNVMLError(real_nvml.NVML_ERROR_INVALID_ARGUMENT)
        return values[counter]

    # GPM
    def nvmlGpmQueryDeviceSupport(self, h):
        i = self._check("nvmlGpmQueryDeviceSupport", h)
        return types.SimpleNamespace(version=1, isSupportedDevice=1 if i == 0 else 0)

    def nvmlGpmSampleAlloc(self):
        addr, self._next_addr = self._next_addr, self._next_addr + 0x100
        self.gpm_allocated.append(addr)
        return ctypes.cast(ctypes.c_void_p(addr), real_nvml.c_nvmlGpmSample_t)

    def nvmlGpmSampleFree(self, sample):
        self.gpm_freed.append(ctypes.cast(sample, ctypes.c_void_p).value)

    def nvmlGpmSampleGet(self, h, sample):
        i = self._check("nvmlGpmSampleGet", h)
        assert i == 0, "GPM sample taken on a device without GPM support"
        addr = ctypes.cast(sample, ctypes.c_void_p).value
        assert addr in self.gpm_allocated
        self._seq += 1
        self.gpm_samples[addr] = (i, self._seq)
        self.gpm_last_seq[i] = self._seq
        return sample

    def nvmlGpmMetricsGet(self, mg):
        assert isinstance(mg, real_nvml.c_nvmlGpmMetricsGet_t)
        assert mg.version == real_nvml.NVML_GPM_METRICS_GET_VERSION
        assert mg.numMetrics == 1
        assert mg.metrics[0].metricId == real_nvml.NVML_GPM_METRIC_DRAM_BW_UTIL
        dev1, seq1 = self.gpm_samples[ctypes.cast(mg.sample1, ctypes.c_void_p).value]
        dev2, seq2 = self.gpm_samples[ctypes.cast(mg.sample2, ctypes.c_void_p).value]
        if ("nvmlGpmMetricsGet", dev2) in self.fail:
            raise FakeNVMLError()
        self.gpm_pairs.append((dev2, seq1, seq2))
        # Only the previous sample and the newest one of the same device give a value.
        ok = dev1 == dev2 and seq1 < seq2 == self.gpm_last_seq[dev2]
        mg.metrics[0].nvmlReturn = (
            real_nvml.NVML_SUCCESS if ok else real_nvml.NVML_ERROR_INVALID_ARGUMENT
        )
        mg.metrics[0].value = self.dram_bw if ok else 0.0
        return mg


def test_columns_are_the_schema_columns():
    con = duckdb.connect(":memory:")
    schema.apply_schema(con)
    assert list(COLUMNS) == schema.columns(con, "device_samples")


# ----------------------------------------------------------------------------- host mode


def test_host_row_on_this_machine():
    child = _sleeping_child()
    try:
        child_rss = psutil.Process(child.pid).memory_info().rss
        rows_seen: list[dict] = []
        # a pid that does not exist is skipped, not an error
        sampler = DeviceSampler(rows_seen.append, use_nvml=False, pids=lambda: [2**31 - 2])
        assert sampler.mode == "host"
        own_rss = psutil.Process().memory_info().rss
        t0 = time.time_ns()
        rows = sampler.sample_once()
        t1 = time.time_ns()
    finally:
        child.kill()
        child.communicate()
    assert len(rows) == 1
    row = rows[0]
    assert set(row) == set(COLUMNS)
    assert row["kind"] == "host"
    assert row["device_index"] is None
    assert row["device_name"] == socket.gethostname()
    assert t0 <= row["time_ns"] <= t1
    assert 0.0 <= row["cpu_pct"] <= 100.0 * psutil.cpu_count()
    assert row["rss_bytes"] >= own_rss > 0
    # the child process (like the engine core) is counted
    assert row["rss_bytes"] >= own_rss + child_rss // 2
    assert row["mem_total_bytes"] == psutil.virtual_memory().total
    assert 0 < row["mem_used_bytes"] <= row["mem_total_bytes"]
    assert row["load_1m"] is not None and row["load_1m"] >= 0.0
    for col in ("power_w", "energy_j", "gpu_util_pct", "dram_bw_util_pct", "clock_event_reasons"):
        assert row[col] is None
    assert sampler.last_error is None
    assert rows_seen == rows
    assert sampler.latest == rows
    stored = _store_rows(rows)
    assert stored[0]["kind"] == "host" and stored[0]["rss_bytes"] == row["rss_bytes"]


def test_host_pids_argument_counts_a_given_process():
    child = _sleeping_child()
    try:
        proc = psutil.Process(child.pid)
        child_rss = proc.memory_info().rss
        # children are found by themselves; listing the pid as well must not count it twice
        # (compared with a sampler given no pids: other children of a test run count in both)
        base = DeviceSampler(lambda r: None, use_nvml=False).sample_once()[0]["rss_bytes"]
        sampler = DeviceSampler(lambda r: None, use_nvml=False, pids=[child.pid, child.pid])
        rss = sampler.sample_once()[0]["rss_bytes"]
        own = psutil.Process().memory_info().rss
    finally:
        child.kill()
        child.communicate()
    assert abs(rss - base) < child_rss // 2
    assert rss >= own + child_rss // 2


def test_default_construction_without_gpu_is_host_mode():
    try:
        real_nvml.nvmlInit()
    except real_nvml.NVMLError:
        pass
    else:
        real_nvml.nvmlShutdown()
        pytest.skip("this machine has a working NVML")
    sampler = DeviceSampler(lambda r: None)
    assert sampler.mode == "host"
    assert "nvmlInit failed" in sampler.fallback_reason
    assert sampler.sample_once()[0]["kind"] == "host"


def test_started_sampler_delivers_rows_then_stops():
    rows: list[dict] = []
    lock = threading.Lock()

    def sink(row):
        with lock:
            rows.append(row)

    sampler = DeviceSampler(sink, interval_s=0.02, use_nvml=False)
    sampler.start()
    try:
        assert sampler.running
        assert _wait_until(lambda: len(rows) >= 3, timeout_s=10.0), len(rows)
    finally:
        sampler.stop()
    assert not sampler.running
    with lock:
        n = len(rows)
        times = [r["time_ns"] for r in rows]
    assert all(r["kind"] == "host" for r in rows)
    assert times == sorted(times) and len(set(times)) == len(times)
    assert sampler.latest and sampler.latest[0]["kind"] == "host"
    time.sleep(0.1)
    assert len(rows) == n  # nothing after stop()
    with pytest.raises(RuntimeError):
        sampler.start()


def test_interval_must_be_positive():
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            DeviceSampler(lambda r: None, interval_s=bad, use_nvml=False)


# ----------------------------------------------------------------------------- NVML path


def test_nvml_rows_from_fake_two_devices():
    fake = FakeNVML()
    sunk: list[dict] = []
    sampler = DeviceSampler(sunk.append, nvml=fake)
    assert sampler.mode == "gpu" and sampler.fallback_reason is None

    t0 = time.time_ns()
    first = sampler.sample_once()
    second = sampler.sample_once()
    t1 = time.time_ns()

    assert len(first) == 2 and len(second) == 2
    for rows in (first, second):
        assert [r["device_index"] for r in rows] == [0, 1]
        assert all(set(r) == set(COLUMNS) and r["kind"] == "gpu" for r in rows)
        assert rows[0]["time_ns"] == rows[1]["time_ns"]  # one timestamp per tick
        assert t0 <= rows[0]["time_ns"] <= t1
    assert first[0]["time_ns"] <= second[0]["time_ns"]

    d0, d1 = second
    assert (d0["device_name"], d1["device_name"]) == ("NVIDIA H200", "NVIDIA A100-SXM4-80GB")
    assert d0["power_w"] == 350.0 and d1["power_w"] == 75.5
    # energy since the sampler started: the first reading is the zero
    assert [first[0]["energy_j"], d0["energy_j"]] == [0.0, 500.0]
    assert [first[1]["energy_j"], d1["energy_j"]] == [0.0, 0.0]
    assert (d0["gpu_util_pct"], d0["mem_util_pct"]) == (87.0, 41.0)
    assert (d1["gpu_util_pct"], d1["mem_util_pct"]) == (3.0, 0.0)
    assert (d0["mem_used_bytes"], d0["mem_total_bytes"]) == (120_000_000_000, 150_000_000_000)
    assert (d0["sm_clock_mhz"], d0["mem_clock_mhz"]) == (1980, 2619)
    assert (d1["sm_clock_mhz"], d1["mem_clock_mhz"]) == (210, 1593)
    assert d0["temperature_c"] == 71.0
    assert d0["clock_event_reasons"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert d1["clock_event_reasons"] == ["gpu_idle"]  # via the throttle-reasons fallback
    assert (d0["pcie_rx_bytes_s"], d0["pcie_tx_bytes_s"]) == (2000 * 1024.0, 500 * 1024.0)
    assert (d1["pcie_rx_bytes_s"], d1["pcie_tx_bytes_s"]) == (10 * 1024.0, 0.0)
    # processes on the device that are not this server's (graphics list absent in the fake)
    assert (d0["other_processes"], d1["other_processes"]) == (1, 0)
    # GPM: nothing on the first tick (one sample), the value from two consecutive samples
    # afterwards; never on the device without GPM
    assert first[0]["dram_bw_util_pct"] is None and first[1]["dram_bw_util_pct"] is None
    assert d0["dram_bw_util_pct"] == 42.5
    assert d1["dram_bw_util_pct"] is None
    assert fake.gpm_pairs == [(0, 1, 2)]
    for r in (d0, d1):
        assert r["cpu_pct"] is None and r["rss_bytes"] is None and r["load_1m"] is None

    third = sampler.sample_once()
    assert third[0]["dram_bw_util_pct"] == 42.5 and third[0]["energy_j"] == 750.0
    assert third[1]["energy_j"] == 3.0
    assert fake.gpm_pairs[-1] == (0, 2, 3)

    assert sunk == first + second + third
    assert sampler.latest == third
    assert sampler.last_error is None

    stored = _store_rows(first + second + third)
    assert stored[2]["clock_event_reasons"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert stored[3]["dram_bw_util_pct"] is None and stored[2]["dram_bw_util_pct"] == 42.5

    sampler.stop()
    assert fake.shutdowns == 1
    assert sorted(fake.gpm_freed) == sorted(fake.gpm_allocated) and len(fake.gpm_allocated) == 2
    with pytest.raises(RuntimeError):
        sampler.sample_once()


@pytest.mark.parametrize(
    ("fn", "cols"),
    [
        ("nvmlDeviceGetPowerUsage", ["power_w"]),
        ("nvmlDeviceGetTotalEnergyConsumption", ["energy_j"]),
        ("nvmlDeviceGetUtilizationRates", ["gpu_util_pct", "mem_util_pct"]),
        ("nvmlDeviceGetMemoryInfo", ["mem_used_bytes", "mem_total_bytes"]),
        ("nvmlDeviceGetClockInfo", ["sm_clock_mhz", "mem_clock_mhz"]),
        ("nvmlDeviceGetTemperature", ["temperature_c"]),
        ("nvmlDeviceGetPcieThroughput", ["pcie_rx_bytes_s", "pcie_tx_bytes_s"]),
        ("nvmlGpmSampleGet", ["dram_bw_util_pct"]),
        ("nvmlGpmMetricsGet", ["dram_bw_util_pct"]),
    ],
)
def test_one_failing_query_nulls_only_its_columns(fn, cols):
    baseline_fake = FakeNVML()
    baseline = DeviceSampler(lambda r: None, nvml=baseline_fake)
    baseline.sample_once()
    good = baseline.sample_once()

    fake = FakeNVML()
    sampler = DeviceSampler(lambda r: None, nvml=fake)
    sampler.sample_once()
    fake.fail.add((fn, 0))
    rows = sampler.sample_once()
    assert sampler.last_error is None
    for col in COLUMNS:
        if col == "time_ns":
            continue
        if col in cols:
            assert rows[0][col] is None, col
            assert good[0][col] is not None, col
        else:
            assert rows[0][col] == good[0][col], col
    assert {k: v for k, v in rows[1].items() if k != "time_ns"} == {
        k: v for k, v in good[1].items() if k != "time_ns"
    }


def test_gpm_recovers_after_a_failed_sample():
    fake = FakeNVML(dram_bw=12.25)
    sampler = DeviceSampler(lambda r: None, nvml=fake)
    sampler.sample_once()
    assert sampler.sample_once()[0]["dram_bw_util_pct"] == 12.25
    fake.fail.add(("nvmlGpmSampleGet", 0))
    assert sampler.sample_once()[0]["dram_bw_util_pct"] is None
    fake.fail.clear()
    # one good sample again: no pair yet (the stale pre-failure sample is not used)
    assert sampler.sample_once()[0]["dram_bw_util_pct"] is None
    assert sampler.sample_once()[0]["dram_bw_util_pct"] == 12.25
    assert all(s1 + 1 == s2 for _, s1, s2 in fake.gpm_pairs)


def test_clock_event_reasons_decoding():
    decode = DeviceSampler.decode_reasons
    assert decode(0, real_nvml) == []
    all_bits = real_nvml.nvmlClocksEventReasonAll
    assert decode(all_bits, real_nvml) == [
        "gpu_idle",
        "applications_clocks_setting",
        "sw_power_cap",
        "hw_slowdown",
        "sync_boost",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
        "display_clocks_setting",
    ]
    assert decode(real_nvml.nvmlClocksThrottleReasonBoardLimit | 0x4, real_nvml) == [
        "sw_power_cap",
        "unknown_0x200",
    ]


# ----------------------------------------------------------------------------- fallbacks, errors


def test_nvml_init_failure_falls_back_to_host():
    fake = FakeNVML(init_raises=True)
    sampler = DeviceSampler(lambda r: None, nvml=fake)
    assert sampler.mode == "host"
    assert sampler.fallback_reason.startswith("nvmlInit failed")
    rows = sampler.sample_once()
    assert len(rows) == 1 and rows[0]["kind"] == "host"
    assert sampler.last_error is None
    sampler.stop()


def test_zero_devices_falls_back_to_host():
    fake = FakeNVML(devices=0)
    sampler = DeviceSampler(lambda r: None, nvml=fake)
    assert sampler.mode == "host"
    assert sampler.fallback_reason == "NVML sees 0 devices"
    assert fake.shutdowns == 1
    assert sampler.sample_once()[0]["kind"] == "host"


def test_raising_sink_does_not_kill_the_thread(caplog):
    calls = []

    def sink(row):
        calls.append(row)
        raise RuntimeError("store is\ngone")

    sampler = DeviceSampler(sink, interval_s=0.02, use_nvml=False)
    with caplog.at_level(logging.WARNING, logger="tokenmill.telemetry.sampler"):
        sampler.start()
        try:
            assert _wait_until(lambda: len(calls) >= 3, timeout_s=10.0), len(calls)
            assert sampler.running
        finally:
            sampler.stop()
    assert sampler.last_error == "sink: RuntimeError: store is gone"
    assert sampler.errors_total >= 3
    assert len(sampler.latest) == 1  # rows are still kept for the Prometheus layer
    logged = [r for r in caplog.records if "store is gone" in r.getMessage()]
    assert len(logged) == 1  # logged once, not once per tick


def test_exception_inside_a_tick_is_caught_and_sampling_continues():
    fake = FakeNVML()
    sunk = []
    sampler = DeviceSampler(sunk.append, interval_s=0.02, nvml=fake)

    def broken(h):
        raise ZeroDivisionError("driver returned garbage")

    fake.nvmlDeviceGetPowerUsage = broken  # not an NVMLError: the whole tick fails
    assert sampler.sample_once() == []
    assert sampler.last_error == "tick: ZeroDivisionError: driver returned garbage"
    sampler.start()
    try:
        assert _wait_until(lambda: sampler.ticks >= 4, timeout_s=10.0)
        assert sampler.running and sunk == []
        del fake.nvmlDeviceGetPowerUsage  # healthy again: rows flow
        assert _wait_until(lambda: len(sunk) >= 2, timeout_s=10.0)
    finally:
        sampler.stop()
    assert sunk[0]["power_w"] == 350.0


def test_sampler_thread_is_a_daemon():
    sampler = DeviceSampler(lambda r: None, interval_s=0.05, use_nvml=False)
    sampler.start()
    try:
        threads = [t for t in threading.enumerate() if t.name == "tokenmill-device-sampler"]
        assert threads and all(t.daemon for t in threads)
    finally:
        sampler.stop()


def _host_samples(sampler: DeviceSampler, seconds: float) -> list[dict]:
    rows = []
    sampler.sample_once()  # the reference point of the CPU counters
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.5)
        rows += sampler.sample_once()
    return rows


def test_cpu_used_outside_the_server_is_the_neighbours():
    """A spinning process outside the server's tree shows in ``cpu_others_pct``; the same spin
    inside the tree (a child, like the engine core) does not."""
    hog = [sys.executable, "-m", "tokenmill.bench.cpu_hog", "--procs", "1", "--duration", "3"]
    sampler = DeviceSampler(lambda r: None, use_nvml=False)
    # a grandchild whose parent exits at once: reparented, no longer in this process's tree
    subprocess.run(["sh", "-c", " ".join(hog) + " >/dev/null 2>&1 &"], check=True)
    outside = _host_samples(sampler, 2.0)
    child = subprocess.Popen(hog)
    try:
        inside = _host_samples(sampler, 2.0)
    finally:
        child.kill()
        child.wait()
    assert all(r["run_queue"] is None or r["run_queue"] >= 1 for r in outside + inside)
    share = 100 / (psutil.cpu_count() or 1)  # one spinning process, % of all CPUs
    others_out = max(r["cpu_others_pct"] for r in outside)
    assert others_out >= 0.3 * share, outside
    # inside the tree the spin is the server's own: cpu_pct sees it, cpu_others_pct does not
    own_in = max(r["cpu_pct"] - r["cpu_others_pct"] for r in inside)
    assert own_in >= 0.3 * share, inside
