"""Every query of the console, by name: the Streamlit pages ask for them through
``ui.q(ctx, "<name>", ...)``, cached per store snapshot. The queries live by concern in
``data_store.py`` (the shared helpers and conventions: the window, units; the store itself),
``data_requests.py``, ``data_engine.py``, ``data_engine_modes.py``, ``data_devices.py``,
``data_errors.py``, ``data_diagnosis.py`` and ``data_findings.py`` (the live diagnosis's
findings); nothing here imports Streamlit."""

from __future__ import annotations

from tokenmill.telemetry.goodput import GoodputSlo
from tokenmill.telemetry.schema import STATIONS

from .data_devices import (
    THROTTLE_REASONS,
    device_kind,
    device_series,
    energy_per_token,
)
from .data_diagnosis import (
    comparison,
    diagnosis,
    evidence_signals,
    latency_samples,
    runbook,
    signal_windows,
)
from .data_engine import (
    STEP_FIELDS,
    device_peaks,
    engine_steps,
    engine_summary,
    prefix_hit_series,
    roofline_steps,
    step_field_series,
)
from .data_engine_modes import (
    collective_series,
    pd_pool_series,
    pd_transfer_summary,
    replica_series,
    spec_acceptance_by_position,
    spec_decode_series,
    spec_decode_summary,
)
from .data_errors import (
    error_events,
    error_examples,
    errors_series,
)
from .data_findings import (
    findings_current,
    findings_spans,
    has_findings,
    now_series,
    open_findings,
    resolved_findings,
    store_now_ns,
)
from .data_requests import (
    SORTS,
    STATUS_SQL,
    STATUSES,
    filter_options,
    latency_series,
    overview,
    request_detail,
    request_explanation,
    requests_table,
)
from .data_store import (
    GIB,
    NS,
    OK_SQL,
    engine_seen,
    pick_bucket_s,
    store_info,
    time_range,
)

__all__ = [
    "GIB",
    "NS",
    "OK_SQL",
    "SORTS",
    "STATIONS",
    "STATUSES",
    "STATUS_SQL",
    "STEP_FIELDS",
    "THROTTLE_REASONS",
    "GoodputSlo",
    "collective_series",
    "comparison",
    "device_kind",
    "device_peaks",
    "device_series",
    "diagnosis",
    "energy_per_token",
    "engine_seen",
    "engine_steps",
    "engine_summary",
    "error_events",
    "error_examples",
    "errors_series",
    "evidence_signals",
    "filter_options",
    "findings_current",
    "findings_spans",
    "has_findings",
    "latency_samples",
    "latency_series",
    "now_series",
    "open_findings",
    "overview",
    "pd_pool_series",
    "pd_transfer_summary",
    "pick_bucket_s",
    "prefix_hit_series",
    "replica_series",
    "request_detail",
    "request_explanation",
    "requests_table",
    "resolved_findings",
    "roofline_steps",
    "runbook",
    "signal_windows",
    "spec_acceptance_by_position",
    "spec_decode_series",
    "spec_decode_summary",
    "step_field_series",
    "store_info",
    "store_now_ns",
    "time_range",
]
