"""Tensor parallelism: one loaded decoder split across ranks of a torch.distributed group.

Megatron's split of a Llama-family block, with two all-reduces a layer (the seed's pitfall 5:
hidden behind prefill's arithmetic, exposed in small decode steps):

- **attention**: each rank owns a contiguous run of query heads and the KV heads they read.
  ``qkv_proj`` is column-parallel (the rank's q, k and v rows), attention runs on the local
  heads over a KV cache that holds only those heads, and ``o_proj`` is row-parallel (the local
  heads' input columns) followed by an all-reduce. When there are fewer KV heads than ranks, a
  KV head is replicated on the ranks whose query heads read it (``world % num_kv_heads == 0``).
- **MLP**: ``gate_up_proj`` column-parallel (the rank's slice of the intermediate size, gate and
  up alike), ``down_proj`` row-parallel + all-reduce.
- **embedding and LM head**: replicated on every rank (each computes the full logits; the
  sampling rank reads its own). A vocab-parallel head would cut its bytes per rank too, at a
  third collective per step; on the default model the head is 21 % of the weights.
- Norms and row-parallel biases: replicated; a bias is added once, after the all-reduce.

:func:`plan_shard` decides what a rank owns (or refuses, in one line naming the head counts);
:func:`shard_model` cuts a loaded float model in place, before quantization, and returns the
rank's local :class:`ModelConfig` (its heads and intermediate size: the KV cache and every
per-rank shape follow from it). Collectives go through ``torch.distributed`` on the default
group (gloo on CPU, NCCL on CUDA); :class:`RowParallelLinear` counts their time and bytes.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..model_config import ModelConfig
from ..models.linear import Linear

__all__ = [
    "RowParallelLinear",
    "TensorParallelShard",
    "check_tensor_parallel",
    "plan_shard",
    "shard_model",
    "take_comm",
]


@dataclass(frozen=True)
class TensorParallelShard:
    """What one rank of a tensor-parallel group owns: ``[start, end)`` ranges of query heads,
    KV heads and intermediate channels."""

    rank: int
    world: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]


def plan_shard(cfg: ModelConfig, rank: int, world: int) -> TensorParallelShard:
    """The slice of ``cfg``'s model that ``rank`` of ``world`` owns.

    Raises:
        ValueError: ``world < 1`` or ``rank`` outside it; a ``world`` that does not divide the
            query heads, that neither divides the KV heads nor is a multiple of them, or that
            does not divide the intermediate size (one line naming the counts).
    """
    if world < 1:
        raise ValueError(f"tensor parallel size must be at least 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a tensor parallel group of {world}")
    hq, hkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    heads = f"the model's {hq} query heads and {hkv} KV heads"
    if hq % world:
        raise ValueError(f"tensor parallel size {world} does not divide {heads}")
    if hkv % world and world % hkv:
        raise ValueError(
            f"tensor parallel size {world} neither divides nor is a multiple of {heads}"
        )
    if inter % world:
        raise ValueError(
            f"tensor parallel size {world} does not divide the intermediate size {inter}"
        )
    q_local = hq // world
    if hkv >= world:
        kv_local = hkv // world
        kv = (rank * kv_local, (rank + 1) * kv_local)
    else:  # fewer KV heads than ranks: each rank keeps the one its query heads read
        head = rank * hkv // world
        kv = (head, head + 1)
    i_local = inter // world
    return TensorParallelShard(
        rank=rank,
        world=world,
        q_heads=(rank * q_local, (rank + 1) * q_local),
        kv_heads=kv,
        intermediate=(rank * i_local, (rank + 1) * i_local),
    )


def check_tensor_parallel(model_dir, world: int, device: str | None) -> None:
    """Refuse, before any rank starts, a tensor-parallel size the model or device cannot take.

    Raises:
        ModelLoadError: a size that does not divide the heads (:func:`plan_shard`'s line), or a
            device other than the CPU (only gloo ranks on one host are built).
    """
    from ..errors import ModelLoadError
    from ..model_config import load_model_config
    from ..models.loader import resolve_device

    if resolve_device(device).type != "cpu":
        raise ModelLoadError(
            f"--tensor-parallel-size {world} runs on the CPU (gloo) only so far; add --device cpu"
        )
    try:
        plan_shard(load_model_config(Path(model_dir).expanduser()), 0, world)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None


class RowParallelLinear(nn.Module):
    """A row-parallel layer: the rank's input columns of a linear layer, then an all-reduce
    (sum) over the group, then the full layer's bias once. ``[T, K/world]`` → ``[T, N]``.

    ``inner`` is a plain bias-free linear (quantization may replace it). ``comm_ns`` and
    ``comm_bytes`` accumulate the all-reduces' wall time (ns) and payload (bytes) for the
    step's telemetry; :func:`take_comm` reads and resets them.
    """

    def __init__(self, inner: nn.Module, bias: torch.Tensor | None, group=None):
        super().__init__()
        self.inner = inner
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), False)
        self.group = group
        self.comm_ns = 0
        self.comm_bytes = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        start = time.perf_counter_ns()
        dist.all_reduce(y, group=self.group)
        self.comm_ns += time.perf_counter_ns() - start
        self.comm_bytes += y.numel() * y.element_size()
        return y if self.bias is None else y + self.bias


def take_comm(model: nn.Module) -> tuple[int, int]:
    """``(ns, bytes)`` the model's row-parallel all-reduces took since the last call; resets."""
    ns = nbytes = 0
    for m in model.modules():
        if isinstance(m, RowParallelLinear):
            ns, nbytes = ns + m.comm_ns, nbytes + m.comm_bytes
            m.comm_ns = m.comm_bytes = 0
    return ns, nbytes


def _rows(layer: nn.Linear, index: torch.Tensor) -> Linear:
    """A new :class:`Linear` holding ``layer``'s output rows ``index`` (and their bias)."""
    out = Linear(layer.in_features, len(index), bias=layer.bias is not None)
    out = out.to(device=layer.weight.device, dtype=layer.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(layer.weight[index])
        if layer.bias is not None:
            out.bias.copy_(layer.bias[index])
    return out


def _columns(layer: nn.Linear, start: int, end: int, group) -> RowParallelLinear:
    """``layer``'s input columns ``[start, end)`` as a :class:`RowParallelLinear`."""
    inner = Linear(end - start, layer.out_features, bias=False)
    inner = inner.to(device=layer.weight.device, dtype=layer.weight.dtype)
    with torch.no_grad():
        inner.weight.copy_(layer.weight[:, start:end])
    return RowParallelLinear(inner, layer.bias, group)


def _arange(start: int, end: int, scale: int = 1, offset: int = 0) -> torch.Tensor:
    return torch.arange(start * scale, end * scale) + offset


def shard_model(model: nn.Module, shard: TensorParallelShard, group=None) -> ModelConfig:
    """Cut a loaded float :class:`~..models.decoder.DecoderForCausalLM` down to ``shard`` in
    place (run it before quantization), and return the rank's local config: its query and KV
    heads and intermediate size, the rest as the model's. ``model.config`` becomes that local
    config and ``model.tensor_parallel`` the shard.

    Raises:
        ValueError: the model is already sharded.
    """
    if getattr(model, "tensor_parallel", None) is not None:
        raise ValueError("the model is already sharded")
    cfg: ModelConfig = model.config
    d = cfg.head_dim
    q0, q1 = shard.q_heads
    k0, k1 = shard.kv_heads
    i0, i1 = shard.intermediate
    q_size, kv_size = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        rows = torch.cat(
            [
                _arange(q0, q1, d),
                _arange(k0, k1, d, q_size),
                _arange(k0, k1, d, q_size + kv_size),
            ]
        )
        qkv = _rows(attn.qkv_proj, rows)
        qkv.shards = {
            "q_proj": (0, (q1 - q0) * d),
            "k_proj": ((q1 - q0) * d, (k1 - k0) * d),
            "v_proj": ((q1 - q0 + k1 - k0) * d, (k1 - k0) * d),
        }
        attn.qkv_proj = qkv
        attn.o_proj = _columns(attn.o_proj, q0 * d, q1 * d, group)
        attn.num_heads, attn.num_kv_heads = q1 - q0, k1 - k0
        attn.q_size, attn.kv_size = attn.num_heads * d, attn.num_kv_heads * d
        inter = cfg.intermediate_size
        gate_up = _rows(mlp.gate_up_proj, torch.cat([_arange(i0, i1), _arange(i0, i1, 1, inter)]))
        gate_up.shards = {"gate_proj": (0, i1 - i0), "up_proj": (i1 - i0, i1 - i0)}
        mlp.gate_up_proj = gate_up
        mlp.down_proj = _columns(mlp.down_proj, i0, i1, group)
    local = dataclasses.replace(
        cfg,
        num_attention_heads=q1 - q0,
        num_key_value_heads=k1 - k0,
        intermediate_size=i1 - i0,
    )
    model.config = local
    model.tensor_parallel = shard
    return local
