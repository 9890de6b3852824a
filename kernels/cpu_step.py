"""A whole decode step in one C call (``cpu_decode_step.c``), built on :mod:`.cpu`'s kernels.

:class:`DecodeStep` holds a decoder's weights, norms and KV caches as a C table of pointers,
built once; each call runs every layer of a batch of one-token decodes (RMSNorm, the qkv GEMV,
optional per-head q/k norm, RoPE, store + paged attention, o_proj, add+RMSNorm, gate_up, SwiGLU,
down, then the final norm) over scratch it keeps, so a step costs one ctypes call instead of
~10 per layer. The values are those of the same kernels called one by one from Python (same functions in
the same order; the compiler may fuse an int8 bias add or a norm differently: within 5e-7 on
the tests' tiny checkpoints); the tests compare it with the engine's eager path.

Float32 activations; each linear layer float32, weight-only int8 (one scale per output row) or
weight-only int4 (groups of 32, :func:`.cpu.pack_int4`'s layout).
Imports torch only.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import cpu

__all__ = ["DecodeStep", "StepLayer", "StepLinear"]

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float

KIND_F32, KIND_INT8, KIND_INT4 = 0, 1, 2


class _Linear(ctypes.Structure):
    _fields_ = [
        ("kind", _i64),
        ("weight", _ptr),
        ("scale", _ptr),
        ("bias", _ptr),
        ("n", _i64),
        ("k", _i64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("window", _i64),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i64),
        ("hidden", _i64),
        ("hq", _i64),
        ("hkv", _i64),
        ("d", _i64),
        ("inter", _i64),
        ("block_size", _i64),
        ("eps", _f32),
        ("scale", _f32),
        ("final_norm", _ptr),
        ("layers", ctypes.POINTER(_Layer)),
    ]


@dataclass
class StepLinear:
    """One linear layer: ``weight [N, K]`` float32; or int8 with ``scale [N, K/32]`` float32
    (``w = q * scale`` per group of 32 along K, :data:`.cpu.INT8_GROUP`); or int4, ``weight [N/16, K/32, 16, 16]`` uint8 with ``scale [N/16, K/32, 16]``
    int32 (:func:`.cpu.pack_int4`'s layout); ``bias [N]`` float32 or None. All contiguous on
    the CPU."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def _struct(self, name: str, n: int, k: int) -> _Linear:
        w = self.weight
        if w.dtype == torch.uint8:
            g, r = cpu.INT4_GROUP, cpu.INT4_ROWS
            if k % g or n % r:
                raise ValueError(f"{name}: int4 needs N divisible by {r} and K by {g}")
            kind, shape = KIND_INT4, (n // r, k // g, 16, r)
            _check(f"{name}.scale", self.scale, (n // r, k // g, r), torch.int32)
        elif w.dtype == torch.int8:
            g = cpu.INT8_GROUP
            if k % g:
                raise ValueError(f"{name}: int8 needs K divisible by {g}")
            kind, shape = KIND_INT8, (n, k)
            _check(f"{name}.scale", self.scale, (n, k // g))
        elif w.dtype == torch.float32:
            kind, shape = KIND_F32, (n, k)
        else:
            raise ValueError(
                f"{name}: weight dtype {w.dtype}; the step takes float32, int8 or int4 (uint8)"
            )
        if tuple(w.shape) != shape:
            raise ValueError(f"{name}: weight {tuple(w.shape)}, expected {shape}")
        _check(f"{name}.weight", w, shape, w.dtype)
        if self.bias is not None:
            _check(f"{name}.bias", self.bias, (n,))
        scale = self.scale.data_ptr() if kind != KIND_F32 else None
        bias = self.bias.data_ptr() if self.bias is not None else None
        return _Linear(kind, w.data_ptr(), scale, bias, n, k)


@dataclass
class StepLayer:
    """One decoder layer's tensors: norms ``[hidden]`` (``q_norm``/``k_norm`` ``[head_dim]`` or
    None), the four linears (qkv stacked as q, k, v rows; gate_up as gate, up), the layer's KV
    caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` float32 contiguous, and its
    sliding window in tokens (None: none)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: StepLinear
    o: StepLinear
    gate_up: StepLinear
    down: StepLinear
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    window: int | None = None


def _check(name: str, t: torch.Tensor | None, shape: tuple, dtype=torch.float32) -> None:
    if t is None:
        raise ValueError(f"{name} is missing")
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous {dtype} on the CPU")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")


class DecodeStep:
    """A decoder's decode step as one C call.

    Args:
        layers: the decoder layers in order.
        final_norm: ``[hidden]`` float32, the norm after the last layer.
        num_heads, num_kv_heads, head_dim: attention shape (``num_heads % num_kv_heads == 0``).
        intermediate_size: the MLP's inner width.
        eps: RMSNorm epsilon. scale: attention softmax scale (``head_dim ** -0.5``).

    Raises:
        RuntimeError: the CPU kernels are not available (:func:`tokenmill.kernels.cpu.available`).
        ValueError: a tensor's dtype, shape or layout the step does not take, naming it.
    """

    def __init__(
        self,
        layers: list[StepLayer],
        final_norm: torch.Tensor,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate_size: int,
        eps: float,
        scale: float,
    ):
        self._lib = cpu._loaded_or_raise()
        if not layers:
            raise ValueError("no layers")
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
        hidden = final_norm.shape[0]
        _check("final_norm", final_norm, (hidden,))
        q, kv, inter = num_heads * head_dim, num_kv_heads * head_dim, intermediate_size
        block_size = layers[0].k_cache.shape[1]
        structs = []
        for i, layer in enumerate(layers):
            p = f"layers[{i}]"
            _check(f"{p}.input_norm", layer.input_norm, (hidden,))
            _check(f"{p}.post_norm", layer.post_norm, (hidden,))
            if (layer.q_norm is None) != (layer.k_norm is None):
                raise ValueError(f"{p}: q_norm and k_norm come together")
            if layer.q_norm is not None:
                _check(f"{p}.q_norm", layer.q_norm, (head_dim,))
                _check(f"{p}.k_norm", layer.k_norm, (head_dim,))
            cache_shape = (layer.k_cache.shape[0], block_size, num_kv_heads, head_dim)
            _check(f"{p}.k_cache", layer.k_cache, cache_shape)
            _check(f"{p}.v_cache", layer.v_cache, cache_shape)
            structs.append(
                _Layer(
                    layer.input_norm.data_ptr(),
                    layer.post_norm.data_ptr(),
                    layer.q_norm.data_ptr() if layer.q_norm is not None else None,
                    layer.k_norm.data_ptr() if layer.k_norm is not None else None,
                    layer.qkv._struct(f"{p}.qkv", q + 2 * kv, hidden),
                    layer.o._struct(f"{p}.o", hidden, q),
                    layer.gate_up._struct(f"{p}.gate_up", 2 * inter, hidden),
                    layer.down._struct(f"{p}.down", hidden, inter),
                    layer.k_cache.data_ptr(),
                    layer.v_cache.data_ptr(),
                    layer.window or 0,
                )
            )
        # the tensors behind the pointers must outlive the table
        self._keep = (layers, final_norm)
        self._layers = (_Layer * len(structs))(*structs)
        self._model = _Model(
            len(structs),
            hidden,
            num_heads,
            num_kv_heads,
            head_dim,
            inter,
            block_size,
            eps,
            scale,
            final_norm.data_ptr(),
            self._layers,
        )
        self.hidden, self.head_dim = hidden, head_dim
        self._scratch = torch.empty(0, dtype=torch.float32)

    def __call__(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Run the step for ``B`` sequences (``1 <= B <=`` :data:`cpu.MAX_ROWS`), each decoding
        one token: ``h [B, hidden]`` float32 contiguous (the tokens' embeddings) is overwritten
        with the final norm's output and returned; ``cos, sin [B, head_dim]`` float32
        contiguous; ``slot_mapping [B]`` int64 (``-1``: not stored), ``block_tables [B,
        max_blocks]`` int32 (rows contiguous), ``seq_lens [B]`` int32 (context after this
        token). Writes each layer's new K/V into its cache.

        Raises:
            ValueError: an input's dtype, shape or layout the step does not take, naming it.
            RuntimeError: a kernel refused its sizes or ran out of memory.
        """
        b = h.shape[0] if h.dim() == 2 else -1
        if not 1 <= b <= cpu.MAX_ROWS:
            raise ValueError(f"h must be [B, hidden] with 1 <= B <= {cpu.MAX_ROWS}")
        _check("h", h, (b, self.hidden))
        _check("cos", cos, (b, self.head_dim))
        _check("sin", sin, (b, self.head_dim))
        _check("slot_mapping", slot_mapping, (b,), torch.int64)
        _check("seq_lens", seq_lens, (b,), torch.int32)
        if (
            block_tables.dtype != torch.int32
            or block_tables.dim() != 2
            or block_tables.shape[0] != b
            or block_tables.stride(1) != 1
        ):
            raise ValueError(f"block_tables must be [{b}, max_blocks] int32, rows contiguous")
        need = self._lib.tokenmill_decode_step_scratch(ctypes.addressof(self._model), b)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        rc = self._lib.tokenmill_decode_step(
            ctypes.addressof(self._model),
            h.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slot_mapping.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            b,
            self._scratch.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(
                "decode step kernel: a kernel refused its sizes or ran out of memory"
            )
        return h
