"""Moving a prefilled request's KV cache between engine cores (issue 17, prefill/decode
disaggregation): the hand-off record, packing a request's blocks of every layer into one
tensor and unpacking it into another pool's blocks, and sending that tensor over
torch.distributed point-to-point (gloo on CPU; the same calls take NCCL on CUDA).

The unit of transfer is one request: its prompt's blocks, K and V of all layers, as one
contiguous ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor in the
cache's dtype. One tensor a request means one send and one receive, whatever the layer count
(vLLM's connectors and Mooncake move per layer to overlap with the forward; on a CPU there is
no copy engine to overlap with, so one message is the cheaper shape here).
"""

from __future__ import annotations

import dataclasses
import functools
import time
import typing
from dataclasses import dataclass, field

import msgspec
import torch
import torch.distributed as dist

from ..messages import RequestStats
from ..sampling_params import SamplingParams

# dtype codes of the header (a tensor's dtype has to cross as an integer)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEADER_LEN = 8  # [dtype code, ndim, up to 6 dims]


@dataclass
class KVHandoff:
    """A request prefilled on one engine core, ready to continue decoding on another.

    Attributes:
        request_id: the engine's request id.
        prompt_token_ids: the prompt.
        output_token_ids: the tokens the prefill side sampled (its first token).
        params: the request's sampling parameters (``max_tokens`` counts the first token).
        kv: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` in the cache's
            dtype: the prompt's K and V; its last block may be partly filled.
        stats: the request's :class:`~tokenmill.engine.messages.RequestStats` as the prefill
            side left it, whole (cached tokens, preemptions, recomputed tokens, KV blocks, its
            queued/scheduled/first-token times): the decode side's request starts from it, so
            its counters continue and its queue and prefill times stay its own.
        arrival_ns: wall-clock ns the request arrived; priority, tenant: as it was added.
        source: the name of the prefill core that sent it (``prefill-0`` ...).
        source_rank: its rank in the KV link's group (set by :func:`recv_handoff`).
        dest: the name of the decode core that took it (set by the receiving link).
        transfer_bytes: ``kv``'s size in bytes.
        transfer_ms: the time to move it, set by whoever moved it.
        received_ns: wall-clock ns it reached the decode side (:func:`recv_handoff`).
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    kv: torch.Tensor
    stats: RequestStats = field(default_factory=RequestStats)
    arrival_ns: int = 0
    priority: int = 0
    tenant: str = ""
    source: str = "prefill"
    source_rank: int | None = None
    dest: str = "decode"
    transfer_ms: float | None = None
    received_ns: int | None = None

    @property
    def transfer_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


def gather_kv(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int]):
    """The given blocks of every layer as one new contiguous tensor.

    Args:
        kv_caches: per layer ``(k, v)``, each ``[num_blocks, block_size, kv_heads, head_dim]``.
        block_ids: the request's block table, in order.

    Returns:
        ``[num_layers, 2, len(block_ids), block_size, kv_heads, head_dim]``, the caches' dtype
        and device.

    Raises:
        ValueError: no blocks, or a block id outside the pool.
    """
    if not block_ids:
        raise ValueError("a KV hand-off needs at least one block")
    total = kv_caches[0][0].shape[0]
    if not all(0 <= b < total for b in block_ids):
        raise ValueError(f"block ids {block_ids} are outside the pool of {total}")
    idx = torch.tensor(block_ids, device=kv_caches[0][0].device)
    return torch.stack([torch.stack((k[idx], v[idx])) for k, v in kv_caches])


def scatter_kv(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], kv: torch.Tensor
) -> None:
    """Write a :func:`gather_kv` tensor into the given blocks of another pool (in place), from
    whichever device it arrived on.

    Raises:
        ValueError: the tensor's layer count, block count or block shape does not match.
    """
    want = (len(kv_caches), 2, len(block_ids), *kv_caches[0][0].shape[1:])
    if tuple(kv.shape) != want:
        raise ValueError(f"KV hand-off of shape {tuple(kv.shape)} does not fit {want}")
    idx = torch.tensor(block_ids, device=kv_caches[0][0].device)
    for layer, (k, v) in enumerate(kv_caches):
        k[idx] = kv[layer, 0].to(k.device, k.dtype)
        v[idx] = kv[layer, 1].to(v.device, v.dtype)


def send_kv(kv: torch.Tensor, dst: int, group=None, control=None) -> tuple[int, float]:
    """Send one hand-off tensor to rank ``dst``: a fixed-size int64 header (dtype, shape), then
    the tensor. Blocking. Returns ``(bytes, ms)``. ``control``: the group that carries the
    (CPU) header when ``group`` is NCCL's (which moves only device tensors); None: ``group``.

    Raises:
        ValueError: a dtype or rank count the header cannot describe.
    """
    if kv.dtype not in _DTYPES or kv.dim() > HEADER_LEN - 2:
        raise ValueError(f"cannot send a {kv.dtype} tensor of {kv.dim()} dims")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(kv.dtype), kv.dim()
    header[2 : 2 + kv.dim()] = torch.tensor(kv.shape)
    t0 = time.perf_counter()
    dist.send(header, dst, group=control if control is not None else group)
    dist.send(kv.contiguous(), dst, group=group)
    return kv.numel() * kv.element_size(), (time.perf_counter() - t0) * 1e3


def recv_kv(src: int, group=None, device: str | torch.device = "cpu", control=None) -> torch.Tensor:
    """Receive one :func:`send_kv` tensor from rank ``src`` (blocking) onto ``device``."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    dist.recv(header, src, group=control if control is not None else group)
    code, ndim = int(header[0]), int(header[1])
    shape = [int(x) for x in header[2 : 2 + ndim]]
    kv = torch.empty(shape, dtype=_DTYPES[code], device=device)
    dist.recv(kv, src, group=group)
    return kv


# a hand-off's first message: [kind, length of its encoded fields]; kind 0 ends the sender
_HANDOFF, _END = 1, 0
# a hand-off's fields that do not cross: its KV (sent after them) and what the receiver sets
_LOCAL_FIELDS = ("kv", "source_rank", "transfer_ms", "received_ns")


@functools.cache
def _fields_decoder() -> msgspec.msgpack.Decoder:
    """The decoder of a hand-off's fields: a Struct of :class:`KVHandoff`'s fields that cross,
    with their types (``params`` a SamplingParams, ``stats`` a RequestStats), all required."""
    hints = typing.get_type_hints(KVHandoff)
    fields = [
        (f.name, hints[f.name])
        for f in dataclasses.fields(KVHandoff)
        if f.name not in _LOCAL_FIELDS
    ]
    return msgspec.msgpack.Decoder(msgspec.defstruct("KVHandoffFields", fields, kw_only=True))


def encode_fields(handoff: KVHandoff) -> bytes:
    """A hand-off's fields but its KV, as msgpack (as every engine message crosses, never as a
    pickle): ``stats`` crosses as one :class:`~tokenmill.engine.messages.RequestStats`."""
    fields = {k: v for k, v in vars(handoff).items() if k not in _LOCAL_FIELDS}
    return msgspec.msgpack.encode(fields)


def decode_fields(blob: bytes) -> dict[str, typing.Any]:
    """:func:`encode_fields`'s bytes back as ``{field: value}`` (KVHandoff's keyword arguments
    but its KV and what the receiver sets)."""
    return msgspec.structs.asdict(_fields_decoder().decode(blob))


def send_handoff(
    handoff: KVHandoff, dst: int, group=None, delay_s: float = 0.0, control=None
) -> tuple[int, float]:
    """Send a whole hand-off to rank ``dst``: a two-number header, its fields (msgpack,
    :func:`encode_fields`), then its KV (:func:`send_kv`). Blocking. Returns the KV's ``(bytes, ms)``.
    ``delay_s``: the fault drill's wait between the fields and the KV (the receiver times it
    as part of the transfer). ``control``: as in :func:`send_kv`; the header and the fields
    always cross on it (CPU tensors), only the KV on ``group``."""
    blob = encode_fields(handoff)
    ctl = control if control is not None else group
    t0 = time.perf_counter()
    dist.send(torch.tensor([_HANDOFF, len(blob)], dtype=torch.int64), dst, group=ctl)
    dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst, group=ctl)
    if delay_s > 0:
        time.sleep(delay_s)
    sent, _ = send_kv(handoff.kv, dst, group, control=ctl)
    return sent, (time.perf_counter() - t0) * 1e3


def send_end(dst: int, group=None, control=None) -> None:
    """Tell rank ``dst``'s :func:`recv_handoff` that this sender sends no more hand-offs."""
    ctl = control if control is not None else group
    dist.send(torch.tensor([_END, 0], dtype=torch.int64), dst, group=ctl)


def recv_handoff(
    src: int | None, group=None, device: str | torch.device = "cpu", control=None
) -> KVHandoff | None:
    """Receive one :func:`send_handoff` (blocking) from rank ``src``, or from whichever rank
    sends first when ``src`` is None (several prefill cores, one decode core: the rest of a
    hand-off is then read from the rank that sent its header, so two senders never
    interleave). None after a sender's :func:`send_end`. The hand-off's ``source_rank`` is
    the sender; its ``transfer_ms`` the time from its fields' arrival to its KV's."""
    ctl = control if control is not None else group
    head = torch.zeros(2, dtype=torch.int64)
    sender = dist.recv(head, src, group=ctl)
    sender = src if src is not None else sender
    if int(head[0]) == _END:
        return None
    blob = torch.empty(int(head[1]), dtype=torch.uint8)
    dist.recv(blob, sender, group=ctl)
    meta = decode_fields(blob.numpy().tobytes())
    t0 = time.perf_counter()
    kv = recv_kv(sender, group, device, control=ctl)
    ms = (time.perf_counter() - t0) * 1e3
    meta["source_rank"] = sender
    return KVHandoff(**meta, kv=kv, transfer_ms=ms, received_ns=time.time_ns())
