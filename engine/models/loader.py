"""Build a model from a Hugging Face folder: config, safetensors weights (single or sharded),
tied embeddings and dtype; or random weights at the config's real shapes (``dummy``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..attention import get_attention_backend
from ..errors import ModelLoadError
from ..int8_compute import prefill_attention_dtype
from ..model_config import ModelConfig, load_model_config
from ..parallel.tensor_parallel import plan_shard, shard_model
from ..quantization import (
    check_quantization,
    int8_compute_path,
    quantize_model,
    resolve_int8_compute,
)
from . import get_model_class
from .decoder import DecoderForCausalLM
from .ops import get_ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# Checkpoint entries that are not parameters of ours (precomputed RoPE tables in old exports).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """``auto`` → float32 on CPU, bfloat16 on CUDA; otherwise one of :data:`DTYPES`.

    Raises:
        ModelLoadError: an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ModelLoadError(
                f"dtype {dtype} is not supported; choose from auto, {', '.join(DTYPES)}"
            )
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose from auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | None) -> torch.device:
    """``None``/``auto`` → ``cuda`` when available, else ``cpu``."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(
            f"unknown device {device!r}; use auto, cpu, cuda or cuda:N ({exc})"
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(
                f"device {device!r} asked for, but CUDA is not available on this machine"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"device {device!r} does not exist ({torch.cuda.device_count()} GPU(s))"
            )
    elif dev.type != "cpu":
        raise ModelLoadError(f"device type {dev.type!r} is not supported; use cpu or cuda")
    return dev


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a folder: the shards named by ``model.safetensors.index.json``, or
    ``model.safetensors``, or every ``*.safetensors``.

    Raises:
        ModelLoadError: no safetensors weights, or an index naming a missing shard.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [model_dir / name for name in sorted(set(weight_map.values()))]
        except (OSError, KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {index}: malformed weight_map ({exc})") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index.name} names missing shard(s): {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model folder {str(model_dir)!r} has no *.safetensors weights")
    return files


def load_safetensors_weights(model: DecoderForCausalLM, files: list[Path]) -> None:
    """Copy checkpoint tensors into ``model`` by name (casting dtype, moving device).

    Raises:
        ModelLoadError: a parameter the model needs is absent, a shape differs, or the
            checkpoint holds tensors the model has no place for.
    """
    params = dict(model.named_parameters())
    # checkpoint projection name -> (our stacked parameter, row offset, rows)
    stacked: dict[str, tuple[str, int, int]] = {}
    for mod_name, module in model.named_modules():
        for shard, (offset, size) in getattr(module, "shards", {}).items():
            parent = mod_name.rsplit(".", 1)[0]
            for kind in ("weight", "bias"):
                if f"{mod_name}.{kind}" in params:
                    stacked[f"{parent}.{shard}.{kind}"] = (f"{mod_name}.{kind}", offset, size)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error type for bad headers
            raise ModelLoadError(f"cannot read weights {file.name}: {exc}") from None
        with handle as f:
            for stored in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if stored.endswith(_IGNORED_SUFFIXES):
                    continue
                name = stored
                if stored == "lm_head.weight" and model.config.tie_word_embeddings:
                    # tied: one matrix under either name (safetensors' save_model keeps one)
                    name = "model.embed_tokens.weight"
                target = name
                param = params.get(name)
                if name in stacked:
                    pname, offset, size = stacked[name]
                    param = params[pname].narrow(0, offset, size)
                if param is None:
                    unexpected.append(name)
                    continue
                tensor = f.get_tensor(stored)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ModelLoadError(
                        f"weight {name!r} has shape {tuple(tensor.shape)}, the config implies {tuple(param.shape)}"
                    )
                with torch.no_grad():
                    param.copy_(tensor)
                loaded.add(target)
    if unexpected:
        raise ModelLoadError(
            f"checkpoint has {len(unexpected)} tensor(s) this architecture does not use, e.g. {unexpected[0]!r}"
        )
    needed = set(params) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    needed = (needed - {pname for pname, _, _ in stacked.values()}) | set(stacked)
    missing = sorted(needed - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} weight(s), e.g. {missing[0]!r}")


def init_dummy_weights(model: DecoderForCausalLM, seed: int = 0) -> None:
    """Random weights at the real shapes: N(0, 0.02) matrices, zero biases, unit norms."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def build_model(
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    attention_backend: str = "auto",
) -> DecoderForCausalLM:
    """An uninitialised model (storage allocated, values undefined) on ``device`` in ``dtype``."""
    cls = get_model_class(cfg.architecture)
    backend = get_attention_backend(attention_backend, device.type)
    with torch.device("meta"):
        model = cls(cfg, backend)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    model.use_ops(get_ops(device, "triton" if attention_backend == "triton" else "auto"))
    return model.eval()


def load_model(
    model_dir: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype = "auto",
    load_format: str = "auto",
    attention_backend: str = "auto",
    quantization: str = "none",
    int8_compute: str = "off",
    tensor_parallel: tuple[int, int] | None = None,
) -> DecoderForCausalLM:
    """Load a Llama-family model from a Hugging Face folder.

    Args:
        model_dir: folder with ``config.json`` and safetensors weights (not needed for dummy).
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``/None.
        dtype: ``auto`` | ``float32`` | ``bfloat16`` | ``float16`` or a torch dtype.
        load_format: ``auto``/``safetensors`` reads the weights; ``dummy`` makes random ones.
        attention_backend: ``auto`` | ``torch`` (more with the kernels package).
        quantization: ``none`` | ``int8`` | ``int4``: weight-only quantization of every linear
            layer after loading (:mod:`tokenmill.engine.quantization`).
        int8_compute: ``auto`` | ``on`` | ``off``: the quantized layers' large steps as int8
            GEMMs (:mod:`tokenmill.engine.int8_compute`); ``on`` without an int8 path here
            is a :class:`ModelLoadError`.
        tensor_parallel: ``(rank, world)``: keep only this rank's shard
            (:mod:`tokenmill.engine.parallel.tensor_parallel`), cut after loading and before
            quantization; the row-parallel layers all-reduce over torch.distributed's default
            group, which the caller has initialised. ``model.config`` is then the rank's.

    Raises:
        ModelLoadError: any problem with the folder, its config or its weights (one line).
    """
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(
            f"unknown load format {load_format!r}; choose from {', '.join(LOAD_FORMATS)}"
        )
    path = Path(model_dir).expanduser()
    cfg = load_model_config(path)
    dev = resolve_device(device if device is None else str(device))
    torch_dtype = resolve_dtype(dtype, dev)
    check_quantization(quantization, dev, torch_dtype)
    model = build_model(cfg, dev, torch_dtype, attention_backend)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        load_safetensors_weights(model, safetensors_files(path))
    if tensor_parallel is not None and tensor_parallel[1] > 1:
        try:
            shard = plan_shard(cfg, *tensor_parallel)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
        shard_model(model, shard)
    quantize_model(model, quantization, int8_compute=resolve_int8_compute(int8_compute, dev))
    path = int8_compute_path(model)
    if path is not None and hasattr(model.backend, "prefill_dtype"):
        # beside int8 GEMMs a prompt's attention may multiply in a lower precision too
        model.backend.prefill_dtype = prefill_attention_dtype(path)
    return model
