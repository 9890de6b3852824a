-- tokenmill trace store. Version 1 (telemetry/schema.py: SCHEMA_VERSION).
-- Times are wall-clock Unix nanoseconds (BIGINT) unless a column says ms/s.
-- Changing a table means a new version: dumps from another version are refused.

CREATE TABLE IF NOT EXISTS meta (
    key   VARCHAR PRIMARY KEY,
    value VARCHAR NOT NULL
);

-- OTLP span model, one row per span. Hot attributes are copied into typed columns.
CREATE TABLE IF NOT EXISTS spans (
    trace_id        VARCHAR NOT NULL,   -- 32 hex digits
    span_id         VARCHAR NOT NULL,   -- 16 hex digits
    parent_span_id  VARCHAR,            -- NULL for the root `request` span
    name            VARCHAR NOT NULL,   -- request | gateway | tokenize | admission | schedule | prefill | decode | stream | metering
    kind            VARCHAR NOT NULL,   -- SERVER | INTERNAL
    start_ns        BIGINT  NOT NULL,
    end_ns          BIGINT  NOT NULL,
    duration_ns     BIGINT  NOT NULL,
    status_code     VARCHAR NOT NULL,   -- UNSET | OK | ERROR
    status_message  VARCHAR,
    service_name    VARCHAR,
    attributes      JSON,               -- every attribute, OTel names
    events          JSON,               -- [{"name", "time_ns", "attributes"}]
    request_id      VARCHAR,
    tenant          VARCHAR,
    model           VARCHAR,
    input_tokens    INTEGER,
    output_tokens   INTEGER,
    cached_tokens   INTEGER,
    finish_reason   VARCHAR,
    error_type      VARCHAR
);

-- One row per request, the numbers derived from its trace.
CREATE TABLE IF NOT EXISTS requests (
    request_id      VARCHAR NOT NULL,   -- the engine id (cmpl-...)
    client_request_id VARCHAR,          -- x-request-id as the client sent it
    trace_id        VARCHAR NOT NULL,
    tenant          VARCHAR,
    model           VARCHAR,
    endpoint        VARCHAR,            -- chat | completions
    stream          BOOLEAN,
    http_status     INTEGER,
    arrival_ns      BIGINT NOT NULL,    -- gateway start
    queued_ns       BIGINT,             -- engine took it
    scheduled_ns    BIGINT,             -- first scheduled
    first_token_ns  BIGINT,
    last_token_ns   BIGINT,
    end_ns          BIGINT NOT NULL,    -- request span end (after metering)
    ttft_ms         DOUBLE,             -- first_token_ns - arrival_ns
    queue_ms        DOUBLE,             -- scheduled_ns - queued_ns
    prefill_ms      DOUBLE,             -- first_token_ns - scheduled_ns
    decode_ms       DOUBLE,             -- last_token_ns - first_token_ns
    tpot_ms         DOUBLE,             -- decode_ms / (output_tokens - 1)
    itl_p50_ms      DOUBLE,
    itl_p99_ms      DOUBLE,
    itl_max_ms      DOUBLE,
    e2e_ms          DOUBLE,             -- end_ns - arrival_ns
    client_ttft_ms  DOUBLE,             -- filled by the load generator when it knows
    input_tokens    INTEGER,
    output_tokens   INTEGER,
    cached_tokens   INTEGER,
    max_tokens      INTEGER,
    preemptions     INTEGER,
    recomputed_tokens INTEGER,
    prefill_chunks  INTEGER,
    finish_reason   VARCHAR,            -- stop | length | abort | error | NULL (rejected)
    error_type      VARCHAR,
    prompt_block_hashes BIGINT[]        -- per-block (16-token) content hashes of the prompt's first 32 blocks, not chained
);

-- One row per scheduler iteration (engine StepRecord).
CREATE TABLE IF NOT EXISTS engine_steps (
    step_id             BIGINT NOT NULL,
    engine_pid          INTEGER,
    start_ns            BIGINT NOT NULL,
    end_ns              BIGINT NOT NULL,
    schedule_ms         DOUBLE,
    forward_ms          DOUBLE,
    sample_ms           DOUBLE,
    num_running         INTEGER,
    num_waiting         INTEGER,
    num_prefill_tokens  INTEGER,
    num_decode_tokens   INTEGER,
    num_prefill_chunks  INTEGER,
    num_sampled         INTEGER,        -- tokens produced in this step
    num_preempted       INTEGER,
    kv_blocks_total     INTEGER,
    kv_blocks_used      INTEGER,
    kv_blocks_free      INTEGER,
    kv_blocks_cached    INTEGER,
    prefix_hit_tokens   INTEGER,
    allocation_failures INTEGER,
    num_finished        INTEGER
);

-- Per device per tick: NVML (kind='gpu') or the host (kind='host').
CREATE TABLE IF NOT EXISTS device_samples (
    time_ns             BIGINT NOT NULL,
    kind                VARCHAR NOT NULL,   -- gpu | host
    device_index        INTEGER,            -- GPU index; NULL for host
    device_name         VARCHAR,
    power_w             DOUBLE,
    energy_j            DOUBLE,             -- since the sampler started
    gpu_util_pct        DOUBLE,
    mem_util_pct        DOUBLE,
    dram_bw_util_pct    DOUBLE,             -- GPM, Hopper+; NULL where unsupported
    mem_used_bytes      BIGINT,
    mem_total_bytes     BIGINT,
    sm_clock_mhz        INTEGER,
    mem_clock_mhz       INTEGER,
    temperature_c       DOUBLE,
    clock_event_reasons VARCHAR[],          -- throttle reasons by name
    pcie_rx_bytes_s     DOUBLE,
    pcie_tx_bytes_s     DOUBLE,
    cpu_pct             DOUBLE,             -- host rows
    rss_bytes           BIGINT,             -- host rows: the server process (+ engine)
    load_1m             DOUBLE              -- host rows
);

-- Engine and server events: worker start/crash/restart, OOM, allocation failure, config, drops.
CREATE TABLE IF NOT EXISTS events (
    time_ns     BIGINT NOT NULL,
    kind        VARCHAR NOT NULL,   -- server_start | engine_start | engine_crash | engine_restart | config | telemetry_drop | ...
    severity    VARCHAR NOT NULL,   -- info | warning | error
    message     VARCHAR,
    attributes  JSON
);
