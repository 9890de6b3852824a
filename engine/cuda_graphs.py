"""CUDA graphs for decode steps: captured once per batch size at startup, replayed per step.

What ``--enforce-eager`` turns off on CUDA. A small decode step on a GPU is bound by kernel
launches, not by the device (the seed's 003 §3.2: graph capture alone cut small-batch TPOT by
10-20%); a graph replays a whole forward's launches in one call.

How, as vLLM does it:

- **sizes** (:func:`capture_sizes`): 1, 2, 4, then every multiple of 8 up to the largest
  batch the scheduler runs (``max_num_seqs``, at most :data:`MAX_CAPTURE_SIZE`). A step of
  ``B`` decodes runs the graph of the next captured size (:func:`padded_size`): its first
  ``B`` rows are the step, the padding rows write no KV (``slot_mapping -1``) and their
  outputs are dropped. A step larger than the largest size, or one with a prefill chunk or
  draft tokens, runs eagerly.
- **static inputs**: a graph reads fixed addresses, so each step copies its token ids,
  positions, slot mapping, block tables and context lengths into buffers allocated before
  capture (:class:`DecodeGraphs`). The attention metadata's host fields are frozen at capture:
  ``max_seq_len`` is the model's maximum length, so the split-K decode kernel's grid covers
  any context (splits past a sequence's length exit at once).
- **what must hold for capture**: no host sync and no host-side decision on device values
  inside the forward. The Triton decode path decides only from host metadata; RoPE's
  ``dynamic`` scaling derives per-token lengths on the device with a size the host cannot know
  without a sync, so such models run eagerly.

Where no GPU is lent (this project's CI), the capture logic (sizes, padding, static buffers,
fallbacks) is tested with the device calls stubbed (``tests/engine/test_cuda_graphs.py``:
:class:`GraphApi` replaced by one that records the capture and replays by running the forward
again on the static buffers); ``scripts/gpu_check.sh`` runs the real capture and checks greedy
tokens against eager in bfloat16.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .attention.metadata import AttentionMetadata

log = logging.getLogger(__name__)

__all__ = ["MAX_CAPTURE_SIZE", "DecodeGraphs", "GraphApi", "capture_sizes", "padded_size"]

# vLLM's default largest captured batch (its cudagraph capture sizes stop at 512)
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then multiples of 8, up to ``min(max_num_seqs,
    limit)`` (that bound itself included when it is none of those).

    Raises:
        ValueError: ``max_num_seqs < 1``.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    top = min(max_num_seqs, limit)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size ``>= n`` (``sizes`` ascending), or None: run eagerly."""
    for s in sizes:
        if s >= n:
            return s
    return None


class GraphApi:
    """The device calls graph capture makes, in one place so tests can stub them: a new
    graph, the capture context, replay, and synchronization (``torch.cuda``)."""

    def new_graph(self):
        return torch.cuda.CUDAGraph()

    def capture(self, graph, pool):
        return torch.cuda.graph(graph, pool=pool)

    def replay(self, graph, rerun: Callable[[], None]) -> None:
        """Replay ``graph``; ``rerun`` is the same work done eagerly (what a stub runs)."""
        graph.replay()

    def pool(self):
        return torch.cuda.graph_pool_handle()

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)


class DecodeGraphs:
    """Captured decode forwards of one model over its KV caches, one per size.

    Args:
        forward: ``(input_ids [B] int64, positions [B] int64, metadata) -> hidden [B, H]``,
            the model's forward with its KV caches bound.
        sizes: batch sizes to capture (:func:`capture_sizes`).
        max_blocks: block-table columns (``ceil(max_model_len / block_size)``).
        max_model_len: the longest context; the frozen ``max_seq_len``.
        device: the model's device.
        api: the device calls (:class:`GraphApi`; tests stub it).

    Raises:
        RuntimeError: capture failed (a host sync or an unsupported op inside the forward):
            the caller runs eagerly and reports why.
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        sizes: list[int],
        max_blocks: int,
        max_model_len: int,
        device: torch.device,
        api: GraphApi | None = None,
    ):
        self.forward = forward
        self.sizes = sorted(sizes)
        self.api = api or GraphApi()
        self.device = device
        top = self.sizes[-1]
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(top, **i32)
        self.block_tables = torch.zeros((top, max(1, max_blocks)), **i32)
        self.query_start_loc = torch.arange(top + 1, **i32)
        self.max_model_len = max_model_len
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metadata: dict[int, AttentionMetadata] = {}
        self.capture_all()

    def _metadata(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_host=list(range(b + 1)),
            seq_lens_host=[self.max_model_len] * b,
        )

    def _run(self, b: int) -> torch.Tensor:
        return self.forward(self.input_ids[:b], self.positions[:b], self.metadata[b])

    def capture_all(self) -> None:
        """Capture every size, largest first (smaller graphs reuse its memory pool). The
        padding state during capture writes no KV (all slots ``-1``)."""
        pool = self.api.pool()
        for b in reversed(self.sizes):
            self.metadata[b] = self._metadata(b)
            # a warm-up run outside the graph: lazy initialisation (Triton's compile, cuBLAS
            # handles) must not happen during capture
            self._run(b)
            self.api.synchronize(self.device)
            graph = self.api.new_graph()
            try:
                with self.api.capture(graph, pool):
                    self.outputs[b] = self._run(b)
            except Exception as exc:
                raise RuntimeError(f"CUDA graph capture at batch {b} failed: {exc}") from exc
            self.graphs[b] = graph
        self.api.synchronize(self.device)

    def takes(self, num_tokens: int, metadata: AttentionMetadata) -> bool:
        """Whether a step runs as a graph: one new token per sequence, at most the largest
        captured size, a block table that fits the static one."""
        return (
            metadata.max_query_len == 1
            and padded_size(num_tokens, self.sizes) is not None
            and metadata.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Copy the step into the static buffers, replay the graph of the padded size and
        return the first ``B`` rows of its output ``[B, hidden]`` (a view: read it before the
        next step).

        Raises:
            ValueError: a step :meth:`takes` refuses.
        """
        n = input_ids.shape[0]
        if not self.takes(n, metadata):
            raise ValueError(f"a step of {n} tokens does not fit the captured decode graphs")
        b = padded_size(n, self.sizes)
        cols = metadata.block_tables.shape[1]
        with torch.inference_mode():
            self.input_ids[:n].copy_(input_ids)
            self.positions[:n].copy_(positions)
            self.slot_mapping[:n].copy_(metadata.slot_mapping)
            self.seq_lens[:n].copy_(metadata.seq_lens)
            self.block_tables[:n, :cols].copy_(metadata.block_tables)
            # padding rows: no KV write, one visible key; columns past the step's table unused
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
            self.positions[n:b].zero_()
            self.input_ids[n:b].zero_()
            self.block_tables[:b, cols:].zero_()
            self.api.replay(self.graphs[b], lambda: self.outputs[b].copy_(self._run(b)))
        return self.outputs[b][:n]


def decode_graphs_for(
    model, kv_caches, sizes: list[int], block_size: int, max_model_len: int, api=None
) -> tuple[DecodeGraphs | None, str | None]:
    """``(graphs, None)`` for a CUDA model whose decode forward can be captured, else
    ``(None, reason)``: not on CUDA, ``dynamic`` RoPE, or a capture that failed."""
    device = next(model.parameters()).device
    if api is None and device.type != "cuda":
        return None, f"no CUDA graphs on {device.type}"
    if model.config.rope.rope_type == "dynamic":
        return None, "dynamic RoPE scaling needs a host sync per step"
    max_blocks = -(-max_model_len // block_size)

    def forward(input_ids, positions, metadata):
        return model(input_ids, positions, kv_caches, metadata)

    try:
        with torch.inference_mode():
            graphs = DecodeGraphs(forward, sizes, max_blocks, max_model_len, device, api)
    except RuntimeError as exc:
        log.warning("%s; decode runs eagerly", exc)
        return None, str(exc)
    return graphs, None
