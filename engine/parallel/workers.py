"""The ranks of a tensor-parallel engine: rank 0 is the engine core's own model runner, ranks
1..N-1 are worker processes it starts on this host (``python -m
tokenmill.engine.parallel.workers``).

Every step, rank 0 broadcasts the step's inputs (token ids, positions and the attention
metadata, as tensors) with ``torch.distributed.broadcast_object_list``; each rank runs its
shard's forward and the row-parallel layers all-reduce (:mod:`.tensor_parallel`). Only rank 0
computes logits and samples. ``None`` in place of a step tells the workers to exit.

The group meets through torch.distributed's TCP rendezvous on ``127.0.0.1`` and a free port
(gloo on CPU). A rank that does not join within ``join_timeout_s`` fails the start in one line
naming the missing ranks. A worker exits when rank 0's process is gone (a watchdog thread reads
its parent pid), so a SIGKILLed engine core leaves no rank behind; between steps the workers
wait in the broadcast, whose timeout is therefore long (:data:`IDLE_TIMEOUT`).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

from ..errors import ModelLoadError

__all__ = [
    "DIST_ENV",
    "IDLE_TIMEOUT",
    "RANK_TIMES_EVERY",
    "RankTimes",
    "TensorParallelGroup",
    "dist_env",
    "run_host_worker",
    "run_worker",
]

#: torch.distributed's standard rendezvous environment (torchrun sets it too): with
#: ``MASTER_ADDR`` set, the ranks of a tensor-parallel group live on several hosts
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
_JOINED = "tokenmill/joined/{}"

#: steps over which each rank averages its forward time outside collectives before the ranks
#: exchange them (one all-gather of one number a rank): often enough to name a straggler within
#: seconds, rare enough to add ~1/16 of a collective to a step
RANK_TIMES_EVERY = 16

# how long a collective may wait: a worker waits in the step broadcast while the engine is idle,
# so this bounds nothing in normal use; a dead rank 0 ends its workers through the watchdog
IDLE_TIMEOUT = datetime.timedelta(days=7)


def _fresh_group_names() -> None:
    """Name the next group as a fresh process would. torch names an unnamed default group
    from a process-wide counter that only destroying a formed group resets; an
    ``init_process_group`` that failed (a rank never joined) leaves it advanced, and this
    rank's keys in the rendezvous store then never meet a fresh peer's (rank 0 waited for
    ``/1//cpu//0/1`` while rank 1 wrote under ``/0/``)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and not dist.is_initialized():
        world.group_count = 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(0.5)


class RankTimes:
    """Each rank's forward time outside collectives, averaged over :data:`RANK_TIMES_EVERY`
    steps and exchanged between the ranks: a rank the others wait for at every all-reduce shows
    a longer compute time, the others' wait shows in their collective time. Every rank calls
    :meth:`add` once per step, so the all-gather lines up."""

    def __init__(self, every: int = RANK_TIMES_EVERY):
        self.every, self.total_ns, self.steps = every, 0, 0

    def add(self, compute_ns: int) -> list[float] | None:
        """Count one step's compute (ns); on every ``every``-th step, the ranks' means (ms,
        index = rank), else None."""
        self.total_ns += compute_ns
        self.steps += 1
        if self.steps < self.every:
            return None
        mean = torch.tensor([self.total_ns / self.steps / 1e6], dtype=torch.float64)
        self.total_ns, self.steps = 0, 0
        out = [torch.zeros_like(mean) for _ in range(dist.get_world_size())]
        dist.all_gather(out, mean)
        return [float(t.item()) for t in out]


def run_worker(rank: int, world: int, init_method: str, parent: int, load: dict) -> None:
    """A worker rank's life: join the group, load its shard, allocate its KV cache (rank 0
    broadcasts the block count), then run every broadcast step until ``None``.

    ``load``: the keyword arguments of :func:`~..models.loader.load_model` and ``model_dir``,
    ``block_size``, ``threads`` (torch threads of this rank; 0 = the host's cores / ``world``).
    """
    from ..model_config import load_model_config

    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    # a stop sent to the server's process group is the API's to handle: this rank ends when
    # rank 0 sends None or its process is gone
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # a rank that cannot read the model (e.g. a host without the folder) exits before joining:
    # rank 0 then names it instead of waiting on a group that will never form
    load_model_config(load["model_dir"])
    # the ranks share the host's cores: rank 0's fixed count where it has one (a data-parallel
    # replica's share, --cpu-threads), else an equal split of the host among the ranks
    torch.set_num_threads(load.get("threads") or max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=IDLE_TIMEOUT
    )
    _serve(rank, world, load)


def _serve(rank: int, world: int, load: dict) -> None:
    """A joined worker rank: load its shard, allocate its KV cache (rank 0 broadcasts the block
    count), run every broadcast step until ``None``; leaves the group on the way out."""
    from ..kv_cache import allocate_kv_caches
    from ..models.loader import load_model
    from .tensor_parallel import take_comm

    try:
        args = dict(load)
        model_dir, block_size = args.pop("model_dir"), args.pop("block_size")
        args.pop("threads", None)
        slow_rank, slow_ms = args.pop("fault_slow_rank", None) or (0, 0.0)
        times = RankTimes()
        model = load_model(model_dir, tensor_parallel=(rank, world), **args)
        param = next(model.parameters())
        box = [None]
        dist.broadcast_object_list(box, src=0)  # rank 0's block count
        caches = allocate_kv_caches(model.config, box[0], block_size, param.dtype, param.device)
        with torch.inference_mode():
            while True:
                box = [None]
                dist.broadcast_object_list(box, src=0)
                if box[0] is None:
                    break
                input_ids, positions, metadata = box[0]
                t0 = time.perf_counter_ns()
                if rank == slow_rank:
                    time.sleep(slow_ms / 1e3)  # the drill: this rank's forward runs late
                model(input_ids, positions, caches, metadata)
                comm_ns, _ = take_comm(model)
                times.add(time.perf_counter_ns() - t0 - comm_ns)
    finally:
        dist.destroy_process_group()


def dist_env() -> dict | None:
    """The multi-host rendezvous from :data:`DIST_ENV`: ``{"addr", "port", "world", "rank"}``, or
    None when ``MASTER_ADDR`` is unset (every rank on this host).

    Raises:
        ValueError: a variable missing or not a whole number (one line naming it).
    """
    if not os.environ.get("MASTER_ADDR"):
        return None
    out: dict = {"addr": os.environ["MASTER_ADDR"]}
    for name, key, default in (("MASTER_PORT", "port", None), ("WORLD_SIZE", "world", None)):
        raw = os.environ.get(name, default)
        if raw is None or not raw.strip().isdigit():
            raise ValueError(f"{name} must be a whole number with MASTER_ADDR set, got {raw!r}")
        out[key] = int(raw)
    raw = os.environ.get("RANK", "0")
    if not raw.strip().isdigit() or int(raw) >= out["world"]:
        raise ValueError(f"RANK must be 0..WORLD_SIZE-1 ({out['world'] - 1}), got {raw!r}")
    out["rank"] = int(raw)
    return out


def run_host_worker(
    model_dir: str | None = None, join_timeout_s: float = 120.0, once: bool = False
) -> None:
    """A worker rank on a host of its own (``tokenmill tp-worker``), from :func:`dist_env`:
    register with rank 0's store at ``MASTER_ADDR:MASTER_PORT``, join the group, take the
    engine's load settings from rank 0 (``model_dir`` overrides its model folder: this host's
    copy), and serve its shard until rank 0 closes the group or goes away; then wait for the
    next group (a restarted engine core), unless ``once``.

    Raises:
        ValueError: the environment is missing or bad, or this is rank 0 (one line).
    """
    env = dist_env()
    if env is None:
        raise ValueError("tp-worker needs MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK set")
    rank, world = env["rank"], env["world"]
    if rank == 0:
        raise ValueError("RANK 0 is the engine core (tokenmill serve); a tp-worker is 1 or more")
    while True:
        try:
            store = dist.TCPStore(
                env["addr"],
                env["port"],
                world,
                is_master=False,
                timeout=datetime.timedelta(seconds=join_timeout_s),
            )
            store.set(_JOINED.format(rank), "1")
            _fresh_group_names()
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world, timeout=IDLE_TIMEOUT
            )
        except (RuntimeError, dist.DistStoreError) as exc:
            if once:
                raise
            print(f"rank {rank}: no rank 0 yet ({str(exc).splitlines()[0][:100]})", flush=True)
            time.sleep(1.0)
            continue
        try:
            box = [None]
            dist.broadcast_object_list(box, src=0)  # the engine's load settings
            load = dict(box[0])
            if model_dir:
                load["model_dir"] = model_dir
            print(f"rank {rank} of {world} joined {env['addr']}:{env['port']}", flush=True)
            _serve(rank, world, load)  # leaves the group on the way out
        except Exception as exc:  # rank 0 went away, or this host cannot load the model
            print(f"rank {rank}: group ended ({str(exc).splitlines()[0][:100]})", flush=True)
            if dist.is_initialized():
                dist.destroy_process_group()
            if once:
                raise
            time.sleep(1.0)
            continue
        if once:
            return


class TensorParallelGroup:
    """Rank 0's side of a tensor-parallel engine on this host: starts ranks ``1..world-1`` as
    processes, joins the group, and broadcasts each step to them.

    The workers are fresh interpreters (``python -m tokenmill.engine.parallel.workers``), not
    ``multiprocessing`` children: the engine core runs as a daemonic process, which may not
    have children of its own, and a fresh interpreter imports nothing of the parent's state.

    Args:
        world: ranks in all (``--tensor-parallel-size``), at least 2.
        load: what :func:`run_worker` passes to ``load_model`` (``model_dir``, ``block_size``
            and its keyword arguments; JSON-serialisable).
        join_timeout_s: how long every rank has to join (s).
        fault_slow_rank: ``(rank, ms)``: the fault drill's straggler (``--fault-slow-rank``),
            or None.

    Raises:
        ModelLoadError: a rank did not join in time (naming it) or exited while starting.
    """

    def __init__(
        self,
        world: int,
        load: dict,
        join_timeout_s: float = 120.0,
        fault_slow_rank: tuple[int, float] | None = None,
    ):
        self.world = world
        self.rank_times = RankTimes()
        if fault_slow_rank is not None:
            load = {**load, "fault_slow_rank": list(fault_slow_rank)}
        try:
            env = dist_env()
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
        if env is not None:
            self._join_hosts(env, load, join_timeout_s)
            return
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        _fresh_group_names()
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tokenmill.engine.parallel.workers",
                    json.dumps([rank, world, init_method, os.getpid(), load]),
                ],
                stdin=subprocess.DEVNULL,
            )
            for rank in range(1, world)
        ]
        try:
            dist.init_process_group(
                "gloo",
                init_method=init_method,
                rank=0,
                world_size=world,
                timeout=datetime.timedelta(seconds=join_timeout_s),
            )
        except (RuntimeError, dist.DistStoreError) as exc:
            missing = [rank for rank, p in enumerate(self.procs, 1) if p.poll() is not None]
            self.close()
            who = f"rank(s) {missing} exited" if missing else "a rank did not join"
            raise ModelLoadError(
                f"tensor parallel group of {world} did not form within {join_timeout_s:.0f} s: "
                f"{who} ({str(exc).splitlines()[0][:120]})"
            ) from None
        self._joined = True

    def _join_hosts(self, env: dict, load: dict, join_timeout_s: float) -> None:
        """Rank 0 of a group over several hosts: serve the rendezvous store on ``MASTER_PORT``,
        wait for every rank to register (naming those that did not), form the group, and send
        the workers the load settings. The workers are started on their hosts
        (``tokenmill tp-worker``), not here."""
        self.procs = []
        if env["world"] != self.world or env["rank"] != 0:
            raise ModelLoadError(
                f"--tensor-parallel-size {self.world} runs as RANK 0 of WORLD_SIZE {self.world}; "
                f"the environment says RANK {env['rank']} of WORLD_SIZE {env['world']}"
            )
        timeout = datetime.timedelta(seconds=join_timeout_s)
        store = dist.TCPStore(
            env["addr"], env["port"], self.world, is_master=True, timeout=timeout,
            wait_for_workers=False,
        )  # fmt: skip
        keys = {r: _JOINED.format(r) for r in range(1, self.world)}
        deadline = time.monotonic() + join_timeout_s
        missing = list(keys)
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([keys[r]])]
            time.sleep(0.05 if missing else 0)
        if missing:
            raise ModelLoadError(
                f"tensor parallel group of {self.world} did not form within "
                f"{join_timeout_s:.0f} s: rank(s) {missing} never joined "
                f"{env['addr']}:{env['port']} (start `tokenmill tp-worker` with RANK set there)"
            )
        _fresh_group_names()
        dist.init_process_group("gloo", store=store, rank=0, world_size=self.world, timeout=timeout)
        self._joined = True
        dist.broadcast_object_list([load], src=0)

    def send_blocks(self, num_blocks: int) -> None:
        """Tell the workers how many KV blocks to allocate (rank 0 sized them)."""
        dist.broadcast_object_list([num_blocks], src=0)

    def broadcast_step(self, input_ids, positions, metadata) -> None:
        """Send one step's inputs to every worker (they run their shard's forward with it)."""
        dist.broadcast_object_list([(input_ids, positions, metadata)], src=0)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (a ``None`` step), leave the group; kill a worker that lingers."""
        if getattr(self, "_joined", False):
            self._joined = False
            try:
                dist.broadcast_object_list([None], src=0)
            finally:
                dist.destroy_process_group()
        for p in self.procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout_s)

    def alive(self) -> list[bool]:
        """Whether each worker (ranks 1..world-1) is still running."""
        return [p.poll() is None for p in self.procs]


if __name__ == "__main__":  # a worker rank, started by TensorParallelGroup
    run_worker(*json.loads(sys.argv[1]))
