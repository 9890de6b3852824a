"""Attention metadata for one engine step over the paged KV cache (DESIGN.md §3).

A step runs a flat batch of ``num_tokens`` new tokens drawn from ``num_seqs`` sequences; each
sequence contributes a contiguous run of tokens (a prefill chunk or one decode token) that
continues its already-cached context. The same metadata drives every attention backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqChunk:
    """The part of one sequence computed in this step.

    Attributes:
        num_cached: tokens of this sequence already in the KV cache (its context before the step).
        num_new: tokens computed in this step (1 for a decode, the chunk length for a prefill).
        block_table: KV block ids of the sequence, in order; must cover ``num_cached + num_new``.
    """

    num_cached: int
    num_new: int
    block_table: list[int]


@dataclass
class AttentionMetadata:
    """Paged-attention inputs for one step.

    Attributes:
        query_start_loc: ``[num_seqs + 1]`` int32, sequence i's new tokens are rows
            ``query_start_loc[i]:query_start_loc[i+1]`` of the flat batch.
        seq_lens: ``[num_seqs]`` int32, context length of each sequence *after* this step
            (cached + new tokens).
        block_tables: ``[num_seqs, max_blocks]`` int32, block ids, padded with 0 (never read
            past ``seq_lens``).
        slot_mapping: ``[num_tokens]`` int64, flat cache slot (``block * block_size + offset``)
            each new token's K/V is written to; ``-1`` marks padding, which is not written.
        max_query_len: largest number of new tokens of any sequence.
        max_seq_len: largest ``seq_lens`` entry.
        query_start_loc_host / seq_lens_host: the same numbers as Python lists, so host-side
            code (the torch backend's loop) never syncs with the device.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


@dataclass
class StepInputs:
    """Model inputs for one step: flat positions, attention metadata, and which rows to sample.

    Attributes:
        positions: ``[num_tokens]`` int64 position of each new token in its sequence.
        metadata: the :class:`AttentionMetadata`.
        last_token_indices: ``[num_seqs]`` int64 row of each sequence's last new token, where
            its next-token logits come from.
    """

    positions: torch.Tensor
    metadata: AttentionMetadata
    last_token_indices: torch.Tensor


def build_step_inputs(
    chunks: list[SeqChunk], block_size: int, device: torch.device | str = "cpu"
) -> StepInputs:
    """Lay out ``chunks`` as one flat batch and build its metadata on ``device``.

    Raises:
        ValueError: a chunk with no new tokens, or a block table too short for its tokens.
    """
    starts = [0]
    seq_lens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for c in chunks:
        if c.num_new <= 0:
            raise ValueError("every sequence in a step must have at least one new token")
        total = c.num_cached + c.num_new
        if len(c.block_table) * block_size < total:
            raise ValueError(
                f"block table of {len(c.block_table)} blocks cannot hold {total} tokens "
                f"(block_size {block_size})"
            )
        for pos in range(c.num_cached, total):
            positions.append(pos)
            slots.append(c.block_table[pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + c.num_new)
        seq_lens.append(total)
    max_blocks = max(max((len(c.block_table) for c in chunks), default=0), 1)
    tables = torch.tensor(
        [c.block_table + [0] * (max_blocks - len(c.block_table)) for c in chunks], dtype=torch.int32
    )
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.reshape(len(chunks), max_blocks).to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max((c.num_new for c in chunks), default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_host=starts,
        seq_lens_host=seq_lens,
    )
    return StepInputs(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        metadata=meta,
        last_token_indices=torch.tensor(
            [s - 1 for s in starts[1:]], dtype=torch.int64, device=device
        ),
    )
