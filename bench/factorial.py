"""The factorial diagnosis corpus: traffic SHAPE × FAULT × MAGNITUDE, and a healthy twin of
every shape, so the diagnoser is judged on traffic it was not tuned on.

A shape is the traffic alone and the server it meets (closed or open loop, clumps, many client
processes, tenants, long prompts, int8 weights, speculative decoding, two data-parallel
replicas, disaggregated prefill and decode, an open-loop mix of short chats and long prompts,
short chats behind one long prefix-cached system prompt, a step budget of 256 tokens); a
fault is laid on top of it from a known offset for at least 25 s (a CPU hog, a periodic job, a
KV pool too small, arrivals above what the engine sustains, whole long prefills, a system prompt
that changes every request) at one of three magnitudes. Each shape's traffic is drawn once
(``random.Random(f"f-{shape}")``), so a faulted run and its shape's twin (``f-<shape>-healthy``)
send the same base requests; the fault's own parameters are drawn from ``random.Random(run
id)``. The split is by shape: :data:`TUNE_SHAPES` may be looked at while tuning the rules,
:data:`HELDOUT_SHAPES` never. A held-out shape, once scored, becomes a tune shape and new ones
are held out: the first eleven shapes have all been looked at (``dp``, ``pd`` and ``mixed``
were held out until scored once, at 240ea34) and are tune shapes; ``sysprompt`` and ``budget``
are the held-out ones (added after, tuned on by nobody).

A fault means the same on every shape where it can: on ``dp`` a KV pool flag is each
replica's, so ``kv_pressure`` sizes the pool from a replica's share of the shape's requests and
sends 4-5 long answers *per replica*; ``overload`` counts no more capacity for two replicas
(they share the two cores). On ``pd`` ``kv_pressure`` caps the decode side's pool
(``--decode-num-gpu-blocks-override``: it holds whole requests, the prefill side a prompt until
it is sent), and ``prefill_interference``'s unchunked long prompts run on the prefill core, so
they can slow the decode core's tokens only through the two cores both share. On ``mixed``
``overload`` sends more of both classes in the shape's shares. On ``sysprompt`` the requests
share their system prompt's KV blocks, so ``kv_pressure``'s pool counts them once, and
``overload``'s extra requests carry a system prompt of the same length under their own seed
(their own, prefix-cached after their first); the cost model counts a prompt's uncached
tokens there, the question's. On ``budget`` ``prefill_interference``'s
``--no-enable-chunked-prefill`` also prefills the shape's own prompts whole (no longer split at
256 tokens), as that flag does every shape's prompts.

Runs are ``bench/corpus.py``'s :class:`~tokenmill.bench.corpus.CorpusRun`, recorded by its
:func:`~tokenmill.bench.corpus.generate`; their ``label.json`` has the corpus's keys plus
``shape``, ``fault`` (None for twins), ``magnitude`` (``mild``/``moderate``/``severe``, None
for twins) and ``fault_window_s`` (the fault's [start, end] in seconds after the first bench
step). ``benchmarks/diagnosis_generalization.py`` scores the diagnoser on it.

``python -m tokenmill.bench.factorial --out DIR [--plan small|full] [--shapes ...]
[--faults ...] [--magnitudes ...] [--split tune|heldout] [--list]`` (resumable: a run whose
``label.json`` exists is skipped); ``make factorial`` records the small plan.

Durations come from a cost model of the default model on this 2-core CPU
(:data:`PREFILL_S_PER_TOKEN`, :data:`DECODE_STEP_S`, :data:`SATURATED_S_PER_OUTPUT_TOKEN`; a
data-parallel replica's :data:`DP_PREFILL_S_PER_TOKEN` and :data:`DP_DECODE_STEP_S`): each
run's traffic is planned to last 35-50 s (:func:`traffic_s`), and ``overload`` sets its arrival
rate from the capacity the model gives (:func:`base_capacity_rps`).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .corpus import CorpusRun, generate
from .scenario import Scenario
from .scenario import _args as scenario_args

TUNE_SHAPES = (
    "closed",
    "open",
    "long",
    "int8",
    "clumped",
    "procs",
    "tenants",
    "spec",
    "dp",
    "pd",
    "mixed",
)
HELDOUT_SHAPES = ("sysprompt", "budget")
SPLITS = ("tune", "heldout")
MAGNITUDES = ("mild", "moderate", "severe")
PLANS = ("small", "full")
BLOCK_SIZE = 16  # the engine's default KV block (engine/messages.py DEFAULT_BLOCK_SIZE)

# the cost model (default model, float32, 2 cores): prefill per prompt token, a decode step at
# a small batch, and engine time per output token once the batch is large (compute-bound)
PREFILL_S_PER_TOKEN = 0.0025
DECODE_STEP_S = 0.035
SATURATED_S_PER_OUTPUT_TOKEN = 0.005
# data parallel on this CPU (--data-parallel-size 2): each replica runs one torch thread, so
# a prompt prefills at half the speed and a decode step of 1-2 requests takes ~40 ms (measured:
# f-dp-healthy, 3 clients: 1.7 s a request, 41 ms between tokens, against f-closed-healthy's
# 1.57 s and 35 ms on one engine); the two together complete no more than one engine does once
# busy (they share the two cores)
DP_PREFILL_S_PER_TOKEN = 2 * PREFILL_S_PER_TOKEN
DP_DECODE_STEP_S = 0.040
# the slowest a request's tokens come during a fault (for the drain after a step's last phase)
DRAIN_S_PER_OUTPUT_TOKEN = 0.04

TRAFFIC_S = (35.0, 50.0)  # each run's planned traffic, first request to last answer
MIN_FAULT_S = 25.0

TENANTS_FILE = "{scenarios}/factorial_tenants.toml"
FAULT_TENANT = 8  # the tenants shape's fault traffic comes from t8; t0-t7 are the shape's


def tenant_key(i: int) -> str:
    """The API key of tenant ``t<i>`` in ``scenarios/factorial_tenants.toml``."""
    return f"factorial-tenant-{i}"


def _bench(**kw) -> list[str]:
    args = []
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def _uniform(lo: int, hi: int) -> str:
    return f"uniform:{lo}:{hi}"


def _steady(load: dict, span_s, prompt, output, seed: int, start_s: float = 0.0) -> dict:
    """One load-generator step: ``load`` (``concurrency`` or ``request_rate``) held for
    ``span_s`` from ``start_s``, prompt and answer lengths uniform over their ranges."""
    args = _bench(
        **load,
        phases=f"steady:{span_s}s",
        prompt_tokens=_uniform(*prompt),
        output_tokens=_uniform(*output),
        seed=seed,
    )
    return {"start_s": start_s, "args": args}


@dataclass
class Base:
    """One shape's traffic: concurrent bench steps (``{"start_s", "args"}``), server flags, the
    request sizes it sends (for the cost model and faults that send more of the same), its
    planned length and arrival rate, and what a fault's extra steps must carry (an API key)."""

    steps: list[dict]
    server: list[str]
    prompt: tuple[int, int]
    output: tuple[int, int]
    span_s: float  # when its last step's phases end (or its last clump is sent and served)
    rate_rps: float  # its arrivals per second, estimated
    peak_running: int  # requests it has running at once at most, estimated
    params: dict
    fault_args: list[str] = field(default_factory=list)
    kv_slack_per_request: int = 0  # speculative drafts take a slot or so each
    # engine cores the requests are spread over (data parallel): a KV pool flag is per core
    replicas: int = 1
    # the server flags kv_pressure sets to its pool size (disaggregated: the decode side's)
    kv_flags: tuple[str, ...] = ("--num-gpu-blocks-override",)
    # the KV blocks its own requests hold at most, estimated (None: peak_running times the
    # largest request's); a shape whose requests are of two very different sizes says so
    kv_own_blocks: int | None = None
    # a shape of several request classes: (share of its arrivals, prompt, output) each; the
    # capacity and overload's extra traffic follow the mix (empty: prompt and output alone)
    mix: tuple[tuple[float, tuple[int, int], tuple[int, int]], ...] = ()
    # bench options its requests carry besides their sizes (a shared system prompt): overload's
    # extra requests carry them too, under their own seed
    request_args: list[str] = field(default_factory=list)


def _latency_s(prompt: float, output: float) -> float:
    return prompt * PREFILL_S_PER_TOKEN + output * DECODE_STEP_S


def _mid(r: tuple[int, int]) -> float:
    return (r[0] + r[1]) / 2


def capacity_rps(prompt: tuple[int, int], output: tuple[int, int]) -> float:
    """Requests per second the engine completes at most, for requests of these sizes: one
    request's engine time is its prefill plus its output tokens at the large-batch rate."""
    return 1.0 / (_mid(prompt) * PREFILL_S_PER_TOKEN + _mid(output) * SATURATED_S_PER_OUTPUT_TOKEN)


def base_capacity_rps(base: Base) -> float:
    """:func:`capacity_rps` of the shape's requests; of a mix, one over its mean engine time a
    request. Data-parallel replicas on this CPU share its two cores, so they add none."""
    if not base.mix:
        return capacity_rps(base.prompt, base.output)
    return 1.0 / sum(share / capacity_rps(p, o) for share, p, o in base.mix)


def _blocks(prompt: int, output: int) -> int:
    return math.ceil((prompt + output) / BLOCK_SIZE)


# ----- shapes: rng -> Base -----


def _closed_loop(rng, clients, prompt, output, server=(), steady=(42, 46)) -> Base:
    t = rng.randint(*steady)
    seed = rng.randint(1, 999)
    steps = [_steady({"concurrency": clients}, t, prompt, output, seed)]
    return Base(
        steps,
        list(server),
        prompt,
        output,
        span_s=t,
        rate_rps=clients / _latency_s(_mid(prompt), _mid(output)),
        peak_running=clients,
        params={"clients": clients, "steady_s": t, "seed": seed},
    )


def _closed(rng):
    return _closed_loop(rng, rng.choice([2, 3]), (32, 96), (24, 48))


def _long(rng):
    return _closed_loop(rng, rng.choice([1, 2]), (400, 900), (8, 24))


def _int8(rng):
    return _closed_loop(rng, rng.choice([2, 3]), (32, 96), (24, 48), ["--quantization", "int8"])


def _spec(rng):
    b = _closed_loop(
        rng,
        2,
        (32, 96),
        (64, 128),
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'],
        steady=(40, 44),  # its long answers drain longer
    )
    b.kv_slack_per_request = 1
    return b


def _open(rng):
    rate = round(rng.uniform(0.6, 1.0), 2)
    t = rng.randint(42, 46)
    seed = rng.randint(1, 999)
    prompt, output = (32, 128), (16, 48)
    steps = [_steady({"request_rate": rate}, t, prompt, output, seed)]
    # Poisson arrivals: a few at once now and then
    return Base(steps, [], prompt, output, t, rate, 5, {"rate": rate, "steady_s": t, "seed": seed})


def _clumped(rng):
    # six clumps under capacity, each 4-6 requests sent within a fraction of a second
    gap = rng.choice([7, 8])
    prompt, output = (32, 96), (16, 40)
    sizes = [rng.randint(4, 6) for _ in range(6)]
    seed = rng.randint(1, 999)
    steps = [
        {
            "start_s": float(k * gap),
            "args": _bench(
                request_rate=20,
                num_requests=n,
                prompt_tokens=_uniform(*prompt),
                output_tokens=_uniform(*output),
                seed=seed + k,
            ),
        }
        for k, n in enumerate(sizes)
    ]
    # a clump of n is served in about its prefills and its longest answer
    last = 5 * gap + max(sizes) * prompt[1] * PREFILL_S_PER_TOKEN + output[1] * DECODE_STEP_S
    return Base(
        steps,
        [],
        prompt,
        output,
        span_s=round(last, 1),
        rate_rps=sum(sizes) / last,
        peak_running=max(sizes),
        params={"gap_s": gap, "clumps": sizes, "seed": seed},
    )


def _procs(rng):
    # separate client processes joining one by one, each one stream
    n = rng.randint(6, 8)
    end = rng.randint(42, 46)
    starts = [0, *sorted(rng.sample(range(1, 21), n - 1))]
    prompt, output = (32, 96), (24, 48)
    seed = rng.randint(1, 999)
    steps = [
        _steady({"concurrency": 1}, end - s, prompt, output, seed + k, start_s=float(s))
        for k, s in enumerate(starts)
    ]
    return Base(
        steps,
        [],
        prompt,
        output,
        span_s=end,
        rate_rps=n / _latency_s(_mid(prompt), _mid(output)),
        peak_running=n,
        params={"procs": n, "starts_s": starts, "end_s": end, "seed": seed},
    )


def _tenants(rng):
    # eight tenants, each its own API key, system prompt and open-loop rate
    end = rng.randint(42, 46)
    prompt, output = (16, 64), (16, 40)
    seed = rng.randint(1, 999)
    tenants = []
    steps = []
    for i in range(8):
        start = rng.randint(0, 4) if i else 0
        t = {
            "start_s": start,
            "rate": round(rng.uniform(0.08, 0.14), 3),
            "system_prompt": rng.randint(80, 200),
        }
        tenants.append(t)
        steps.append(
            {
                "start_s": float(start),
                "args": [
                    "--api-key",
                    tenant_key(i),
                    *_bench(
                        request_rate=t["rate"],
                        phases=f"steady:{end - start}s",
                        shared_prefix=f"{t['system_prompt']}:1000",
                        prompt_tokens=_uniform(*prompt),
                        output_tokens=_uniform(*output),
                        seed=seed + i,
                    ),
                ],
            }
        )
    sys_mid = sum(t["system_prompt"] for t in tenants) / len(tenants)
    eff_prompt = (prompt[0] + int(sys_mid), prompt[1] + int(sys_mid))
    return Base(
        steps,
        ["--tenants", TENANTS_FILE],
        eff_prompt,
        output,
        span_s=end,
        rate_rps=sum(t["rate"] for t in tenants),
        peak_running=6,
        params={"tenants": tenants, "end_s": end, "seed": seed},
        fault_args=["--api-key", tenant_key(FAULT_TENANT)],
    )


def _dp(rng):
    # two engine cores behind one API (--data-parallel-size 2), each a full copy of the model
    # with one torch thread (the two share this CPU's two cores), short chats routed to the
    # core with the fewest outstanding tokens
    b = _closed_loop(rng, rng.choice([3, 4]), (32, 96), (24, 48), ["--data-parallel-size", "2"])
    b.replicas = 2
    one = _mid(b.prompt) * DP_PREFILL_S_PER_TOKEN + _mid(b.output) * DP_DECODE_STEP_S
    b.rate_rps = b.peak_running / one
    return b


# kv_pressure on pd: the decode core holds every request's whole KV (its prompt's, sent from
# the prefill core, and its answer's) while the prefill core holds a prompt's only until it is
# sent (at once: the decode side buffers it at its desk), so the pool that is too small is the
# decode side's: the fault sets --decode-num-gpu-blocks-override to the size it sets
# --num-gpu-blocks-override to on the other shapes, and leaves the prefill side its default
# pool. (Capping both alike was tried: at the severe size the prefill side, taking the fault's
# 4-5 prompts at once, came near its cap too, a second effect that is not the fault's.)
PD_KV_FLAGS = ("--decode-num-gpu-blocks-override",)


def _pd(rng):
    # prefill and decode on their own engine cores (--disaggregation prefill=1,decode=1, not
    # pinned: both share the two cores), each request's KV sent from one to the other
    b = _closed_loop(
        rng, rng.choice([2, 3]), (32, 96), (24, 48), ["--disaggregation", "prefill=1,decode=1"]
    )
    b.kv_flags = PD_KV_FLAGS
    return b


def _mixed(rng):
    # open loop, two classes each its own Poisson stream: ~80 % short chats, ~20 % with a
    # 300-600-token prompt (a document to summarise), well under capacity
    rate = round(rng.uniform(0.5, 0.7), 2)
    long_rate = round(0.2 * rate, 3)
    short_rate = round(rate - long_rate, 3)
    t = rng.randint(42, 46)
    seed = rng.randint(1, 999)
    short, long_ = ((32, 96), (16, 48)), ((300, 600), (16, 48))
    classes = ((short_rate, *short), (long_rate, *long_))
    steps = [_steady({"request_rate": r}, t, p, o, seed + k) for k, (r, p, o) in enumerate(classes)]
    # Poisson arrivals: up to five running at once now and then; the KV they hold is mostly
    # the long prompts', usually one at a time: the pool kv_pressure leaves the shape is one
    # long and three short requests' with the 25 % margin (f-mixed-healthy at 0.7 req/s: 68
    # blocks at its 99th percentile step; two long prompts together, 103 blocks, once)
    peak = 5
    own = math.ceil(
        1.25 * (3 * _blocks(short[0][1], short[1][1]) + _blocks(long_[0][1], long_[1][1]))
    )
    return Base(
        steps,
        [],
        (short[0][0], long_[0][1]),
        (min(short[1][0], long_[1][0]), max(short[1][1], long_[1][1])),
        span_s=t,
        rate_rps=rate,
        peak_running=peak,
        params={
            "rate": rate,
            "short_rate": short_rate,
            "long_rate": long_rate,
            "steady_s": t,
            "seed": seed,
        },
        kv_own_blocks=own,
        mix=tuple((r / rate, p, o) for r, p, o in classes),
    )


def _sysprompt(rng):
    # open loop, many users of one chat app: every request opens with the same 300-400-token
    # system prompt (prefix-cached after the first request), then a short question; the cost
    # model counts a prompt's uncached tokens, the question's
    rate = round(rng.uniform(1.0, 1.4), 2)
    system = rng.randint(300, 400)
    t = rng.randint(42, 46)
    seed = rng.randint(1, 999)
    prompt, output = (16, 64), (16, 48)
    shared = ["--shared-prefix", f"{system}:1000"]  # one group: a run sends < 1000 requests
    step = _steady({"request_rate": rate}, t, prompt, output, seed)
    steps = [{**step, "args": step["args"] + shared}]
    # Poisson arrivals: up to six running now and then; they share the system prompt's blocks
    # (held once) and each holds its question's and answer's, and the block where the system
    # prompt ends
    peak = 6
    own = math.ceil(1.25 * (_blocks(system, 0) + peak * (_blocks(prompt[1], output[1]) + 1)))
    return Base(
        steps,
        [],
        prompt,
        output,
        span_s=t,
        rate_rps=rate,
        peak_running=peak,
        params={"rate": rate, "system_prompt": system, "steady_s": t, "seed": seed},
        kv_own_blocks=own,
        request_args=shared,
    )


def _budget(rng):
    # a small step budget: prompts of 32-448 tokens, those over ~250 prefilled in two steps
    # beside the other clients' decodes
    return _closed_loop(
        rng, rng.choice([2, 3]), (32, 448), (24, 64), ["--max-num-batched-tokens", "256"]
    )


@dataclass(frozen=True)
class Shape:
    name: str
    draw: Callable[[random.Random], Base]
    description: str

    @property
    def split(self) -> str:
        return "tune" if self.name in TUNE_SHAPES else "heldout"


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("closed", _closed, "2-3 closed-loop clients, short chats"),
        Shape("open", _open, "open loop, Poisson 0.6-1.0 req/s"),
        Shape("long", _long, "1-2 clients, prompts 400-900 tokens, short answers"),
        Shape("int8", _int8, "int8 weights, 2-3 closed-loop clients"),
        Shape("clumped", _clumped, "six clumps of 4-6 requests, 7-8 s apart"),
        Shape("procs", _procs, "6-8 client processes joining over 20 s, one stream each"),
        Shape("tenants", _tenants, "eight tenants, their own keys, system prompts and rates"),
        Shape("spec", _spec, "n-gram speculative decoding, 2 clients, long answers"),
        Shape(
            "dp",
            _dp,
            "data parallel: 2 engine cores (one thread each) behind one API, 3-4 closed-loop "
            "clients, short chats; a KV pool is each core's",
        ),
        Shape(
            "pd",
            _pd,
            "disaggregated prefill=1,decode=1 (unpinned), 2-3 closed-loop clients, short chats; "
            "a KV pool too small is the decode side's",
        ),
        Shape(
            "mixed",
            _mixed,
            "open loop, Poisson 0.5-0.7 req/s: ~80 % short chats, ~20 % 300-600-token prompts",
        ),
        Shape(
            "sysprompt",
            _sysprompt,
            "open loop, Poisson 1.0-1.4 req/s: short chats all behind one 300-400-token system "
            "prompt, prefix-cached",
        ),
        Shape(
            "budget",
            _budget,
            "a step budget of 256 tokens (--max-num-batched-tokens 256), 2-3 closed-loop "
            "clients, prompts 32-448 tokens",
        ),
    )
}


def base_of(shape: str) -> Base:
    """The shape's traffic, the same for its twin and every fault on it."""
    return SHAPES[shape].draw(random.Random(f"f-{shape}"))


# ----- faults: (base, magnitude, rng) -> Fault -----


@dataclass
class Fault:
    """What a fault adds to its shape's traffic, and when it is present."""

    start_s: float
    end_s: float
    params: dict
    steps: list[dict] = field(default_factory=list)
    server: list[str] = field(default_factory=list)
    host_load: list[dict] = field(default_factory=list)


def _window(rng: random.Random, base: Base) -> tuple[float, float]:
    """A fault's start (6-10 s in) and end (25-30 s later), inside the shape's traffic."""
    start = round(rng.uniform(6, 10), 1)
    end = min(start + rng.randint(25, 30), base.span_s - 2)
    if end - start < MIN_FAULT_S:
        start = max(3.0, end - MIN_FAULT_S)
    return start, end


NEIGHBOUR_PROCS = {"mild": 1, "moderate": 2, "severe": 4}
PERIODIC_BUSY_S = {"mild": 0.4, "moderate": 0.8, "severe": 1.5}
# the KV pool: the shape's own peak plus this share of what the fault's clients would hold
KV_SHARE = {"mild": 0.7, "moderate": 0.45, "severe": 0.25}
OVERLOAD_X = {"mild": 1.5, "moderate": 2.5, "severe": 4.0}
LONG_PROMPT = {"mild": 500, "moderate": 1000, "severe": 1800}
PREFIX_TOKENS = {"mild": 150, "moderate": 300, "severe": 500}


def _neighbour(base: Base, mag: str, rng: random.Random) -> Fault:
    start, end = _window(rng, base)
    procs = NEIGHBOUR_PROCS[mag]
    host = [
        {
            "start_s": start,
            "duration_s": end - start,
            "procs": procs,
            "every_s": None,
            "busy_s": None,
        }
    ]
    return Fault(start, end, {"procs": procs}, host_load=host)


def _periodic(base: Base, mag: str, rng: random.Random) -> Fault:
    start, end = _window(rng, base)
    every = rng.choice([4, 5, 6])
    busy = PERIODIC_BUSY_S[mag]
    host = [
        {"start_s": start, "duration_s": end - start, "procs": 2, "every_s": every, "busy_s": busy}
    ]
    return Fault(start, end, {"every_s": every, "busy_s": busy, "procs": 2}, host_load=host)


def _kv_pressure(base: Base, mag: str, rng: random.Random) -> Fault:
    start, end = _window(rng, base)
    clients = rng.choice([4, 5])  # a core's: data parallel sends them to every replica
    prompt, output = (64, 128), (150, 250)
    seed = rng.randint(1, 999)
    slack = base.kv_slack_per_request
    # the pool is each engine core's: a data-parallel replica holds its share of the shape's
    # requests (the router balances them; the busier one the larger half) and 4-5 of the
    # fault's, as a single engine would, so every magnitude means the same on each replica
    own = base.kv_own_blocks
    if own is None:
        running = math.ceil(base.peak_running / base.replicas)
        own = math.ceil(running * (_blocks(base.prompt[1], base.output[1]) + slack) * 1.25)
    one = _blocks(prompt[1], output[1]) + slack
    extra = clients * one
    blocks = max(own + round(KV_SHARE[mag] * extra), own + one + 2)
    steps = [
        {
            "start_s": start,
            "args": [
                *base.fault_args,
                *_bench(
                    concurrency=clients * base.replicas,
                    phases=f"steady:{end - start:g}s",
                    prompt_tokens=_uniform(*prompt),
                    output_tokens=_uniform(*output),
                    seed=seed,
                ),
            ],
        }
    ]
    params = {"clients": clients, "blocks": blocks, "own_blocks": own, "fault_blocks": extra}
    params["seed"] = seed
    if base.replicas > 1:  # clients, blocks, own_blocks and fault_blocks are each replica's
        params["replicas"] = base.replicas
    server = [a for flag in base.kv_flags for a in (flag, str(blocks))]
    return Fault(start, end, params, steps, server)


def _overload(base: Base, mag: str, rng: random.Random) -> Fault:
    start, end = _window(rng, base)
    cap = base_capacity_rps(base)
    rate = round(max(0.5 * cap, OVERLOAD_X[mag] * cap - base.rate_rps), 2)
    seed = rng.randint(1, 999)
    # a mix sends more of each of its classes, in its shares, each class a step of its own
    classes = base.mix or ((1.0, base.prompt, base.output),)
    steps = [
        {
            "start_s": start,
            "args": [
                *base.fault_args,
                *_bench(
                    request_rate=rate if len(classes) == 1 else round(share * rate, 3),
                    phases=f"steady:{end - start:g}s",
                    prompt_tokens=_uniform(*p),
                    output_tokens=_uniform(*o),
                    # the backlog is cut 5 s after the phase (it would take minutes to drain)
                    drain_timeout=5,
                    seed=seed + k,
                ),
                *base.request_args,
            ],
        }
        for k, (share, p, o) in enumerate(classes)
    ]
    params = {"rate": rate, "capacity_rps": round(cap, 2), "x": OVERLOAD_X[mag], "seed": seed}
    return Fault(start, end, params, steps)


def _prefill_interference(base: Base, mag: str, rng: random.Random) -> Fault:
    start, _ = _window(rng, base)
    start = round(min(start, base.span_s - 32), 1)
    gap = 12.0
    tokens = LONG_PROMPT[mag]
    seed = rng.randint(1, 999)
    steps = [
        {
            "start_s": start + k * gap,
            "args": [
                *base.fault_args,
                *_bench(
                    concurrency=1,
                    num_requests=1,
                    prompt_tokens=tokens,
                    output_tokens=1,
                    seed=seed + k,
                ),
            ],
        }
        for k in range(3)
    ]
    # present from the first long prompt to the last one's whole prefill
    end = start + 2 * gap + max(3.0, tokens * PREFILL_S_PER_TOKEN)
    at = [round(start + k * gap, 1) for k in range(3)]
    params = {"long_prompt": tokens, "at_s": at, "seed": seed}
    return Fault(start, round(end, 1), params, steps, ["--no-enable-chunked-prefill"])


def _prefix_miss(base: Base, mag: str, rng: random.Random) -> Fault:
    start, end = _window(rng, base)
    clients = rng.choice([1, 2])
    tokens = PREFIX_TOKENS[mag]
    seed = rng.randint(1, 999)
    steps = [
        {
            "start_s": start,
            "args": [
                *base.fault_args,
                *_bench(
                    concurrency=clients,
                    phases=f"steady:{end - start:g}s",
                    shared_prefix=f"{tokens}:1000:volatile",
                    prompt_tokens=_uniform(12, 24),
                    output_tokens=_uniform(6, 12),
                    seed=seed,
                ),
            ],
        }
    ]
    return Fault(start, end, {"clients": clients, "prefix": tokens, "seed": seed}, steps)


@dataclass(frozen=True)
class FaultKind:
    name: str
    expect: tuple[str, ...]  # the first is the rule it is; the rest are acceptable as top
    apply: Callable[[Base, str, random.Random], Fault]
    description: str
    windows: tuple[str, ...] = ("5s", "10s")


FAULTS: dict[str, FaultKind] = {
    f.name: f
    for f in (
        FaultKind(
            "neighbour",
            ("host_contention",),
            _neighbour,
            "CPU hogs outside the server: 1/2/4 processes",
        ),
        FaultKind(
            "periodic",
            ("periodic_itl_spikes",),
            _periodic,
            "a 2-process job every 4-6 s, busy 0.4/0.8/1.5 s",
            ("15s", "20s"),
        ),
        FaultKind(
            "kv_pressure",
            ("kv_pressure_preemption", "ttft_queueing", "midstream_stall"),
            _kv_pressure,
            "a KV pool that holds the shape's requests and 70/45/25 % of 4-5 long answers'",
        ),
        FaultKind(
            "overload",
            ("overload", "ttft_queueing"),
            _overload,
            "more of the shape's requests, open loop, to 1.5/2.5/4x the capacity",
        ),
        FaultKind(
            "prefill_interference",
            ("itl_prefill_interference",),
            _prefill_interference,
            "chunked prefill off and three 500/1000/1800-token prompts 12 s apart",
            ("10s", "30s"),
        ),
        FaultKind(
            "prefix_miss",
            ("prefix_cache_miss",),
            _prefix_miss,
            "1-2 clients with a 150/300/500-token system prompt whose first line changes",
        ),
    )
}


# ----- runs -----


def run_id(shape: str, fault: str | None = None, magnitude: str | None = None) -> str:
    return f"f-{shape}-healthy" if fault is None else f"f-{shape}-{fault}-{magnitude}"


def make_run(shape: str, fault: str | None = None, magnitude: str | None = None) -> CorpusRun:
    """One run: the shape's traffic, and the fault at that magnitude laid on it (None: the
    shape's healthy twin)."""
    rid = run_id(shape, fault, magnitude)
    sh = SHAPES[shape]
    base = base_of(shape)
    rng = random.Random(rid)
    kind = FAULTS[fault] if fault else None
    f = kind.apply(base, magnitude, rng) if kind else None
    window = random.Random(f"{rid}:window").choice(kind.windows if kind else ("5s", "10s"))
    steps = [
        {"start_s": float(st["start_s"]), "args": scenario_args(st["args"])}
        for st in [*base.steps, *(f.steps if f else [])]
    ]
    expect = list(kind.expect) if kind else []
    if shape == "pd" and fault == "kv_pressure":
        # its pool is the decode side's: a decode pool too small for what the prefill side sends
        # is as rightly named the P/D ratio's (bench/scenarios/pd_decode_starved.yaml)
        expect.insert(1, "pd_ratio_imbalance")
    sc = Scenario(
        name=rid,
        expect=expect,
        steps=steps,
        server=scenario_args([*base.server, *(f.server if f else [])]),
        window=window,
        host_load=f.host_load if f else [],
        case=f"factorial {shape} × {fault or 'healthy'}",
        description=f"{sh.description}; {kind.description if kind else 'no fault'}",
    )
    params = {"shape": base.params, "window": window}
    if f:
        params["fault"] = f.params
    labels = {
        "shape": shape,
        "fault": fault,
        "magnitude": magnitude if fault else None,
        "fault_window_s": [f.start_s, f.end_s] if f else None,
    }
    family = fault or "healthy"
    return CorpusRun(rid, family, sh.split, expect, sc, params, f.start_s if f else None, labels)


def plan(
    kind: str = "small",
    shapes: list[str] | None = None,
    faults: list[str] | None = None,
    magnitudes: list[str] | None = None,
    split: str | None = None,
) -> list[CorpusRun]:
    """The runs of a plan, tune shapes first. ``full``: every shape's twin and every fault at
    every magnitude. ``small``: every shape's twin and each fault at one magnitude, rotating
    through mild/moderate/severe across shapes and faults (shape ``i``, fault ``j``:
    ``MAGNITUDES[(i + j) % 3]``), so every fault is seen at every magnitude on some shape.
    The filters keep what they name (a twin is kept by any magnitude filter)."""
    if kind not in PLANS:
        raise ValueError(f"plan {kind!r}: one of {', '.join(PLANS)}")
    order = sorted(SHAPES, key=lambda s: SHAPES[s].split != "tune")
    runs = []
    for i, shape in enumerate(order):
        if shapes and shape not in shapes:
            continue
        if split and SHAPES[shape].split != split:
            continue
        if not faults or "healthy" in faults:
            runs.append(make_run(shape))
        for j, fault in enumerate(FAULTS):
            if faults and fault not in faults:
                continue
            mags = MAGNITUDES if kind == "full" else (MAGNITUDES[(i + j) % 3],)
            for mag in mags:
                if magnitudes and mag not in magnitudes:
                    continue
                runs.append(make_run(shape, fault, mag))
    return runs


# ----- checks: what a run asks of the bench and the server, and how long it lasts -----


@functools.cache
def _command(which: str):
    """The ``bench`` or ``serve`` command as the command line builds it."""
    import typer

    if which == "bench":
        from .cli import bench_app

        return typer.main.get_command(bench_app)
    from tokenmill.engine.cli import app

    return typer.main.get_command(app).commands["serve"]


def _opts(args: list[str]) -> dict:
    """The bench step's options as the bench command parses them (raises
    ``typer.TyperException`` on a bad one)."""
    return _command("bench").make_context("bench", list(args)).params


def check_bench_args(args: list[str]) -> str | None:
    """Why ``tokenmill bench`` would refuse these arguments, or None: the bench command's own
    parser, then its checks of the rate, the phases, the lengths and the shared prefix."""
    import typer

    from .phases import parse_phases
    from .workload import parse_length, parse_shared_prefix

    try:
        o = _opts(args)
    except typer.TyperException as exc:
        return exc.format_message()
    try:
        if o["request_rate"] is not None and o["concurrency"] is not None:
            return "--request-rate and --concurrency both given"
        if o["phases"] is None and o["num_requests"] is None:
            return "neither --phases nor --num-requests: 100 requests"
        if o["phases"] is not None:
            parse_phases(o["phases"])
        parse_length(o["prompt_tokens"], "--prompt-tokens")
        parse_length(o["output_tokens"], "--output-tokens")
        if o["shared_prefix"]:
            parse_shared_prefix(o["shared_prefix"])
    except ValueError as exc:
        return str(exc)
    return None


def check_server_args(args: list[str]) -> str | None:
    """Why ``tokenmill serve`` would refuse these flags, or None: the serve command's parser and
    the engine config's own validation."""
    import typer

    from tokenmill.engine.config import EngineConfig

    try:
        p = _command("serve").make_context("serve", list(args)).params
        EngineConfig(**{n: p[n] for n in EngineConfig.field_names()}).validate()
    except typer.TyperException as exc:
        return exc.format_message()
    except ValueError as exc:
        return str(exc)
    return None


def step_s(args: list[str]) -> float:
    """How long a bench step lasts by the cost model: its phases (or its requests) and the
    drain of what is in flight at the end."""
    from .phases import parse_phases
    from .workload import parse_length

    o = _opts(args)
    p = parse_length(o["prompt_tokens"], "--prompt-tokens")
    out = parse_length(o["output_tokens"], "--output-tokens")
    p_max, o_max = _spec_max(p), _spec_max(out)
    one = _latency_s(p_max, 0) + o_max * DRAIN_S_PER_OUTPUT_TOKEN
    if o["phases"] is not None:
        return sum(ph.duration_s for ph in parse_phases(o["phases"])) + min(one, o["drain_timeout"])
    n = o["num_requests"]
    if o["request_rate"] is not None:
        return n / o["request_rate"] + one
    return math.ceil(n / (o["concurrency"] or 1)) * one


def _spec_max(spec) -> float:
    """A length spec's largest draw (a lognormal's: its mean times three)."""
    return {"fixed": spec.a, "uniform": spec.b}.get(spec.kind, 3 * spec.a)


def traffic_s(run: CorpusRun) -> float:
    """When the run's traffic ends, in seconds after its first step starts (cost model)."""
    return max(st["start_s"] + step_s(st["args"]) for st in run.scenario.steps)


def check_run(run: CorpusRun) -> list[str]:
    """What is wrong with a planned run: bench steps or server flags the commands would refuse,
    traffic outside :data:`TRAFFIC_S`, a fault shorter than :data:`MIN_FAULT_S` or outside it."""
    bad = []
    for st in run.scenario.steps:
        why = check_bench_args(st["args"])
        if why:
            bad.append(f"step at {st['start_s']:g} s: {why}")
    why = check_server_args(run.scenario.server)
    if why:
        bad.append(f"server {run.scenario.server}: {why}")
    if bad:
        return bad
    t = traffic_s(run)
    if not TRAFFIC_S[0] <= t <= TRAFFIC_S[1]:
        bad.append(f"traffic {t:.1f} s, outside {TRAFFIC_S[0]:g}-{TRAFFIC_S[1]:g} s")
    win = run.labels.get("fault_window_s")
    if win:
        if win[1] - win[0] < MIN_FAULT_S:
            bad.append(f"fault lasts {win[1] - win[0]:.1f} s")
        if win[0] != run.fault_start_s or win[1] > t:
            bad.append(f"fault window {win} against start {run.fault_start_s}, traffic {t:.1f} s")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tokenmill.bench.factorial", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plan", choices=PLANS, default="small")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES))
    ap.add_argument("--faults", nargs="+", choices=[*FAULTS, "healthy"])
    ap.add_argument("--magnitudes", nargs="+", choices=MAGNITUDES)
    ap.add_argument("--split", choices=SPLITS)
    ap.add_argument("--model")
    ap.add_argument(
        "--list", action="store_true", help="print the planned runs (and their checks) and stop"
    )
    a = ap.parse_args(argv)
    runs = plan(a.plan, a.shapes, a.faults, a.magnitudes, a.split)
    if a.list:
        for r in runs:
            bad = check_run(r)
            print(
                r.id,
                r.split,
                f"traffic {traffic_s(r):.0f}s" if not bad else "INVALID: " + "; ".join(bad),
                f"fault {r.labels['fault_window_s']}",
                r.scenario.window,
                r.scenario.server,
                json.dumps(r.params.get("fault", {})),
            )
        print(f"{len(runs)} runs")
        return 0
    if a.out is None:
        ap.error("--out is required (or --list)")
    bad = {r.id: check_run(r) for r in runs}
    bad = {k: v for k, v in bad.items() if v}
    if bad:
        for k, v in bad.items():
            print(f"error: {k}: {'; '.join(v)}", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    generate(a.out, runs, model=a.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
