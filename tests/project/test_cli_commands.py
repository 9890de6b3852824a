"""The ``tokenmill`` command tree: every package's commands reachable from the root, the root's
help fast (no torch, no other package's logic), the engine flags built from the
``EngineConfig`` fields, and ``generate --seed`` per prompt."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from tokenmill.engine import cli
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.serve_config import ServeConfig
from tokenmill.telemetry.remote import normalize_url

ROOT_COMMANDS = ["generate", "serve", "tp-worker", "pd-worker", "model", *cli.COMMANDS]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "300"},
    )


def _modules_after(argv: list[str]) -> tuple[str, set[str]]:
    """Run ``tokenmill ARGV`` in a fresh interpreter: (its stdout, the modules it imported)."""
    r = _python(
        "import json, sys\n"
        "from tokenmill.engine.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('MODULES=' + json.dumps(sorted(sys.modules)))\n"
    )
    assert r.returncode == 0, r.stderr
    text, _, modules = r.stdout.rpartition("MODULES=")
    return text, set(json.loads(modules))


def _package(mods: set[str], name: str) -> set[str]:
    return {m for m in mods if m == name or m.startswith(name + ".")}


def test_root_help_lists_every_command_without_torch():
    text, mods = _modules_after(["--help"])
    group = typer.main.get_command(cli.app)
    for name in ROOT_COMMANDS:
        short = group.get_command(None, name).help.strip().splitlines()[0]
        assert any(name in ln and short[:40] in ln for ln in text.splitlines()), (name, text)
    assert not _package(mods, "torch"), "tokenmill --help imported torch"
    for heavy in ("duckdb", "httpx", "numpy", "streamlit"):
        assert not _package(mods, heavy), f"tokenmill --help imported {heavy}"


def test_engine_cli_imports_no_other_package_and_a_command_only_its_own():
    r = _python(
        "import json, sys\nimport tokenmill.engine.cli\nprint(json.dumps(sorted(sys.modules)))\n"
    )
    assert r.returncode == 0, r.stderr
    mods = set(json.loads(r.stdout))
    for pkg in ("telemetry", "diagnose", "dashboard", "bench"):
        assert not _package(mods, f"tokenmill.{pkg}"), pkg
    assert not _package(mods, "torch")
    _, mods = _modules_after(["dump", "--help"])
    assert "tokenmill.telemetry.cli" in mods
    for other in ("tokenmill.diagnose", "tokenmill.dashboard", "tokenmill.bench"):
        assert not _package(mods, other), other


def test_registry_names_real_commands():
    group = typer.main.get_command(cli.app)
    assert group.list_commands(None) == ROOT_COMMANDS
    runner = CliRunner()
    for name in cli.COMMANDS:
        command = group.get_command(None, name)
        assert command is not None and command.name == name
        assert not any("--install-completion" in p.opts for p in command.params), name
        r = runner.invoke(cli.app, [name, "--help"])
        assert r.exit_code == 0 and "Usage:" in r.output, (name, r.output)
        # no markup leaks: typer's {ARG} usage mark, reST's ``literal`` and roles
        usage = next(line for line in r.output.splitlines() if "Usage:" in line)
        assert "{" not in usage and "}" not in usage, (name, usage)
        assert "``" not in r.output and ":func:" not in r.output, (name, r.output)
    root = runner.invoke(cli.app, ["--help"])
    assert root.exit_code == 0 and "``" not in root.output, root.output


def test_a_typo_suggests_a_lazy_command():
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", "diagnos"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: No such command 'diagnos'") and "'diagnose'" in lines[0]


def _params(command: str) -> dict:
    group = typer.main.get_command(cli.app)
    return {p.name: p for p in group.get_command(None, command).params}


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_engine_flags_come_from_the_config_fields(command):
    params = _params(command)
    names = EngineConfig.field_names() if command == "serve" else [
        "model", "dtype", "device", "attention_backend", "load_format", "quantization", "block_size"
    ]  # fmt: skip
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for name in names:
        p, f = params[name], fields[name]
        assert p.opts == ["--" + name.replace("_", "-")], name
        assert p.default == f.default, name
        assert p.help == f.metadata["help"] == EngineConfig.field_help(name), name
        for bound in ("min", "max"):
            assert getattr(p, bound) == f.metadata[bound], (name, bound)
    if command == "serve":
        assert params["enable_chunked_prefill"].secondary_opts == ["--no-enable-chunked-prefill"]
        assert params["enable_prefix_caching"].secondary_opts == ["--no-enable-prefix-caching"]
        assert params["fault_leak_blocks_on_abort"].secondary_opts == []
        assert params["block_size"].max == 1024 and params["kv_watermark"].max == 0.99


def test_help_placeholders_name_what_the_value_is():
    """Before: ``--cpu-threads SECONDS`` (its help says the count is re-read every second)."""
    params = _params("serve")
    shown = {name: cli.help_metavar(params[name]) for name in params}
    assert shown["cpu_threads"] == "N"
    assert shown["max_num_seqs"] == "N"
    assert shown["tensor_parallel_join_timeout"] == "SECONDS"
    assert shown["kv_cache_memory"] == "BYTES"


def test_every_config_field_is_documented():
    for cls in (EngineConfig, ServeConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"


def test_server_flags_come_from_serve_config_fields():
    """Every ServeConfig field is one serve option of the same name, default and help (and
    nothing else is: the server's settings are written once)."""
    params = _params("serve")
    fields = {f.name: f for f in dataclasses.fields(ServeConfig)}
    own = set(params) - set(EngineConfig.field_names()) - {"config"}
    assert own == set(fields), own ^ set(fields)
    for name, f in fields.items():
        p = params[name]
        assert p.opts == ["--" + name.replace("_", "-")], name
        assert p.default == f.default and p.help == f.metadata["help"], name
        if f.metadata["duration"]:
            assert p.metavar == "DURATION", name
    assert params["api_key"].envvar == "TOKENMILL_API_KEY"
    assert params["fault_stream_delay_ms"].rich_help_panel.startswith("Fault drills")


@pytest.mark.parametrize(
    ("command", "settings"),
    [
        ("proxy", "tokenmill.proxy.cli:ProxyConfig"),
        ("collect", "tokenmill.telemetry.collect_cli:CollectConfig"),
        ("bench", "tokenmill.bench.cli:BenchOptions"),
    ],
)
def test_observer_flags_come_from_their_settings_fields(command, settings):
    """proxy, collect and bench, as serve: one option per field of their settings class, with
    the field's flag, default, help and variable (and no option that is not a field)."""
    import importlib

    module, name = settings.split(":")
    cls = getattr(importlib.import_module(module), name)
    params = {n: p for n, p in _params(command).items() if p.param_type_name == "option"}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert set(params) == set(fields), set(params) ^ set(fields)
    for name, f in fields.items():
        p, meta = params[name], f.metadata
        flag = meta["flags"][0].split("/")[0] if meta["flags"] else "--" + name.replace("_", "-")
        assert p.opts[0] == flag, name
        assert p.help == meta["help"] and p.envvar == meta["envvar"], name
        if f.default is dataclasses.MISSING:
            assert p.required, name
        else:
            assert p.default == f.default, name


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--shutdown-timeout", "ten", "bad duration 'ten'"),
        ("--engine-restart-window", "500ms", "less than 1s"),
        ("--trace-retention", "5x", "bad duration '5x'"),
    ],
)
def test_a_bad_duration_is_a_usage_error_naming_the_option(flag, value, needle):
    r = CliRunner().invoke(cli.app, ["serve", flag, value])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.replace("│", " ").split())  # the error box wraps lines
    assert flag in text and needle in text, r.output


def test_serve_passes_every_engine_flag_to_the_config(monkeypatch):
    """What the flags say reaches EngineConfig (make_server stubbed: nothing starts)."""
    import tokenmill.engine.api.server as server

    seen = {}

    def fake_make_server(config, serve, **kw):
        seen["config"], seen["serve"] = config, serve
        raise ValueError("stop here")

    monkeypatch.setattr(server, "make_server", fake_make_server)
    r = CliRunner().invoke(
        cli.app,
        ["serve", "--block-size", "32", "--no-enable-prefix-caching", "--max-model-len", "99",
         "--fault-leak-blocks-on-abort", "--scheduling-policy", "priority",
         "--shutdown-timeout", "1.5m", "--engine-stall-degraded", "500ms", "--port", "9001",
         "--no-trace-db"],
    )  # fmt: skip
    assert r.exit_code == 1 and "stop here" in r.output, r.output
    # the server's own flags reach ServeConfig, durations in seconds
    assert seen["serve"] == ServeConfig(
        shutdown_timeout=90.0, engine_stall_degraded=0.5, port=9001, no_trace_db=True
    )
    expected = EngineConfig(
        block_size=32,
        enable_prefix_caching=False,
        max_model_len=99,
        fault_leak_blocks_on_abort=True,
        scheduling_policy="priority",
    )
    assert seen["config"] == expected


def test_generate_seed_is_seed_plus_index():
    params = cli.prompt_params(3, seed=5, max_tokens=4, temperature=0.7, top_p=0.9)
    assert [p.seed for p in params] == [5, 6, 7]
    assert all((p.max_tokens, p.temperature, p.top_p) == (4, 0.7, 0.9) for p in params)
    assert [p.seed for p in cli.prompt_params(2, seed=None)] == [None, None]


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://h:1/", "http://h:1"),
        ("http://h:1/v1/", "http://h:1"),
        (" https://h/v1 ", "https://h"),
        ("http://", "http://"),
    ],
)
def test_one_url_normalisation(url, base):
    assert normalize_url(url) == base


HELP_PAGES = [
    [],
    ["model", "fetch"],
    ["generate"],
    ["serve"],
    ["dump"],
    ["diagnose"],
    ["dashboard"],
    ["bench"],
    ["scenario", "run"],
    ["scenario", "list"],
    ["demo"],
]


def _option_rows(text: str) -> dict[str, str]:
    """``--flag`` -> the rest of its row in a rich help panel (first row only)."""
    rows = {}
    for line in text.splitlines():
        cells = line.strip("│ ").split()
        if cells and cells[0].startswith("--"):
            rows.setdefault(cells[0], " ".join(cells[1:]))
    return rows


@pytest.mark.parametrize("argv", HELP_PAGES, ids=lambda a: " ".join(a) or "root")
def test_help_shows_placeholders_only_where_they_say_something(argv):
    """Issue 19 item 13: typer 0.29 printed `<str>`, `<bool>`, `<int range>` after every option
    (flags included). Now a flag has none, and a value has one that says what it is."""
    r = CliRunner().invoke(cli.app, [*argv, "--help"], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    for placeholder in ("<str>", "<bool>", "<int", "<float", "<path>", "<list"):
        assert placeholder not in r.output, (argv, placeholder, r.output)
    rows = _option_rows(r.output)
    assert rows["--help"].startswith("Show this message"), rows["--help"]


def test_serve_help_names_units_and_paths():
    r = CliRunner().invoke(cli.app, ["serve", "--help"], env={"COLUMNS": "300"})
    rows = _option_rows(r.output)
    assert rows["--device-sample-interval"].startswith("DURATION ")
    assert rows["--fault-stream-delay-ms"].startswith("MS ")
    assert rows["--trace-db"].startswith("PATH ") and rows["--tenants"].startswith("PATH ")
    assert rows["--model"].startswith("PATH ") and rows["--otlp-endpoint"].startswith("URL ")
    assert rows["--port"].startswith("PORT [1<=x<=65535]") and rows["--host"].startswith("HOST ")
    assert rows["--max-num-seqs"].startswith("N [x>=1]")
    assert rows["--max-body-bytes"].startswith("BYTES ")
    assert rows["--kv-watermark"].startswith("FRACTION ")
    assert rows["--no-trace-db"].startswith("Keep no trace store")  # a flag: no placeholder
    assert rows["--enable-prefix-caching"].startswith("--no-enable-prefix-caching Reuse")
