"""Step costs measured where a what-if goes: a short, bounded sweep of a running server
(``tokenmill plan REC --profile --url URL``), or of a local engine started with the
recording's setup (``--profile`` alone: :func:`serve_locally`), kept beside the recording and
fitted with it.

A recording prices only the batches it ran: a quiet one never ran the decode batches that
twice its traffic builds, so those steps are priced by extrapolation, which is optimistic
exactly near capacity. The sweep fills that in. For each prompt length of :data:`CONTEXTS`
(those the server's context holds) and each batch size from 1 to the recording's
``max_num_seqs`` (doubling, and ``max_num_seqs`` itself; as many as the KV pool holds at once),
it sends that many requests at once, each a prompt of fresh token ids, drawn anew every sweep
(no prefix-cache hit, not even on a server swept before)
and :data:`DECODE_TOKENS` answer tokens with ``ignore_eos``: the prompts are prefilled
together (chunks up to the token budget, mixed with the first decodes), then the batch
decodes at that size. It stops when ``budget_s`` is spent (after its first level at least),
smallest prompts first, so a slow host still gets the batch sizes. Then it fetches what the sweep added to the server's store
(``GET /admin/dump?since=``, with the engine's config event) into :func:`profile_path` beside the recording.

A profile belongs to one engine setup: :func:`check_profile` refuses one from another model,
precision or device (one line). Its steps join the recording's in the step-cost fit
(:func:`~tokenmill.plan.step_cost.fit_step_cost`'s ``extra``); its requests are never
replayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.engine.config import EngineConfig
from tokenmill.telemetry.recorded_config import RecordedConfig

#: the sweep's prompt lengths (tokens), each clipped to what the context holds
CONTEXTS = (128, 512)
#: answer tokens of each sweep request: its batch decodes this many steps
DECODE_TOKENS = 32
#: the sweep's default time budget (s)
BUDGET_S = 90.0
#: the recording's config fields a profile must share (what changes a step's cost)
SAME_SETUP = ("model", "quantization", "int8_compute_path", "engine_device", "dtype")


class ProfileError(ValueError):
    """A profile cannot be made or used (one line)."""


def profile_path(recording: str | Path) -> Path:
    """Where the profile of ``recording`` (a store file or a dump folder) lives."""
    p = Path(recording)
    return p.with_name(p.name + ".profile.duckdb")


def batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below ``max_num_seqs``, and ``max_num_seqs`` itself."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return [*out, max_num_seqs]


@dataclass
class SweepLevel:
    prompt_tokens: int
    batch: int
    seconds: float
    failed: int = 0


@dataclass
class Sweep:
    """What a sweep ran."""

    levels: list[SweepLevel] = field(default_factory=list)
    skipped: list[tuple[int, int]] = field(default_factory=list)  # (prompt, batch) not run
    seconds: float = 0.0


def plan_levels(cfg: RecordedConfig, num_blocks: int) -> list[tuple[int, int]]:
    """``(prompt tokens, batch)`` in sweep order: each context's batch sizes, as many requests
    as the KV pool holds at once (90% of it)."""
    return levels_for(
        cfg.max_model_len or 1 << 20, int(cfg.max_num_seqs or 1), num_blocks * cfg.block_size
    )


def levels_for(max_len: int, seqs: int, kv_tokens: int) -> list[tuple[int, int]]:
    """``(prompt tokens, batch)`` in sweep order for an engine of ``seqs`` sequences at once, a
    context of ``max_len`` and a KV cache of ``kv_tokens`` (90% of it used)."""
    pool = int(0.9 * kv_tokens)
    levels = []
    for ctx in CONTEXTS:
        ctx = min(ctx, max_len - DECODE_TOKENS - 1)
        if ctx < 1:
            continue
        fits = max(1, pool // (ctx + DECODE_TOKENS))
        for b in batch_sizes(seqs):
            levels.append((ctx, min(b, fits)))
    # a batch the pool clipped may repeat a smaller one: once is enough
    return list(dict.fromkeys(levels))


async def _level(client, model: str, prompt_tokens: int, batch: int, rng) -> int:
    """Send ``batch`` requests at once; the number that failed."""

    async def one() -> bool:
        ids = [rng.randrange(1000, 30000) for _ in range(prompt_tokens)]
        body = {"model": model, "prompt": ids, "max_tokens": DECODE_TOKENS, "ignore_eos": True,
                "temperature": 0.0}  # fmt: skip
        try:
            r = await client.post("/v1/completions", json=body)
        except Exception:
            return False
        return r.status_code == 200

    ok = await asyncio.gather(*(one() for _ in range(batch)))
    return sum(not o for o in ok)


def checked_url(url: str) -> str:
    """``url`` as a server's root (:func:`~tokenmill.telemetry.remote.normalize_url`), once it
    names a host and a valid port.

    Raises:
        ProfileError: not such a URL (one line).
    """
    from urllib.parse import urlsplit

    from tokenmill.telemetry.remote import normalize_url

    base = normalize_url(url)
    try:
        parts = urlsplit(base)
        parts.port  # noqa: B018 (raises on a port out of range or not a number)
    except ValueError as exc:
        raise ProfileError(f"--url {url!r} is not a server's URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ProfileError(f"--url {url!r} is not a server's URL (http://HOST:PORT)")
    return base


async def _served_model(client, url: str) -> str:
    """The first model ``/v1/models`` lists.

    Raises:
        ProfileError: the server does not answer, or answers no OpenAI model list (one line).
    """
    import httpx

    try:
        r = await client.get("/v1/models")
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise ProfileError(f"--profile: {url} does not answer ({exc})") from None
    try:
        data = r.json().get("data") if r.status_code == 200 else None
    except (ValueError, AttributeError):
        data = None
    if (
        not data
        or not isinstance(data, list)
        or not isinstance(data[0], dict)
        or not data[0].get("id")
    ):
        raise ProfileError(
            f"--profile: {url}/v1/models answered {r.status_code} without an OpenAI model list"
        )
    return str(data[0]["id"])


def run_sweep(url: str, cfg: RecordedConfig, num_blocks: int, *, api_key: str | None = None,
              budget_s: float = BUDGET_S, seed: int | None = None) -> Sweep:  # fmt: skip
    """Run the sweep against the server at ``url``.

    Raises:
        ProfileError: the server does not answer, or serves no model.
    """
    import httpx

    url = checked_url(url)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    sweep = Sweep()

    async def go() -> None:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as client:
            model = await _served_model(client, url)
            t0 = time.monotonic()
            todo = plan_levels(cfg, num_blocks)
            for i, (ctx, b) in enumerate(todo):
                if sweep.levels and time.monotonic() - t0 > budget_s:
                    sweep.skipped = todo[i:]
                    break
                s = time.monotonic()
                failed = await _level(client, model, ctx, b, rng)
                sweep.levels.append(SweepLevel(ctx, b, time.monotonic() - s, failed))
            sweep.seconds = time.monotonic() - t0

    asyncio.run(go())
    if sweep.levels and all(lv.failed == lv.batch for lv in sweep.levels):
        raise ProfileError(f"--profile: every sweep request to {url} failed")
    return sweep


def make_profile(url: str, recording: Path, cfg: RecordedConfig, num_blocks: int, *,
                 api_key: str | None = None, admin_key: str | None = None,
                 budget_s: float = BUDGET_S) -> tuple[Path, Sweep]:  # fmt: skip
    """Sweep ``url`` and fetch its steps into :func:`profile_path` of ``recording``.

    Raises:
        ProfileError: the sweep or the fetch failed (one line).
    """
    from tokenmill.telemetry.remote import FetchError, fetch_dump

    base = checked_url(url)
    sweep = run_sweep(base, cfg, num_blocks, api_key=api_key, budget_s=budget_s)
    time.sleep(2.0)  # the store flushes its last rows
    out = profile_path(recording)
    # the sweep is the store's latest stretch; a window dump carries the config in force
    since = f"{int(sweep.seconds) + 3}s"
    try:
        fetch_dump(base, out, since=since, api_key=admin_key or api_key, overwrite=True)
    except FetchError as exc:
        raise ProfileError(
            f"--profile: the sweep ran but its steps could not be fetched ({exc})"
        ) from None
    return out, sweep


async def _streamed(client, model: str, prompt_tokens: int, rng, upstream: str) -> dict:
    """One streamed sweep request to another engine, read as the proxy reads one
    (:class:`~tokenmill.proxy.observe.Exchange`): its ``requests`` row."""
    import httpx

    from tokenmill.proxy.observe import Exchange, new_trace

    ids = [rng.randrange(1000, 30000) for _ in range(prompt_tokens)]
    body = {"model": model, "prompt": ids, "max_tokens": DECODE_TOKENS, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    trace_id, span_id, _ = new_trace(None)
    ex = Exchange(time.time_ns(), "completions", trace_id, span_id, upstream, model=model,
                  stream=True, max_tokens=DECODE_TOKENS)  # fmt: skip
    ex.counted_prompt_tokens = prompt_tokens
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            ex.http_status = r.status_code
            if r.status_code != 200:
                await r.aread()
                ex.fail("upstream_error", f"HTTP {r.status_code}")
            else:
                async for piece in r.aiter_bytes():
                    ex.on_bytes(piece)
    except httpx.HTTPError as exc:
        ex.fail("upstream_unreachable", f"{type(exc).__name__}: {exc}"[:200])
    ex.end_ns = time.time_ns()
    return ex.request_row()


def sweep_upstream(url: str, recording: Path, slots: int, kv_tokens: int, *,
                   api_key: str | None = None, budget_s: float = BUDGET_S,
                   seed: int | None = None) -> tuple[Path, Sweep]:  # fmt: skip
    """Sweep another engine at ``url`` (itself, or the proxy in front of it) as :func:`run_sweep`
    sweeps ours, batches up to its ``slots``, prompts as long as a slot's share of
    ``kv_tokens`` holds; each answer timed as the proxy times one (client-side TTFT and ITL),
    its rows written to :func:`profile_path` of ``recording``.

    Raises:
        ProfileError: the server does not answer, serves no model, or failed every request.
    """
    import httpx

    from tokenmill.telemetry.store import TraceStore

    url = checked_url(url)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    sweep, rows = Sweep(), []

    async def go() -> None:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as client:
            model = await _served_model(client, url)
            t0 = time.monotonic()
            todo = levels_for(max(1, kv_tokens // max(1, slots)), slots, kv_tokens)
            for i, (ctx, b) in enumerate(todo):
                if sweep.levels and time.monotonic() - t0 > budget_s:
                    sweep.skipped = todo[i:]
                    break
                s = time.monotonic()
                got = await asyncio.gather(
                    *(_streamed(client, model, ctx, rng, url) for _ in range(b))
                )
                failed = sum(g["error_type"] is not None or g["first_token_ns"] is None
                             for g in got)  # fmt: skip
                sweep.levels.append(SweepLevel(ctx, b, time.monotonic() - s, failed))
                rows.extend(got)
            sweep.seconds = time.monotonic() - t0

    asyncio.run(go())
    if sweep.levels and all(lv.failed == lv.batch for lv in sweep.levels):
        raise ProfileError(f"--profile: every sweep request to {url} failed")
    out = profile_path(recording)
    out.unlink(missing_ok=True)
    store = TraceStore(out)
    try:
        for row in rows:
            store.submit("requests", row)
    finally:
        store.close()
    return out, sweep


@contextlib.contextmanager
def serve_locally(config: EngineConfig, work: Path) -> Iterator[str]:
    """A ``tokenmill serve`` of ``config`` (the recording's engine settings: every field that
    differs from the defaults, fault drills left out) on a free local port, its store and log
    in ``work``; yields its base URL and stops it after.

    Raises:
        ProfileError: it did not start (its last log line).
    """
    import yaml

    from tokenmill.bench.scenario import ScenarioError, _free_port, start_server, stop_server
    from tokenmill.engine.config import EngineConfig as Defaults

    default = Defaults()
    settings = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if not f.name.startswith("fault_") and getattr(config, f.name) != getattr(default, f.name)
    }
    (work / "serve.yaml").write_text(yaml.safe_dump(settings))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tokenmill.engine.cli", "serve", "--config",
           str(work / "serve.yaml"), "--port", str(port), "--trace-db",
           str(work / "traces.duckdb")]  # fmt: skip
    try:
        server = start_server(cmd, work, dict(os.environ), url)
    except ScenarioError as exc:
        raise ProfileError(f"--profile: the local engine did not start ({exc})") from None
    try:
        yield url
    finally:
        stop_server(server)


def check_profile(recorded: RecordedConfig, profile: RecordedConfig, label: str) -> None:
    """Refuse a profile made on another setup than the recording's.

    Raises:
        ProfileError: one line naming the field that differs.
    """
    if not profile.recorded:
        raise ProfileError(f"{label}: the profile records no engine config")
    for name in SAME_SETUP:
        mine, theirs = getattr(recorded, name), getattr(profile, name)
        if mine != theirs:
            raise ProfileError(
                f"{label}: the profile ran {name} {theirs!r}, the recording {mine!r}: a profile "
                "prices steps only for the setup it ran"
            )
