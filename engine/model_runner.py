"""Runs the model for a scheduled step: sizes and owns the KV cache, lays the step out as one
flat batch, and returns logits only for the rows that sample (the LM head is a large share of a
small model's forward, so prefill-chunk rows that sample nothing skip it)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from tokenmill.kernels import cpu as cpu_kernels

from .attention import SeqChunk, build_step_inputs
from .config import EngineConfig
from .cuda_graphs import DecodeGraphs, capture_sizes, decode_graphs_for
from .errors import ModelLoadError, TokenmillError
from .kv_cache import allocate_kv_caches, kv_bytes_per_block
from .models.loader import load_model
from .models.native_step import NativeDecode, native_decode_for
from .parallel.tensor_parallel import check_tensor_parallel, take_comm
from .parallel.workers import TensorParallelGroup
from .quantization import INT8_COMPUTE_GEMV_ROWS, int8_compute_path
from .scheduler import SchedulerOutput

log = logging.getLogger(__name__)


class KVCacheSizingError(TokenmillError):
    """The memory left for the KV cache holds no block."""


def set_int4_activations(config: EngineConfig, device: torch.device) -> str | None:
    """Set what this process's CPU int4 GEMV multiplies by (``--int4-activations``,
    ``kernels/cpu.py``: ``int4_act``); the mode in use (``int8``/``float32``), None when no
    int4 layer runs the C kernels (no int4, not a CPU, or the kernels do not build here).

    Raises:
        ModelLoadError: ``int8`` asked for on a CPU without AVX-512 VNNI and VBMI (one line).
    """
    if config.quantization != "int4" or device.type != "cpu" or not cpu_kernels.available():
        return None
    want = config.int4_activations
    got = cpu_kernels.int4_act(None if want == "auto" else want)
    if want != "auto" and got != want:
        raise ModelLoadError(
            "--int4-activations int8 needs a CPU with AVX-512 VNNI and VBMI; this one runs "
            "int4 on float32 activations (use auto or float32)"
        )
    return got


class ModelRunner:
    """The model, its KV cache and the step executor.

    Args:
        config: engine config (device, dtype, block size, KV sizing knobs).
        model_dir: Hugging Face folder.
    """

    def __init__(self, config: EngineConfig, model_dir: str | Path):
        self.config = config
        load = dict(
            device=config.device,
            dtype=config.dtype,
            load_format=config.load_format,
            quantization=config.quantization,
            int8_compute=config.int8_compute,
            attention_backend=config.attention_backend,
        )
        tp = config.tensor_parallel_size
        # ranks 1..tp-1 as processes on this host (engine/parallel/workers.py); this is rank 0
        self.tp_group: TensorParallelGroup | None = None
        if tp > 1:
            check_tensor_parallel(model_dir, tp, load["device"])
            slow = (config.fault_slow_rank, config.fault_slow_rank_ms)
            self.tp_group = TensorParallelGroup(
                tp,
                {
                    **load,
                    "model_dir": str(model_dir),
                    "block_size": config.block_size,
                    "threads": config.cpu_threads,
                },
                join_timeout_s=config.tensor_parallel_join_timeout,
                fault_slow_rank=slow if config.fault_slow_rank else None,
            )
        self.model = load_model(model_dir, tensor_parallel=(0, tp) if tp > 1 else None, **load)
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.int4_activations = set_int4_activations(config, self.device)
        # the int8 GEMM path of the quantized layers' large steps (engine/int8_compute.py)
        self.int8_compute = int8_compute_path(self.model)
        self.model_config = self.model.config
        self.block_size = config.block_size
        self.bytes_per_block = kv_bytes_per_block(self.model_config, self.block_size, self.dtype)
        self.num_blocks = self.determine_num_blocks()
        if self.tp_group is not None:
            self.tp_group.send_blocks(self.num_blocks)
        self.kv_caches = allocate_kv_caches(
            self.model_config, self.num_blocks, self.block_size, self.dtype, self.device
        )
        # ms the last execute() spent laying its step out (StepRecord.prepare_ms)
        self.last_prepare_ms = 0.0
        # the compiled decode path and why it is off: on CPU small all-decode steps in one C
        # call (NativeDecode), on CUDA decode steps replayed as CUDA graphs (DecodeGraphs)
        self.native: NativeDecode | None = None
        self.graphs: DecodeGraphs | None = None
        self.native_off_reason: str | None = "--enforce-eager"
        if config.enforce_eager:
            pass  # the reason above stands
        elif self.tp_group is not None:
            self.native_off_reason = "tensor parallel (the compiled step has no all-reduce)"
        elif self.device.type == "cpu":
            self.native, self.native_off_reason = native_decode_for(self.model, self.kv_caches)
        elif self.device.type == "cuda":
            max_len = config.model_len(self.model_config.max_position_embeddings)
            t0 = time.perf_counter()
            self.graphs, self.native_off_reason = decode_graphs_for(
                self.model,
                self.kv_caches,
                capture_sizes(config.max_num_seqs),
                self.block_size,
                max_len,
            )
            if self.graphs is not None:
                log.info(
                    "captured CUDA graphs for decode batches %s in %.1f s",
                    self.graphs.sizes,
                    time.perf_counter() - t0,
                )
        else:
            self.native_off_reason = f"no compiled decode step on {self.device.type}"
        if self.native_off_reason:
            log.info("compiled decode step off: %s", self.native_off_reason)
        # whether the last execute() ran the compiled decode step or a CUDA graph
        self.last_native = False
        # what the last execute()'s linear layers multiplied in (StepRecord.compute_precision)
        self.last_precision: str | None = None
        self._activation_precision = str(self.dtype).removeprefix("torch.")
        self._int8_compute_above = (
            INT8_COMPUTE_GEMV_ROWS.get(config.quantization) if self.int8_compute else None
        )
        # tensor parallel: (ns, bytes) the last execute() spent in collectives
        self.last_collective: tuple[int, int] | None = None

    def close(self) -> None:
        """Stop the tensor-parallel worker ranks, if any (idempotent)."""
        if self.tp_group is not None:
            self.tp_group.close()
            self.tp_group = None

    def determine_num_blocks(self) -> int:
        """KV blocks to allocate.

        ``num_gpu_blocks_override`` wins. On CUDA: after a profiling forward at the largest step
        (``max_num_batched_tokens`` tokens), ``total * gpu_memory_utilization - peak use``
        bytes (the method vLLM uses). On CPU: ``kv_cache_memory`` bytes.

        Raises:
            KVCacheSizingError: the budget holds no block.
        """
        if self.config.num_gpu_blocks_override:
            return self.config.num_gpu_blocks_override
        if self.device.type == "cuda":
            budget = self._profile_cuda_budget()
        else:
            budget = self.config.kv_cache_memory
        blocks = int(budget // self.bytes_per_block)
        if blocks < 1:
            raise KVCacheSizingError(
                f"{budget / 2**20:.0f} MiB left for the KV cache holds no block of "
                f"{self.bytes_per_block / 2**20:.2f} MiB (block_size {self.block_size}); raise "
                "--kv-cache-memory / --gpu-memory-utilization or lower --block-size"
            )
        return blocks

    @torch.inference_mode()
    def _profile_cuda_budget(self) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.config.max_num_batched_tokens, self.model_config.max_position_embeddings)
        blocks = -(-n // self.block_size)
        caches = allocate_kv_caches(
            self.model_config, blocks, self.block_size, self.dtype, self.device
        )
        step = build_step_inputs(
            [SeqChunk(0, n, list(range(blocks)))], self.block_size, self.device
        )
        hidden = self.model(
            torch.zeros(n, dtype=torch.long, device=self.device),
            step.positions,
            caches,
            step.metadata,
        )
        self.model.compute_logits(hidden[-self.config.max_num_seqs :])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - sum(
            c.numel() * c.element_size() for kv in caches for c in kv
        )
        del caches, hidden
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.config.gpu_memory_utilization - peak
        log.info(
            "KV budget %.1f GiB (total %.1f GiB, peak use %.1f GiB)",
            budget / 2**30,
            total / 2**30,
            peak / 2**30,
        )
        return int(budget)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step; returns float32 logits ``[sum of num_logit_rows, vocab]``: one row per
        chunk whose ``samples`` is True, and ``1 + K`` rows for a chunk that verifies ``K``
        draft tokens (its last sampled token and each draft), in the order of ``out.chunks``.
        Sets :attr:`last_prepare_ms` to the time spent building the inputs."""
        t0 = time.perf_counter()
        chunks, tokens, rows = [], [], []
        for c in out.chunks:
            chunks.append(SeqChunk(c.start, c.num_new_tokens, c.request.block_ids))
            known = c.num_new_tokens - len(c.draft_token_ids)
            tokens.extend(c.request.all_token_ids[c.start : c.start + known])
            tokens.extend(c.draft_token_ids)
            n = c.num_logit_rows
            rows.extend(range(len(tokens) - n, len(tokens)))
        step = build_step_inputs(chunks, self.block_size, self.device)
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        picked = torch.tensor(rows, device=self.device) if rows else None
        self.last_prepare_ms = (time.perf_counter() - t0) * 1e3
        if self.native is not None and self.native.kv_caches is not self.kv_caches:
            # the step's C table points into the caches it was built over: rebuild it for
            # caches swapped in since (a test's runner sharing loaded weights)
            self.native, self.native_off_reason = native_decode_for(self.model, self.kv_caches)
        self.last_native = self.native is not None and NativeDecode.takes(
            len(tokens), step.metadata
        )
        above = self._int8_compute_above
        int8 = above is not None and not self.last_native and len(tokens) > above
        self.last_precision = "int8" if int8 else self._activation_precision
        if self.tp_group is not None:
            t_send = time.perf_counter_ns()
            self.tp_group.broadcast_step(input_ids, step.positions, step.metadata)
            send_ns = time.perf_counter_ns() - t_send
        t_forward = time.perf_counter_ns()
        if self.last_native:
            hidden = self.native.forward(input_ids, step.positions, step.metadata)
        elif self.graphs is not None and self.graphs.takes(len(tokens), step.metadata):
            self.last_native = True
            hidden = self.graphs.run(input_ids, step.positions, step.metadata)
        else:
            hidden = self.model(input_ids, step.positions, self.kv_caches, step.metadata)
        if self.tp_group is not None:
            ns, nbytes = take_comm(self.model)
            self.last_collective = (send_ns + ns, nbytes)
            compute_ns = time.perf_counter_ns() - t_forward - ns
            self.last_rank_compute = self.tp_group.rank_times.add(compute_ns)
        if picked is None:
            return torch.empty((0, self.model_config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[picked]).cpu()
