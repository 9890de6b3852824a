"""A running server, seen from outside: its base URL and the client of its admin-only
``GET /admin/dump`` (the server side is ``engine/api/admin.py``).

``tokenmill dump --url``, ``tokenmill diagnose --url`` and the console's live source all fetch
through :func:`fetch_dump`; ``tokenmill bench`` and the console normalize a server URL with
:func:`normalize_url`. Importing this module is cheap (httpx and DuckDB are imported on use).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


class FetchError(Exception):
    """A dump could not be fetched (one-line message).

    ``kind`` says which step failed, so that a command can add its own hint: ``url`` (a
    malformed URL), ``connect``, ``timeout``, ``status`` (the server answered, not 200),
    ``http`` (another transfer failure), ``write`` (the local file), ``bad_dump`` (what came
    back is not a dump of this schema version) and ``exists`` (``out`` appeared meanwhile and
    ``overwrite`` is off).
    """

    def __init__(self, message: str, kind: str, detail: str = ""):
        super().__init__(message)
        self.kind = kind
        self.detail = detail  # for ``url``: what is wrong with it


def normalize_url(url: str) -> str:
    """``host:port``, ``http://host:port/`` or ``.../v1`` → ``http://host:port`` (the server's
    root: ``/v1/...``, ``/health`` and ``/admin/dump`` hang below it)."""
    base = (url or "").strip()
    scheme, sep, rest = base.partition("://")
    if not sep:
        scheme, rest = "http", base
    return f"{scheme}://{rest.rstrip('/').removesuffix('/v1')}"


def server_message(resp) -> str:
    """The message of an OpenAI-shaped error body, else the start of the body (one line)."""
    try:
        message = resp.json()["error"]["message"]
    except Exception:
        message = resp.text.strip()[:200] or resp.reason_phrase
    return (str(message).splitlines() or [""])[0]


def fetch_dump(
    url: str,
    out: str | Path,
    *,
    since: str | None = None,
    until: str | None = None,
    after_ns: int | None = None,
    api_key: str | None = None,
    timeout_s: float = 300.0,
    overwrite: bool = True,
    verify: bool = True,
) -> None:
    """GET ``{url}/admin/dump`` into ``out``.

    The body goes to a temporary file next to ``out``, is checked with
    :func:`~tokenmill.telemetry.dump.open_dump` and only then moved into place: a failed fetch
    leaves nothing behind.

    Args:
        url: the server (normalized with :func:`normalize_url`).
        since, until: the window as the endpoint takes it (``10m``; None = unbounded).
        after_ns: instead, only what reached the store from this time on (Unix ns).
        api_key: the server's admin key (sent as a bearer token).
        timeout_s: how long the server may take (connecting: at most 10 s).
        overwrite: replace an existing ``out``; off, an ``out`` that appeared meanwhile is an
            ``exists`` error.
        verify: read every row of the fetched dump once (else only its header and schema).

    Raises:
        FetchError: one line naming the server or the file; see its ``kind``.
    """
    out = Path(out)
    base = normalize_url(url)
    params = {
        k: v
        for k, v in (("since", since), ("until", until), ("after_ns", after_ns))
        if v is not None
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    tmp = out.parent / f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}.part"
    try:
        _download(url, base, params, headers, timeout_s, tmp, out)
        _check_and_place(tmp, out, overwrite=overwrite, verify=verify)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _download(
    url: str, base: str, params: dict, headers: dict, timeout_s: float, tmp: Path, out: Path
) -> None:
    """The body of ``{base}/admin/dump`` into ``tmp``; every failure a :class:`FetchError`
    naming the server (``url`` as given, for a malformed one) or ``out``."""
    import httpx

    try:
        with httpx.stream(
            "GET",
            f"{base}/admin/dump",
            params=params,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
        ) as resp:
            if resp.status_code != 200:
                resp.read()
                raise FetchError(
                    f"{base} answered {resp.status_code}: {server_message(resp)}", "status"
                )
            with open(tmp, "wb") as f:
                for chunk in resp.iter_bytes():
                    f.write(chunk)
    except httpx.ConnectError as exc:
        reason = str(exc).strip() or "connection failed"
        if "refused" in reason.lower():
            reason = "connection refused (is the server running?)"
        raise FetchError(f"cannot connect to {base}: {reason}", "connect") from None
    except httpx.TimeoutException:
        raise FetchError(f"{base} did not answer within {timeout_s:g} s", "timeout") from None
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
        raise FetchError(f"bad URL {url!r}: {exc}", "url", str(exc)) from None
    except httpx.HTTPError as exc:
        raise FetchError(
            f"fetching the dump from {base} failed: {type(exc).__name__}: {exc}", "http"
        ) from None
    except OSError as exc:
        raise FetchError(f"cannot write {out}: {exc.strerror or exc}", "write") from None


def _check_and_place(tmp: Path, out: Path, *, overwrite: bool, verify: bool) -> None:
    """The fetched ``tmp`` checked as a dump, then moved to ``out``."""
    from .dump import DumpError, open_dump

    try:
        open_dump(tmp, verify=verify).close()
    except DumpError as exc:
        detail = str(exc).removeprefix(str(tmp) + ": ")
        raise FetchError(f"the server sent a bad dump: {detail}", "bad_dump") from None
    if not overwrite and out.exists():
        raise FetchError(f"{out} already exists", "exists")
    try:
        os.replace(tmp, out)
    except OSError as exc:
        raise FetchError(f"cannot write {out}: {exc.strerror or exc}", "write") from None
