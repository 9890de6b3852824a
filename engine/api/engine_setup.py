"""The engine handle ``tokenmill serve`` runs: one worker, replicas or prefill/decode pools."""

from __future__ import annotations

import os

from .replicas import ReplicaPool, check_data_parallel
from .worker import EngineWorker


def serving_cores(config) -> int:
    """The engine cores whose batches hold a request until it ends: the replicas, or with
    ``--disaggregation`` the decode cores (admission lets ``--max-num-seqs`` run on each)."""
    spec = config.pd_spec()
    return spec.decode if spec is not None else config.data_parallel_size


def engine_workers(config) -> EngineWorker | ReplicaPool:
    """One engine worker, a :class:`ReplicaPool` of ``--data-parallel-size`` of them, or a
    prefill and decode workers (``PDPool``, ``--disaggregation``).

    Raises:
        ValueError: the machine cannot hold that many replicas (one line).
    """
    spec = config.pd_spec()
    if spec is not None:
        from .disaggregated import PDPool

        return PDPool(config, spec)
    if config.data_parallel_size == 1:
        return EngineWorker(config)
    cpus = os.cpu_count() or 1
    cuda = 0
    if config.device != "cpu":
        import torch  # only here: the API's own code has no other use for it

        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    check_data_parallel(config, cpus, cuda)
    if config.device == "auto" and cuda:
        config.device = "cuda"
    return ReplicaPool(config, cpu_count=cpus)
