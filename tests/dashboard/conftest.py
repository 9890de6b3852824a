"""The console tests' shared stores: ``findings_store``, a synthetic incident whose ``findings``
table holds what the live diagnosis loop writes (``diagnose/live.py``) for one finding that
opened and resolved and one still open at the store's end, written through the real store
writer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import duckdb
import pytest
from synth_store import T0, Phase, S, write_store

from tokenmill.telemetry.rows import finding_row
from tokenmill.telemetry.store import TraceStore


@dataclass(frozen=True)
class FindingsStore:
    """The store and what its ``findings`` rows say."""

    path: Path
    resolved_id: str = "a1b2c3d4e5f60001"
    resolved_rule: str = "kv_pressure_preemption"
    resolved_opened_ns: int = T0 + 20 * S
    resolved_ns: int = T0 + 50 * S
    open_id: str = "a1b2c3d4e5f60002"
    open_rule: str = "ttft_queueing"
    open_opened_ns: int = T0 + 80 * S
    open_last_ns: int = T0 + 110 * S
    open_summary: str = "Requests wait about 2 s in the engine queue before their prefill."
    open_traces: tuple[str, ...] = ()


def _rows(fs: FindingsStore) -> list[dict]:
    """The rows the loop writes: an open, a refresh and a resolve for the first finding; an open
    and a refresh every 10 s for the second, the latest with new evidence."""
    kv = dict(
        finding_id=fs.resolved_id, rule=fs.resolved_rule, severity="warning", confidence=0.7,
        title="KV cache pressure preempts requests",
        summary="Preemptions follow KV use above 95 %.", first_seen_ns=fs.resolved_opened_ns - 10 * S,
        opened_ns=fs.resolved_opened_ns, runbook=f"runbooks/{fs.resolved_rule}.md",
        knob="--num-gpu-blocks", example_trace_ids=[], explained_by=[],
    )  # fmt: skip
    rows = [
        finding_row(time_ns=fs.resolved_opened_ns, status="open", last_seen_ns=fs.resolved_opened_ns,
                    evidence={"preemptions": 12}, **kv),
        finding_row(time_ns=fs.resolved_opened_ns + 10 * S, status="open",
                    last_seen_ns=fs.resolved_opened_ns + 10 * S, evidence={"preemptions": 30}, **kv),
        finding_row(time_ns=fs.resolved_ns, status="resolved", resolved_ns=fs.resolved_ns,
                    last_seen_ns=fs.resolved_ns - 20 * S, evidence={"preemptions": 30}, **kv),
    ]  # fmt: skip
    q = dict(
        finding_id=fs.open_id, rule=fs.open_rule, severity="critical", confidence=0.9,
        title="TTFT is dominated by queueing", first_seen_ns=fs.open_opened_ns - 10 * S,
        opened_ns=fs.open_opened_ns, runbook=f"runbooks/{fs.open_rule}.md",
        knob="--max-num-seqs", example_trace_ids=list(fs.open_traces), explained_by=[],
    )  # fmt: skip
    for t in range(fs.open_opened_ns, fs.open_last_ns + 1, 10 * S):
        last = t == fs.open_last_ns
        rows.append(
            finding_row(time_ns=t, status="open", last_seen_ns=t,
                        summary=fs.open_summary if last else "an older summary",
                        evidence={"queue_share_of_ttft": 0.93 if last else 0.5,
                                  "ttft_p99_ms": 2150.0}, **q)
        )  # fmt: skip
    return rows


def write_findings_store(path: Path) -> FindingsStore:
    """60 s of health, 40 s of 2 s queueing, 20 s of health again (T0 on), and the findings."""
    write_store(
        path,
        [Phase(duration_s=60), Phase(duration_s=40, queue_ms=2000), Phase(duration_s=20)],
        seed=3,
    )
    with duckdb.connect(str(path)) as con:
        traces = con.execute(
            "SELECT trace_id FROM requests WHERE arrival_ns >= ? ORDER BY queue_ms DESC, "
            "trace_id LIMIT 2",
            [T0 + 60 * S],
        ).fetchall()
    fs = FindingsStore(path, open_traces=tuple(t for (t,) in traces))
    store = TraceStore(path, flush_interval_s=0.05)
    try:
        for row in _rows(fs):
            assert store.submit("findings", row)
        assert store.flush(60)
    finally:
        store.close()
    return fs


@pytest.fixture(scope="module")
def findings_store(tmp_path_factory) -> FindingsStore:
    return write_findings_store(tmp_path_factory.mktemp("findings") / "findings.duckdb")
