"""The recorded config (``telemetry/recorded_config.py``): the ``config`` event of a real
recording read as typed attributes, and the defaults for a store recorded before a field
existed or without a ``config`` event at all."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest

from tokenmill.telemetry.dump import open_dump
from tokenmill.telemetry.recorded_config import RecordedConfig, read_recorded_config
from tokenmill.telemetry.schema import apply_schema

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data"


def _store(attributes: dict | None) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    apply_schema(con)
    if attributes is not None:
        con.execute(
            "INSERT INTO events VALUES (1, 'config', 'info', 'engine flags at start', ?)",
            [json.dumps(attributes)],
        )
    return con


def test_a_real_recording_reads_typed_values():
    con = open_dump(DATA / "plan_recording", verify=False)
    cfg = read_recorded_config(con)
    raw = json.loads(
        con.execute(
            "SELECT attributes FROM events WHERE kind = 'config' ORDER BY time_ns DESC LIMIT 1"
        ).fetchone()[0]
    )
    assert cfg.recorded and cfg.attributes == raw
    assert cfg.block_size == raw["block_size"] == 16
    assert cfg.max_num_seqs == raw["max_num_seqs"] and cfg.max_num_seqs > 0
    assert cfg.max_num_batched_tokens == raw["max_num_batched_tokens"]
    assert cfg.enable_chunked_prefill is raw["enable_chunked_prefill"]
    assert cfg.enable_prefix_caching is raw["enable_prefix_caching"]
    assert cfg.quantization == raw["quantization"]
    assert cfg.engine_device == raw["engine_device"]
    assert cfg.model == raw["model"]
    assert cfg.data_parallel_size == raw["data_parallel_size"] == 1
    assert cfg.weight_bytes_total == raw["weight_bytes_total"] > 0
    assert cfg.weight_bytes_by_dtype == raw["weight_bytes_by_dtype"]
    assert cfg.device_peak_gbps == pytest.approx(raw["device_peak_gbps"])
    peaks = cfg.roofline_peaks()
    assert peaks is not None and peaks[2] == pytest.approx(peaks[1] / peaks[0])


@pytest.mark.parametrize(
    "name", sorted(p.parent.name for p in (DATA / "scenario_dumps").glob("*/dump"))
)
def test_every_scenario_dump_reads_its_flags(name):
    con = open_dump(DATA / "scenario_dumps" / name / "dump", verify=False)
    cfg = read_recorded_config(con)
    assert cfg.recorded
    assert cfg.max_num_seqs == cfg.attributes["max_num_seqs"]
    assert cfg.tensor_parallel_size == cfg.attributes["tensor_parallel_size"]
    assert cfg.router_prefix_affinity is cfg.attributes["router_prefix_affinity"]
    # these stores predate the int8 compute path: the field reads its default
    assert "int8_compute_path" not in cfg.attributes
    assert cfg.int8_compute_path is None


def test_an_older_store_lacking_a_key_reads_the_default():
    cfg = read_recorded_config(_store({"max_num_seqs": 8, "quantization": "int8"}))
    assert cfg.recorded and cfg.max_num_seqs == 8 and cfg.quantization == "int8"
    # not recorded then: the engine's default where the readers assumed it, else None
    assert cfg.block_size == 16
    assert cfg.data_parallel_size == 1
    assert cfg.engine_device == "cpu"
    assert cfg.router_prefix_affinity is False
    assert cfg.enable_chunked_prefill is None
    assert cfg.max_num_batched_tokens is None
    assert cfg.roofline_peaks() is None


def test_a_store_without_a_config_event_reads_every_default():
    cfg = read_recorded_config(_store(None))
    assert cfg == RecordedConfig()
    assert not cfg.recorded and cfg.attributes == {}
    assert cfg.block_size == 16 and cfg.max_num_seqs is None


def test_values_of_the_wrong_type_read_the_default():
    cfg = read_recorded_config(
        _store(
            {
                "block_size": 0,
                "max_num_seqs": "12",
                "data_parallel_size": None,
                "enable_prefix_caching": "maybe",
                "device_peak_gbps": 100,
                "device_peak_gflops": -1.0,
            }
        )
    )
    assert cfg.block_size == 16  # 0 was never a block size
    assert cfg.max_num_seqs == 12  # a number written as text still reads
    assert cfg.data_parallel_size == 1
    assert cfg.enable_prefix_caching is None
    assert cfg.device_peak_gbps == 100.0
    assert cfg.roofline_peaks() is None  # a peak that is not positive


def test_an_events_table_without_attributes_reads_the_defaults():
    con = duckdb.connect()
    con.execute("CREATE TABLE events (time_ns BIGINT, kind VARCHAR)")
    assert read_recorded_config(con) == RecordedConfig()
