"""The server's recorded config: the ``config`` event a server writes at start (the engine's
flags, the model's weight bytes, the device's roofline peaks, the versions) as one typed object.

:func:`read_recorded_config` is the one query of that event; every reader of a store (the
diagnoser, the console, the planner) takes its settings from the :class:`RecordedConfig` it
returns, by attribute. A store recorded before a field existed, or without a ``config`` event
at all (another engine's store), reads that field's default; so does a value of the wrong type.
Defaults are the engine's where the readers have always assumed it (``block_size`` 16, one
data-parallel replica, a CPU engine, no prefix affinity) and None (not recorded) elsewhere.
"""

from __future__ import annotations

import json
from typing import Any

import duckdb
import msgspec

from tokenmill.engine.messages import DEFAULT_BLOCK_SIZE

#: the latest ``config`` event's attributes (JSON text); no row for a store without one
CONFIG_SQL = "SELECT attributes FROM events WHERE kind = 'config' ORDER BY time_ns DESC LIMIT 1"


class RecordedConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The settings a store's ``config`` event recorded (see the module docstring for the
    defaults). ``recorded`` says whether the store holds a ``config`` event; ``attributes`` is
    the event as written, for what goes over every key (the config diff of ``diagnose --baseline``,
    the planner's ``EngineConfig``)."""

    recorded: bool = False
    attributes: dict[str, Any] = {}
    # the model and the device
    model: str | None = None
    dtype: str | None = None
    model_dtype: str | None = None
    engine_device: str = "cpu"
    device_name: str | None = None
    quantization: str | None = None
    int8_compute_path: str | None = None
    weight_bytes_total: int | None = None
    weight_bytes_by_dtype: dict[str, int] | None = None
    kv_bytes_per_token: int | None = None
    # the roofline's ceilings and where they came from (``flag``, ``table:<GPU>``, ``probe``)
    device_peak_gbps: float | None = None
    device_peak_gflops: float | None = None
    device_peak_gbps_source: str | None = None
    device_peak_gflops_source: str | None = None
    #: int8 compute's GEMM peak (GOP/s, probed at start on its path): the int8 steps' ceiling
    device_peak_int8_gops: float | None = None
    # the scheduler
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool | None = None
    speculative_config: str | None = None
    # parallelism
    tensor_parallel_size: int | None = None
    data_parallel_size: int = 1
    router_prefix_affinity: bool = False

    @classmethod
    def from_attributes(cls, attributes: dict[str, Any] | None) -> RecordedConfig:
        """The config of one ``config`` event's attributes (None or empty: no event)."""
        if not attributes:
            return cls()
        values: dict[str, Any] = {}
        for f in msgspec.structs.fields(cls):
            if f.name in ("recorded", "attributes") or f.name not in attributes:
                continue
            value = attributes[f.name]
            if not value and f.default is not None:
                continue  # 0, "" or None where the readers always took the default
            try:
                values[f.name] = msgspec.convert(value, f.type, strict=False)
            except (msgspec.ValidationError, TypeError):
                continue
        return cls(recorded=True, attributes=dict(attributes), **values)

    def roofline_peaks(self) -> tuple[float, float, float] | None:
        """``(peak GB/s, peak GFLOP/s, ridge FLOP/byte)`` (the ridge: GFLOP/s ÷ GB/s); None when
        either peak is missing or not positive (a store from before the roofline, a failed
        probe)."""
        gbps, gflops = self.device_peak_gbps, self.device_peak_gflops
        if gbps is None or gflops is None or not (gbps > 0 and gflops > 0):
            return None
        return gbps, gflops, gflops / gbps


def read_recorded_config(con: duckdb.DuckDBPyConnection) -> RecordedConfig:
    """The latest ``config`` event of the store ``con`` as a :class:`RecordedConfig`; the
    defaults for a store without one (or whose ``events`` table lacks the columns), or whose
    attributes are not a JSON object."""
    try:
        row = con.execute(CONFIG_SQL).fetchone()
    except (duckdb.CatalogException, duckdb.BinderException):
        return RecordedConfig()
    if not row or not row[0]:
        return RecordedConfig()
    try:
        attributes = json.loads(row[0])
    except ValueError:
        return RecordedConfig()
    return RecordedConfig.from_attributes(attributes if isinstance(attributes, dict) else None)


__all__ = ["CONFIG_SQL", "RecordedConfig", "read_recorded_config"]
