"""The streaming client of ``tokenmill bench``: sends the requests on schedule and clocks them.

Clocks are ``time.perf_counter()`` offsets (s) from the run's start; results are in ms.
For each request (all from the client's point of view, one ``httpx.AsyncClient``, HTTP/1.1,
no connection limit, proxies from the environment ignored):

- **send** — the moment just before the request is handed to httpx;
- **TTFT** (ms) — send → arrival of the first SSE chunk that carries a token: a non-empty
  ``choices[].delta.content`` (chat) or ``choices[].text`` (completions). A role-only or
  empty frame, a usage frame and a keep-alive comment (``: ...``) never count;
- **ITL** (ms) — the gaps between the arrivals of consecutive token-carrying chunks (a chunk
  holding several tokens is one arrival);
- **E2E** (ms) — send → arrival of ``data: [DONE]``;
- **TPOT** (ms) — ``(E2E − TTFT) / (output_tokens − 1)``, with ``output_tokens`` from the final
  usage frame (``stream_options.include_usage``), else the count of token-carrying chunks;
  undefined (None) for a single token;
- **lag** (ms) — send − planned send. Open loop: planned is the arrival time drawn by
  :func:`~.phases.arrival_times`; closed loop: the moment the worker became free. A growing lag
  means the client, not the server, is the bottleneck.

Every request sends ``x-request-id: bench-<run>-<i>`` (the server stores it as
``requests.client_request_id``, so :mod:`.record` can join client and server timings) and a
fresh W3C ``traceparent`` (``00-<32 hex trace id>-<16 hex span id>-01``) that the server
continues.

Client aborts (``abort_fraction``, the C05 and error-spike drills): a request chosen by
:func:`abort_plan` closes its connection after its k-th token-carrying chunk, as a user who
closes the tab would; it counts as ``aborted``, neither completed nor failed.

Open loop (``request_rate``): requests are sent at their planned times whatever the server does.
Closed loop (``concurrency``): N workers each send a request, wait for its end, send the next;
in a phase with multiplier m only ``max(1, round(N·m))`` workers send. Sending stops at the end of
the last phase (or after ``num_requests``); requests in flight then get ``drain_timeout`` s to
finish before they are cancelled (reported as failed, ``error = "cancelled at drain timeout"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np

from tokenmill.engine.api.traceparent import new_traceparent
from tokenmill.telemetry.remote import normalize_url

from .phases import Phase, arrival_times, phase_bounds
from .workload import BenchRequest, Workload


class BenchError(Exception):
    """The run cannot start (unreachable server, refused probe): one line."""


@dataclass
class RequestResult:
    """One request's client-side record. Offsets in s from the run's start, timings in ms."""

    index: int
    request_id: str
    trace_id: str
    phase: int
    tag: str = ""
    planned_s: float = 0.0
    sent_s: float = 0.0
    done_s: float | None = None
    sent_wall_ns: int = 0
    ok: bool = False
    error: str | None = None
    http_status: int | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    chunk_s: list[float] = field(default_factory=list)  # token-chunk arrivals, s after send
    output_tokens: int = 0
    prompt_tokens: int = 0
    usage_reported: bool = False
    abort_after: int | None = None  # planned client abort after this many token chunks
    aborted: bool = False  # the client closed the stream on purpose (abort_after reached)

    @property
    def lag_ms(self) -> float:
        return (self.sent_s - self.planned_s) * 1000.0

    @property
    def tpot_ms(self) -> float | None:
        if self.ttft_ms is None or self.e2e_ms is None or self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "request_id": self.request_id,
            "trace_id": self.trace_id,
            "phase": self.phase,
            "tag": self.tag,
            "planned_s": round(self.planned_s, 6),
            "sent_s": round(self.sent_s, 6),
            "done_s": None if self.done_s is None else round(self.done_s, 6),
            "sent_wall_ns": self.sent_wall_ns,
            "ok": self.ok,
            "error": self.error,
            "http_status": self.http_status,
            "ttft_ms": self.ttft_ms,
            "tpot_ms": self.tpot_ms,
            "e2e_ms": self.e2e_ms,
            "itl_ms": [round(x, 3) for x in self.itl_ms],
            "lag_ms": round(self.lag_ms, 3),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "aborted": self.aborted,
        }


@dataclass
class BenchConfig:
    """What to run. ``request_rate`` (requests/s, may be ``inf``) selects the open loop,
    ``concurrency`` the closed loop (exactly one of them)."""

    url: str
    workload: Workload
    phases: list[Phase]
    model: str | None = None
    api_key: str | None = None
    endpoint: str = "chat"
    request_rate: float | None = None
    burstiness: float = 1.0
    concurrency: int | None = None
    num_requests: int | None = None
    seed: int = 0
    timeout: float = 600.0
    drain_timeout: float = 300.0
    ignore_eos: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    abort_fraction: float = 0.0

    @property
    def base_url(self) -> str:
        return normalize_url(self.url)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


@dataclass
class BenchRun:
    """A finished run: its results (in index order), start and span."""

    config: BenchConfig
    model: str
    run_id: str
    results: list[RequestResult]
    started_wall_ns: int
    duration_s: float  # run start → last completion (or the end of the last phase, if later)
    send_end_s: float  # when sending stopped


def _headers(api_key: str | None, request_id: str, traceparent: str) -> dict:
    h = {"x-request-id": request_id, "traceparent": traceparent, "accept": "text/event-stream"}
    if api_key:
        h["authorization"] = f"Bearer {api_key}"
    return h


def _error_message(body: bytes) -> str:
    try:
        msg = json.loads(body)["error"]["message"]
    except Exception:
        msg = body.decode("utf-8", "replace").strip()[:200]
    return (str(msg).splitlines() or [""])[0]


def abort_plan(seed: int, index: int, fraction: float, max_tokens: int) -> int | None:
    """Whether request ``index`` is one the client aborts, and after how many token chunks.

    Deterministic per (seed, index): aborted with probability ``fraction`` (0..1), after k
    chunks drawn uniformly from 1..max(1, max_tokens // 2), so the stream is cut mid-way.
    Returns k, or None for a request that runs to the end.
    """
    if fraction <= 0:
        return None
    rng = np.random.default_rng([seed, index, 0xAB0])
    if rng.random() >= fraction:
        return None
    return int(rng.integers(1, max(1, max_tokens // 2) + 1))


def make_client(timeout: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=10.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,
    )


async def send_one(
    client: httpx.AsyncClient,
    cfg: BenchConfig,
    model: str,
    req: BenchRequest,
    res: RequestResult,
    t0: float,
) -> RequestResult:
    """Send ``req``, stream the answer and fill ``res`` (never raises but CancelledError)."""
    caller = new_traceparent()  # a fresh trace, sampled, for the server to join
    traceparent, res.trace_id = caller.header(), caller.trace_id
    body = req.body(
        cfg.endpoint,
        model,
        ignore_eos=cfg.ignore_eos,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
    )
    headers = _headers(cfg.api_key, res.request_id, traceparent)
    content_key = "delta" if cfg.endpoint == "chat" else None
    chunks: list[float] = []
    done_at: float | None = None
    usage = None
    res.sent_wall_ns = time.time_ns()
    t_send = time.perf_counter()
    res.sent_s = t_send - t0
    try:
        async with client.stream(
            "POST", cfg.base_url + cfg.path, json=body, headers=headers
        ) as resp:
            res.http_status = resp.status_code
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {_error_message(await resp.aread())}"
                return res
            buf = b""
            async for raw in resp.aiter_raw():
                now = time.perf_counter()
                buf += raw
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    line = line.rstrip(b"\r")
                    if not line.startswith(b"data:"):
                        continue  # blank separator, ": keep-alive" comment, event:/id: fields
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done_at = now
                        break
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        res.error = f"bad SSE data: {data[:80].decode('utf-8', 'replace')}"
                        return res
                    if not isinstance(obj, dict):
                        continue
                    if obj.get("error"):
                        err = obj["error"]
                        msg = err.get("message") if isinstance(err, dict) else err
                        res.error = f"server error in stream: {msg}"
                        return res
                    for choice in obj.get("choices") or ():
                        if content_key:
                            text = (choice.get("delta") or {}).get("content")
                        else:
                            text = choice.get("text")
                        if text:
                            chunks.append(now - t_send)
                            break
                    if obj.get("usage"):
                        usage = obj["usage"]
                    if res.abort_after is not None and len(chunks) >= res.abort_after:
                        res.aborted = True
                        break
                if done_at is not None or res.aborted:
                    break  # leaving the block closes the connection: the server aborts
    except httpx.TimeoutException:
        res.error = f"timed out after {cfg.timeout:g} s"
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    finally:
        res.chunk_s = chunks
        res.done_s = time.perf_counter() - t0
        if chunks:
            res.ttft_ms = chunks[0] * 1000.0
            res.itl_ms = [(b - a) * 1000.0 for a, b in itertools.pairwise(chunks)]
        res.output_tokens = len(chunks)
        if usage:
            res.usage_reported = True
            res.output_tokens = int(usage.get("completion_tokens") or len(chunks))
            res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        else:
            res.prompt_tokens = req.prompt_tokens
    if res.aborted:
        res.error = f"aborted by the client after {len(chunks)} token chunk(s)"
        return res
    if res.error is None and done_at is None:
        res.error = "the stream ended before [DONE]"
    if res.error is None:
        res.e2e_ms = (done_at - t_send) * 1000.0
        res.done_s = done_at - t0
        res.ok = True
    return res


async def probe(client: httpx.AsyncClient, cfg: BenchConfig, run_id: str) -> str:
    """Check the server before the clock starts: ``GET /v1/models`` (the model name, when not
    given) and one streamed request of one token. Returns the model name.

    Raises:
        BenchError: unreachable, refused or failing (one line).
    """
    base = cfg.base_url
    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    try:
        resp = await client.get(base + "/v1/models", headers=headers, timeout=30.0)
    except httpx.ConnectError as exc:
        reason = (str(exc).strip().splitlines() or [""])[0] or "connection failed"
        if "refused" in reason.lower() or "all connection attempts failed" in reason.lower():
            reason = "connection refused (is the server running?)"
        raise BenchError(f"cannot connect to {base}: {reason}") from None
    except httpx.TimeoutException:
        raise BenchError(f"{base} did not answer within 30 s") from None
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
        raise BenchError(f"bad --url {cfg.url!r}: {exc}") from None
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach {base}: {type(exc).__name__}: {exc}") from None
    if resp.status_code != 200:
        raise BenchError(
            f"{base}/v1/models answered {resp.status_code}: {_error_message(resp.content)}"
        )
    model = cfg.model
    if model is None:
        try:
            model = resp.json()["data"][0]["id"]
        except Exception:
            raise BenchError(f"{base}/v1/models lists no model; give --model") from None
    req = BenchRequest(-1, [{"role": "user", "content": "Hello"}], 1, 1, "probe")
    res = RequestResult(-1, f"bench-{run_id}-probe", "", -1)
    probe_cfg = dataclasses.replace(cfg, ignore_eos=False, timeout=120.0)
    await send_one(client, probe_cfg, model, req, res, time.perf_counter())
    # an error inside a 200 stream (e.g. a request the engine failed) still proves the server
    # answers; the run itself will count such errors
    if not res.ok and not (res.http_status == 200 and (res.error or "").startswith("server error")):
        raise BenchError(f"the first request to {base}{cfg.path} failed: {res.error}")
    return model


class _Ticker:
    """Progress callbacks (all optional): ``sent(res)``, ``done(res)``, ``tick(elapsed_s)``."""

    def __init__(self, progress):
        self.p = progress

    def __call__(self, name: str, *args):
        fn = getattr(self.p, name, None) if self.p is not None else None
        if fn is not None:
            fn(*args)


async def run(cfg: BenchConfig, progress=None, model: str | None = None) -> BenchRun:
    """Probe the server, then run the phases; returns the results.

    Raises:
        BenchError: the probe failed (nothing was measured).
    """
    if (cfg.request_rate is None) == (cfg.concurrency is None):
        raise BenchError("give exactly one of a request rate (open loop) or a concurrency")
    run_id = secrets.token_hex(4)
    notify = _Ticker(progress)
    async with make_client(cfg.timeout) as client:
        model = await probe(client, cfg, run_id)
        results: list[RequestResult] = []
        inflight: set[asyncio.Task] = set()
        started_wall_ns = time.time_ns()
        t0 = time.perf_counter()

        async def one(
            i: int, phase: int, planned: float, req: BenchRequest | None = None
        ) -> RequestResult:
            req = req if req is not None else cfg.workload.make(i)
            res = RequestResult(i, f"bench-{run_id}-{i}", "", phase, req.tag, planned_s=planned)
            res.abort_after = abort_plan(cfg.seed, i, cfg.abort_fraction, req.max_tokens)
            results.append(res)
            notify("sent", res)
            try:
                await send_one(client, cfg, model, req, res, t0)
            except asyncio.CancelledError:
                res.error = "cancelled at drain timeout"
                res.done_s = time.perf_counter() - t0
                raise
            finally:
                notify("done", res)
            return res

        async def ticker():
            while True:
                notify("tick", time.perf_counter() - t0)
                await asyncio.sleep(0.2)

        tick_task = asyncio.create_task(ticker()) if progress is not None else None
        try:
            if cfg.request_rate is not None:
                await _open_loop(cfg, one, inflight, t0)
            else:
                await _closed_loop(cfg, one, inflight, t0)
            send_end_s = time.perf_counter() - t0
            if inflight:
                _, pending = await asyncio.wait(inflight, timeout=cfg.drain_timeout)
                for task in pending:
                    task.cancel()
                if pending:
                    await asyncio.wait(pending)
        finally:
            if tick_task is not None:
                tick_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await tick_task
            for task in inflight:
                task.cancel()
    results.sort(key=lambda r: r.index)
    last_done = max((r.done_s or 0.0 for r in results), default=0.0)
    phases_end = sum(p.duration_s for p in cfg.phases)
    duration = max(last_done, phases_end if math.isfinite(phases_end) else 0.0)
    return BenchRun(cfg, model, run_id, results, started_wall_ns, duration, send_end_s)


def _spawn(coro, inflight: set) -> asyncio.Task:
    task = asyncio.create_task(coro)
    inflight.add(task)
    task.add_done_callback(inflight.discard)
    return task


async def _open_loop(cfg: BenchConfig, one: Callable, inflight: set, t0: float) -> None:
    rng = np.random.default_rng(cfg.seed)
    arrivals = arrival_times(
        cfg.request_rate, cfg.burstiness, cfg.phases, rng, max_requests=cfg.num_requests
    )
    for i, (planned, phase) in enumerate(arrivals):
        req = cfg.workload.make(i)  # built while waiting, so it adds no lag
        delay = t0 + planned - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        _spawn(one(i, phase, planned, req), inflight)
    # the last phase runs to its end even when its final arrival came earlier
    end = sum(p.duration_s for p in cfg.phases)
    if math.isfinite(end):
        delay = t0 + end - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)


async def _closed_loop(cfg: BenchConfig, one: Callable, inflight: set, t0: float) -> None:
    bounds = phase_bounds(cfg.phases)
    active = [max(1, round(cfg.concurrency * p.multiplier)) for p in cfg.phases]
    counter = iter(range(cfg.num_requests) if cfg.num_requests is not None else _count())

    def phase_at(t: float) -> int | None:
        for k, (start, end) in enumerate(bounds):
            if start <= t < end:
                return k
        return None

    async def worker(w: int):
        free_at = time.perf_counter() - t0
        while True:
            now = time.perf_counter() - t0
            k = phase_at(now)
            if k is None:
                return
            if w >= active[k]:  # idle in this phase: wait for the next one
                await asyncio.sleep(max(0.0, bounds[k][1] - now))
                free_at = time.perf_counter() - t0
                continue
            i = next(counter, None)
            if i is None:
                return
            await one(i, k, max(free_at, bounds[k][0]))
            free_at = time.perf_counter() - t0

    tasks = [_spawn(worker(w), inflight) for w in range(max(active))]
    end = bounds[-1][1]
    # return when sending stops: at the end of the last phase (the workers' requests in flight
    # then drain in run()), or when the request count ran out and every worker is done
    timeout = None if math.isinf(end) else max(0.0, t0 + end - time.perf_counter())
    await asyncio.wait(tasks, timeout=timeout)


def _count():
    i = 0
    while True:
        yield i
        i += 1
