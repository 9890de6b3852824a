"""``tokenmill dashboard``: checks the source, then runs the Streamlit console (``app.py``)
on it.

The root ``tokenmill`` command finds :data:`app` here by name; the source module, Streamlit and
DuckDB are imported only when the command runs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from tokenmill.telemetry.cli import fail, out

app = typer.Typer(add_completion=False)


# the options of ``tokenmill dashboard``
_Source = Annotated[
    list[str] | None,
    typer.Option(
        metavar="PATH|URL",
        help="A trace dump or closed store file, or a running server's URL (then a fresh "
        "dump is fetched every --refresh s with the admin key). Repeat it, or give a "
        "folder of dumps, for a fleet (one dump per replica; the sidebar picks one or all).",
    ),
]
_Host = Annotated[str, typer.Option(help="Address the console listens on.")]
_Port = Annotated[int, typer.Option(min=1, max=65535)]
_Refresh = Annotated[float, typer.Option(min=1.0, help="Seconds between dumps of a live server.")]
_AdminKey = Annotated[
    str | None,
    typer.Option(
        "--admin-key",
        envvar="TOKENMILL_ADMIN_KEY",
        help="The server's admin key (URL sources).",
    ),
]
_Baseline = Annotated[
    str | None,
    typer.Option(
        metavar="PATH",
        help="An earlier dump to set beside the source on the Compare page (BEFORE).",
    ),
]


@app.command()
def dashboard(
    source: _Source = None,
    host: _Host = "127.0.0.1",
    port: _Port = 8501,
    refresh: _Refresh = 10.0,
    api_key: _AdminKey = None,
    baseline: _Baseline = None,
) -> None:
    """Open the operations console (Streamlit) over a dump, a closed store or a live server."""
    from tokenmill.telemetry.store import DEFAULT_TRACE_DB

    spec, baseline = _checked_sources(source or [DEFAULT_TRACE_DB], baseline)
    _check_can_run(host, port)
    env = _console_env(spec, refresh, api_key, baseline)
    script = Path(__file__).resolve().parent / "app.py"
    cmd = [sys.executable, "-m", "streamlit", "run", str(script),
           "--server.address", host, "--server.port", str(port), "--server.headless", "true",
           "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
           "--client.toolbarMode", "minimal"]  # fmt: skip
    _announce(host, port, spec)
    raise typer.Exit(_run(cmd, env))


def _check_can_run(host: str, port: int) -> None:
    """Streamlit installed and ``host:port`` free to listen on, or one ``error:`` line."""
    import socket

    try:
        import streamlit  # noqa: F401
    except ImportError:
        fail("streamlit is not installed (pip install streamlit plotly)")
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")


def _console_env(
    spec: str, refresh: float, api_key: str | None, baseline: str | None
) -> dict[str, str]:
    """The Streamlit process's environment: this one's, plus what ``app.py`` reads of the
    command's options (``source.py``'s ``ENV_*``)."""
    import os

    from .source import ENV_API_KEY, ENV_BASELINE, ENV_REFRESH, ENV_SOURCE

    env = {**os.environ, ENV_SOURCE: spec, ENV_REFRESH: f"{refresh:g}"}
    if api_key:
        env[ENV_API_KEY] = api_key
    if baseline is not None:
        env[ENV_BASELINE] = baseline
    return env


def _checked_sources(sources: list[str], baseline: str | None) -> tuple[str, str | None]:
    """The console's source spec (one source, or a fleet's) and its ``--baseline``, checked:
    one ``error:`` line and exit 2 for one it cannot open."""
    from .fleet_source import check_fleet
    from .source import SourceError, check_source

    try:
        if len(sources) > 1 or Path(sources[0]).is_dir():  # a fleet (or a Parquet dump)
            spec = check_fleet(sources)
        else:
            spec = check_source(sources[0])
    except SourceError as exc:
        fail(str(exc))
    if baseline is not None:  # the Compare page's BEFORE (views/compare.py)
        try:
            baseline = check_source(baseline)
        except SourceError as exc:
            fail(f"--baseline: {exc}")
    return spec, baseline


def _announce(host: str, port: int, spec: str) -> None:
    """The console's address and source, and a note when it listens beyond loopback."""
    shown = f"[{host}]" if ":" in host else host
    out.print(
        f"tokenmill console: http://{shown}:{port}  (source: {spec.replace(chr(10), ', ')})",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    if not _is_loopback(host):
        out.print(
            f"note: the console has no login of its own; anyone who reaches {shown}:{port} reads "
            "the traces. Put it behind a reverse proxy that authenticates (nginx auth_basic, "
            "oauth2-proxy), or keep it on 127.0.0.1 and reach it through an SSH tunnel.",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )


def _run(cmd: list[str], env: dict[str, str]) -> int:
    """Run the Streamlit process to its end: its exit code, or 130 after Ctrl-C or SIGTERM."""
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)
    # a SIGTERM (systemd, a supervisor, a process-group kill) stops the console as Ctrl-C does:
    # the Streamlit process is stopped too, killed if it has not gone in 10 s, never orphaned
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        code = 130
    return code


def _raise_interrupt(*_) -> None:
    raise KeyboardInterrupt


def _die_with_parent() -> None:
    """In the Streamlit child before it runs: the kernel sends it SIGTERM when this process
    dies, even by SIGKILL, so the console never outlives its command (Linux's
    ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or ``localhost``: the console's own address needs no note."""
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
