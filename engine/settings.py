"""Commands' settings declared once, as dataclass fields: :func:`setting` writes a field's
default, help, bounds and option shape; :func:`config_options` turns the fields into a typer
command's options (flag, default, help, bounds, placeholder, environment variable, help panel),
so a new knob is one field plus its use. ``ServeConfig`` (``serve_config.py``), the proxy's,
the collector's and the load generator's settings are declared this way; ``EngineConfig``'s
``knob`` fields go through the same :func:`config_options`.

Torch-free and typer-free at import (typer is imported when a command's options are built), so
the observer install and the console import it freely. Also the default paths every command
shares (:data:`DATA_DIR`, :data:`DEFAULT_TRACE_DB`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any

#: the folder the commands write into by default, relative to where they start
DATA_DIR = "tokenmill-data"
#: ``tokenmill serve``'s trace store, and the console's default source
DEFAULT_TRACE_DB = f"./{DATA_DIR}/traces.duckdb"


def setting(
    default: Any = dataclasses.MISSING,
    help: str | None = None,
    *,
    min: float | None = None,
    max: float | None = None,
    duration: bool = False,
    allow_zero: bool = True,
    envvar: str | None = None,
    panel: str | None = None,
    metavar: str | None = None,
    flags: tuple[str, ...] = (),
    **extra: Any,
) -> Any:
    """A settings field with its documentation and its option's shape.

    Args:
        default: the field's default and its option's (none: a required option).
        help: the option's help text (and the field's documentation).
        min, max: the accepted range (inclusive).
        duration: the value takes the duration grammar (``engine/durations.py``). A ``float``
            field gets seconds from its option (``min`` in seconds; a bad value is a usage
            error); a ``str`` field keeps the text as typed (its default shows as written) and
            :func:`duration_seconds` turns it into seconds, ``allow_zero`` saying whether 0 is
            a value.
        envvar: a variable the option reads (shown in ``--help``).
        panel: the ``--help`` panel (none: the command's default).
        metavar: the ``--help`` placeholder (none: the one ``engine/cli.py``'s ``help_metavar``
            reads from the type, name and help).
        flags: the option's declarations when not ``--field-name`` (``("--out", "-o")``,
            ``("--progress/--no-progress",)``).
        extra: more metadata for the field's readers (``plan/whatif.py``'s knobs).
    """
    return dataclasses.field(
        default=default,
        metadata={
            "help": help,
            "min": min,
            "max": max,
            "duration": duration,
            "allow_zero": allow_zero,
            "envvar": envvar,
            "panel": panel,
            "metavar": metavar,
            "flags": tuple(flags),
            **extra,
        },
    )


def field_names(cls: type) -> list[str]:
    """The fields of the settings dataclass ``cls``, in declaration order."""
    return [f.name for f in dataclasses.fields(cls)]


def flag_of(name: str) -> str:
    """A field's flag: ``first_byte_timeout`` → ``--first-byte-timeout``."""
    return "--" + name.replace("_", "-")


def from_options(cls: type, options: dict) -> Any:
    """An instance of ``cls`` from a command's keyword arguments: its fields are taken out of
    ``options`` (what is left is the command's other options)."""
    return cls(**{n: options.pop(n) for n in field_names(cls) if n in options})


def duration_seconds(cfg: Any, name: str) -> float:
    """The ``str`` duration field ``name`` of ``cfg`` in seconds.

    Raises:
        ValueError: ``--field-name: bad duration ...`` (the command's one error line).
    """
    from .durations import parse_duration

    f = next(f for f in dataclasses.fields(cfg) if f.name == name)
    try:
        return parse_duration(getattr(cfg, name), allow_zero=f.metadata.get("allow_zero", True))
    except ValueError as exc:
        raise ValueError(f"{flag_of(name)}: {exc}") from None


def config_options(cls: type, *names: str, panel: Callable[[str], str | None] | str | None = None):
    """Give a command the fields ``names`` (all of them when none are named) of the settings
    dataclass ``cls`` as options.

    Each option's default, help, bounds, placeholder, variable and panel come from the field's
    metadata (:func:`setting`, ``config.knob``); its flag is ``--field-name`` unless the field
    names its ``flags``, and a boolean field that defaults to on gets ``--field/--no-field``,
    one that defaults to off a plain ``--field``. A field without its own panel takes
    ``panel`` (a name, or a function of the field's name). The command takes them as keyword
    arguments under their field names (``**kwargs``; :func:`from_options` builds ``cls``).
    """
    import typer

    from .durations import duration_option

    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    names = names or tuple(by_name)

    def option(name: str) -> inspect.Parameter:
        f = by_name[name]
        meta = f.metadata
        decls = list(meta.get("flags") or ())
        if not decls and hints[name] is bool:
            decls = [f"{flag_of(name)}/--no-{flag_of(name)[2:]}" if f.default else flag_of(name)]
        extra: dict = {}
        if meta.get("duration") and hints[name] is not str:
            extra["parser"] = duration_option(meta.get("min") or 0.0)
            extra["metavar"] = "DURATION"
        else:
            extra.update({k: meta[k] for k in ("min", "max") if meta.get(k) is not None})
            if meta.get("duration"):
                extra["metavar"] = "DURATION"
        if meta.get("metavar"):
            extra["metavar"] = meta["metavar"]
        if meta.get("envvar"):
            extra.update(envvar=meta["envvar"], show_envvar=True)
        where = meta.get("panel") or (panel(name) if callable(panel) else panel)
        if where:
            extra["rich_help_panel"] = where
        info = typer.Option(*decls, help=meta.get("help"), **extra)
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        return inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            default=default,
            annotation=Annotated[hints[name], info],
        )

    def decorate(fn):
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        params = own + [option(n) for n in names]

        @functools.wraps(fn)
        def command(**kwargs):
            return fn(**kwargs)

        command.__signature__ = sig.replace(parameters=params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        command.__annotations__["return"] = sig.return_annotation
        return command

    return decorate


__all__ = [
    "DATA_DIR",
    "DEFAULT_TRACE_DB",
    "config_options",
    "duration_seconds",
    "field_names",
    "flag_of",
    "from_options",
    "setting",
]
