-- tokenmill trace store, of the version telemetry/schema.py stamps (SCHEMA_VERSION).
-- Times are wall-clock Unix nanoseconds (BIGINT) unless a column says ms/s.
-- Changing a table means a new version: dumps from another version are refused.

CREATE TABLE IF NOT EXISTS meta (
    key   VARCHAR PRIMARY KEY,
    value VARCHAR NOT NULL
);

-- `spans` (one row per span, from telemetry/rows.py: SpanRow), `requests` (one row per request,
-- RequestRow) and `engine_steps` (one row per scheduler iteration, from engine/messages.py:
-- StepRecord) are generated from their row types by telemetry/schema.py: ddl().

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
    load_1m             DOUBLE,             -- host rows
    cpu_others_pct      DOUBLE,             -- host rows: CPU % used outside this server's process tree
    steal_pct           DOUBLE,             -- host rows: CPU % stolen by the hypervisor
    run_queue           INTEGER,            -- host rows: runnable tasks (/proc/loadavg)
    other_processes     INTEGER,            -- gpu rows: processes on the device outside this server
    loadgen_cpu_pct     DOUBLE,             -- host rows: CPU % used by tokenmill's own load generator (bench/scenario)
    busy_others         VARCHAR             -- host rows: JSON, the busiest processes outside the server (pid, command, cpu_pct, load_generator)
);

-- Engine and server events: worker start/crash/restart, OOM, allocation failure, config, drops.
CREATE TABLE IF NOT EXISTS events (
    time_ns     BIGINT NOT NULL,
    kind        VARCHAR NOT NULL,   -- server_start | engine_start | engine_crash | engine_restart | config | telemetry_drop | ...
    severity    VARCHAR NOT NULL,   -- info | warning | error
    message     VARCHAR,
    attributes  JSON
);
