"""The engine's typed contract (engine/messages.py) and the store tables generated from it."""

from __future__ import annotations

import duckdb
import msgspec
import pytest

from tokenmill.engine import messages as m
from tokenmill.engine.async_engine import raise_for
from tokenmill.engine.core_process import rejection
from tokenmill.engine.errors import RequestRejected
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.telemetry.hub import step_row
from tokenmill.telemetry.rows import RequestRow
from tokenmill.telemetry.schema import (
    COMPLETED_SQL,
    ROW_TYPES,
    SchemaError,
    apply_schema,
    columns,
    sql_type,
    struct_ddl,
)
from tokenmill.telemetry.store import TraceStore

T0 = 1_700_000_000_000_000_000


def _record(**kw) -> m.StepRecord:
    base = dict(step_id=7, engine_pid=4242, start_ns=T0, end_ns=T0 + 5_000_000, forward_ms=4.5)
    return m.StepRecord(**{**base, **kw})


def _output() -> m.RequestOutput:
    return m.RequestOutput(
        request_id="cmpl-1",
        new_token_ids=[5, 6],
        new_text="hé",
        token_ns=[T0 + 1, T0 + 2],
        finished=True,
        finish_reason="stop",
        stop_reason="\n\n",
        error_type=None,
        error_message=None,
        stats=m.RequestStats(
            input_tokens=3,
            output_tokens=2,
            cached_tokens=0,
            preemptions=1,
            recomputed_tokens=4,
            queued_ns=T0,
            scheduled_ns=T0 + 1,
            first_token_ns=T0 + 1,
        ),
        arrival_ns=T0,
        finished_ns=T0 + 2,
        events=[m.RequestEvent("preempted", 3, T0 + 1, {"recompute_tokens": 4})],
    )


def _stats() -> m.EngineStats:
    return m.EngineStats(
        num_running=1,
        num_waiting=2,
        kv_blocks_total=100,
        kv_blocks_used=10,
        kv_blocks_free=90,
        kv_blocks_cached=3,
        kv_usage=0.1,
        prefix_cache_queries=5,
        prefix_cache_hits=2,
        max_model_len=8192,
        block_size=16,
    )


INPUTS = [
    m.AddRequest(
        request_id="cmpl-1",
        prompt_token_ids=[1, 2, 3],
        params=SamplingParams(max_tokens=5, temperature=0.7, seed=3, stop=("x",)),
        priority=2,
        tenant="acme",
        arrival_ns=T0,
    ),
    m.AbortRequests(["cmpl-1", "cmpl-2"]),
    m.StatsQuery(),
    m.Shutdown(),
]
OUTPUTS = [
    m.EngineReady(
        pid=1,
        started_ns=T0,
        num_blocks=100,
        max_model_len=8192,
        vocab_size=49152,
        config={"block_size": 16, "model": None},
        stats=_stats(),
    ),
    m.EngineOutputs([_output()], _record()),
    m.EngineOutputs([_output()]),
    m.Heartbeat(_stats(), _record(forward_ms=0.0)),
    m.StatsReply(_stats()),
    m.RequestFailed("cmpl-9", m.EngineError("context_length_exceeded", "too long")),
    m.EngineFatal(m.EngineError("engine_start_failed", "ModelLoadError: no config.json")),
]


@pytest.mark.parametrize("msg", INPUTS, ids=lambda x: type(x).__name__)
def test_inputs_round_trip(msg):
    back = m.INPUT_DECODER.decode(m.encode(msg))
    assert type(back) is type(msg)
    assert back == msg


@pytest.mark.parametrize("msg", OUTPUTS, ids=lambda x: type(x).__name__)
def test_outputs_round_trip(msg):
    back = m.OUTPUT_DECODER.decode(m.encode(msg))
    assert type(back) is type(msg)
    assert back == msg


def test_sampling_params_keep_their_values_across_the_boundary():
    back = m.INPUT_DECODER.decode(m.encode(INPUTS[0]))
    assert back.params == SamplingParams(max_tokens=5, temperature=0.7, seed=3, stop=("x",))
    assert back.params.stop == ("x",)


def test_a_message_of_the_wrong_direction_or_shape_is_refused():
    with pytest.raises(msgspec.ValidationError):
        m.INPUT_DECODER.decode(m.encode(m.StatsReply(_stats())))
    with pytest.raises(msgspec.ValidationError):
        m.OUTPUT_DECODER.decode(msgspec.msgpack.encode({"type": "outputs", "outputs": "x"}))


def test_rejections_cross_as_codes_and_come_back_as_the_same_exceptions():
    err = rejection(RequestRejected("prompt too long"))
    assert err == m.EngineError("context_length_exceeded", "prompt too long")
    assert isinstance(raise_for(err), RequestRejected)
    err = rejection(ValueError("bad token id"))
    assert err.error_type == "invalid_request"
    back = raise_for(err)
    assert type(back) is ValueError and str(back) == "bad token id"


def test_generated_tables_match_their_row_types_column_for_column():
    con = duckdb.connect()
    apply_schema(con)
    for table, row_type in ROW_TYPES.items():
        fields = msgspec.inspect.type_info(row_type).fields
        assert columns(con, table) == [f.name for f in fields]
        types = dict(
            con.execute(
                "SELECT column_name, data_type FROM information_schema.columns "
                "WHERE table_name = ?",
                [table],
            ).fetchall()
        )
        for f in fields:
            assert types[f.name] == sql_type(f.type), (table, f.name)


def test_required_fields_are_not_null_columns():
    ddl = struct_ddl("engine_steps", m.StepRecord)
    assert "step_id BIGINT NOT NULL" in ddl
    assert "start_ns BIGINT NOT NULL" in ddl
    assert "num_running INTEGER," in ddl
    assert "engine_pid INTEGER," in ddl


def test_a_field_type_without_a_column_type_is_refused():
    class Bad(msgspec.Struct):
        x: dict[str, int]

    with pytest.raises(TypeError, match="no column type"):
        struct_ddl("bad", Bad)


def test_step_record_and_request_row_land_in_the_store_as_typed(tmp_path):
    store = TraceStore(str(tmp_path / "t.duckdb"))
    store.submit(
        "engine_steps",
        step_row(
            _record(
                num_decode_tokens=3,
                num_finished=1,
                req_ids=["cmpl-1", "cmpl-2"],
                req_tokens=[256, 1],
                req_prefill=[True, False],
                admit_stop="budget",
            )
        ),
    )
    store.submit("engine_steps", step_row(_record(step_id=8, engine_pid=None), engine_pid=99))
    row = RequestRow(request_id="cmpl-1", trace_id="ab" * 16, arrival_ns=T0, end_ns=T0 + 10**9)
    store.submit("requests", {**msgspec.structs.asdict(row), "finish_reason": "length"})
    store.flush()
    assert store.query(
        "SELECT step_id, engine_pid, forward_ms, num_decode_tokens, num_finished "
        "FROM engine_steps ORDER BY step_id"
    ) == [(7, 4242, 4.5, 3, 1), (8, 99, 4.5, 0, 0)]
    # the step's requests: string, integer and boolean lists, in the step's order
    assert store.query(
        "SELECT req_ids, req_tokens, req_prefill, admit_stop FROM engine_steps ORDER BY step_id"
    ) == [(["cmpl-1", "cmpl-2"], [256, 1], [True, False], "budget"), (None, None, None, None)]
    assert store.query(f"SELECT request_id, {COMPLETED_SQL} FROM requests") == [("cmpl-1", True)]
    assert store.dropped_total == 0
    store.close()


def test_a_store_from_before_a_new_field_gains_its_column(tmp_path):
    """Adding a step field (with a default) needs no migration step: opening an older store
    adds the nullable column, and its old rows read as NULL."""
    path = str(tmp_path / "old.duckdb")
    with duckdb.connect(path) as con:
        apply_schema(con)
        con.execute("ALTER TABLE engine_steps DROP COLUMN num_finished")
        con.execute("INSERT INTO engine_steps (step_id, start_ns, end_ns) VALUES (1, 2, 3)")
    store = TraceStore(path)
    store.submit("engine_steps", step_row(_record(num_finished=2)))
    store.flush()
    assert store.query("SELECT step_id, num_finished FROM engine_steps ORDER BY step_id") == [
        (1, None),
        (7, 2),
    ]
    store.close()
    with duckdb.connect(path) as con:
        con.execute("ALTER TABLE engine_steps DROP COLUMN start_ns")
        with pytest.raises(SchemaError, match="lacks required column start_ns"):
            apply_schema(con)
