"""Issue 20 item 1: where a step's time goes, stored per step. The engine times input
preparation and detokenization apart from the forward and sampling (``StepRecord.prepare_ms``,
``detokenize_ms``), and a store written before those fields still opens and diagnoses."""

from __future__ import annotations

import time

import duckdb
import torch
from synth_store import Phase, write_store
from tiny_model import write_tiny_llama

from tokenmill.diagnose.findings import diagnose
from tokenmill.engine import core as core_mod
from tokenmill.engine import model_runner
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.tokenizer import load_tokenizer
from tokenmill.telemetry.dump import open_dump

# binary fractions, so that the frozen clock's sums and differences are exact
PREPARE_S, DETOKENIZE_S = 2**-6, 2**-8


def _tiny_core(tmp_path, smollm2_dir) -> EngineCore:
    """A 1-layer dummy Llama (SmolLM2's tokenizer for text)."""
    write_tiny_llama(tmp_path, vocab_size=64)
    torch.manual_seed(0)
    cfg = EngineConfig(
        model=str(tmp_path), load_format="dummy", block_size=4, num_gpu_blocks_override=64
    )
    return EngineCore(cfg, tokenizer=load_tokenizer(smollm2_dir))


class _FrozenClock:
    """The engine's clock with time standing still except for the injected delays: each part
    of a step is then exactly the delay injected into it (0 for the rest), whatever the
    machine's speed. ``time_ns`` and ``perf_counter`` read it; anything else is real ``time``."""

    def __init__(self) -> None:
        self.t = 0.0
        self.base_ns = time.time_ns()

    def perf_counter(self) -> float:
        return self.t

    def time_ns(self) -> int:
        return self.base_ns + round(self.t * 1e9)

    def sleep(self, s: float) -> None:
        self.t += s

    def __getattr__(self, name: str):
        return getattr(time, name)


def test_prepare_and_detokenize_are_timed_apart(tmp_path, smollm2_dir, monkeypatch):
    """A known delay injected into input preparation lands in prepare_ms, not forward_ms;
    one injected into each detokenizer call lands in detokenize_ms, not sample_ms; and the
    five parts never add up to more than the step's wall time."""
    build = model_runner.build_step_inputs
    add = IncrementalDetokenizer.add
    clock = _FrozenClock()

    def slow_build(*a, **k):
        clock.sleep(PREPARE_S)
        return build(*a, **k)

    def slow_add(self, token_id):
        clock.sleep(DETOKENIZE_S)
        return add(self, token_id)

    monkeypatch.setattr(core_mod, "time", clock)
    monkeypatch.setattr(model_runner, "time", clock)
    monkeypatch.setattr(model_runner, "build_step_inputs", slow_build)
    monkeypatch.setattr(IncrementalDetokenizer, "add", slow_add)
    core = _tiny_core(tmp_path, smollm2_dir)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    core.add_request("a", [1, 2, 3, 4, 5], params)
    core.add_request("b", [6, 7, 8], params)
    records = []
    while core.has_work():
        _, record = core.step()
        records.append(record)
    assert len(records) == 4
    for r in records:
        parts = r.schedule_ms + r.prepare_ms + r.forward_ms + r.sample_ms + r.detokenize_ms
        assert r.prepare_ms >= PREPARE_S * 1e3 > r.forward_ms, r
        # two requests sample a token each step: two detokenizer calls
        assert r.detokenize_ms >= 2 * DETOKENIZE_S * 1e3 > r.sample_ms, r
        assert parts <= (r.end_ns - r.start_ns) / 1e6 + 0.01, (parts, r)


def test_a_store_from_before_the_split_opens_and_diagnoses(tmp_path):
    """A dump written before prepare_ms/detokenize_ms existed (the columns dropped here) opens
    read-only, reads them as NULL, and diagnoses with the same findings as with them."""
    path = tmp_path / "old.duckdb"
    write_store(path, [Phase(duration_s=40), Phase(duration_s=30, queue_ms=2000)], seed=3)
    con = open_dump(path)
    now = [f.rule_id for f in diagnose(con).findings]
    con.close()
    con = duckdb.connect(str(path))
    con.execute("ALTER TABLE engine_steps DROP COLUMN prepare_ms")
    con.execute("ALTER TABLE engine_steps DROP COLUMN detokenize_ms")
    con.close()
    con = open_dump(path)
    n, with_value = con.execute(
        "SELECT count(*), count(prepare_ms) + count(detokenize_ms) FROM engine_steps"
    ).fetchone()
    assert n > 0 and with_value == 0
    assert [f.rule_id for f in diagnose(con).findings] == now and "ttft_queueing" in now
    con.close()
