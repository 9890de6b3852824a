"""Test helper: run a tiny checkpoint tensor-parallel in ``world`` processes on gloo.

:func:`run_tp` spawns the ranks (``torch.multiprocessing``, a file rendezvous), each loads the
checkpoint as its shard (``load_model(tensor_parallel=(rank, world))``) and drives it with
:func:`paged_driver.run_paged`; rank 0's logits and every rank's KV cache bytes and collective
counts come back.
"""

from __future__ import annotations

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from paged_driver import run_paged

from tokenmill.engine.kv_cache import kv_bytes_per_block
from tokenmill.engine.models.loader import load_model
from tokenmill.engine.parallel.tensor_parallel import take_comm


def _rank(rank, world, init_file, path, seqs, prompts, quantization, out_dir):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    torch.set_num_threads(1)
    try:
        model = load_model(
            path,
            device="cpu",
            dtype="float32",
            quantization=quantization,
            tensor_parallel=(rank, world),
        )
        logits = run_paged(model, seqs, prompts, chunk=4)
        comm_ns, comm_bytes = take_comm(model)
        torch.save(
            {
                "logits": logits,
                "kv_bytes_per_block": kv_bytes_per_block(model.config, 4, torch.float32),
                "comm_bytes": comm_bytes,
                "comm_ns": comm_ns,
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def run_tp(path, seqs, prompts, world: int, quantization: str = "none") -> list[dict]:
    """Per rank: ``logits`` (per sequence ``[len, vocab]``), ``kv_bytes_per_block``,
    ``comm_bytes``, ``comm_ns``."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        args = (world, init_file, str(path), seqs, prompts, quantization, tmp)
        mp.spawn(_rank, args=args, nprocs=world, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
