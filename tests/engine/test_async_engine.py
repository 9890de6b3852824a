"""The engine core in its own process, driven by AsyncEngine: streaming, concurrency, abort
freeing blocks at once, rejection, and a dead engine reported instead of a hang."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.errors import RequestRejected
from tokenmill.engine.llm import LLM
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.tokenizer import encode_chat, load_tokenizer

pytestmark = pytest.mark.slow


def test_async_engine_end_to_end(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    chat = encode_chat(tok, "What is the capital of France?")
    long_prompt = tok.encode("Tell me a long story about a lighthouse keeper. " * 3)
    expected = LLM(str(smollm2_dir)).generate([chat], SamplingParams(max_tokens=16))[0]

    async def main():
        engine = AsyncEngine(EngineConfig(model=str(smollm2_dir), kv_cache_memory=64 << 20))
        info = await engine.start()
        records = []
        engine.add_step_listener(records.append)
        try:
            assert info["pid"] != os.getpid() and engine.alive

            async def collect(rid, prompt, params):
                outs = [o async for o in engine.generate(rid, prompt, params)]
                return outs

            # two concurrent streams, one of them the reference chat
            a, b = await asyncio.gather(
                collect("a", chat, SamplingParams(max_tokens=16)),
                collect("b", long_prompt, SamplingParams(max_tokens=8, ignore_eos=True)),
            )
            assert [t for o in a for t in o.new_token_ids] == expected.token_ids
            assert "".join(o.new_text for o in a) == expected.text
            assert a[-1].finished and a[-1].finish_reason == "stop"
            assert (
                len([t for o in b for t in o.new_token_ids]) == 8
                and b[-1].finish_reason == "length"
            )
            assert a[0].stats.first_token_ns >= a[0].stats.scheduled_ns >= a[0].stats.queued_ns
            assert any(r.num_running == 2 for r in records), records  # the two were batched

            # a client that walks away mid-stream: the request is aborted and its blocks freed
            gen = engine.generate("c", long_prompt, SamplingParams(max_tokens=200, ignore_eos=True))
            first = await gen.__anext__()
            assert not first.finished
            await gen.aclose()
            for _ in range(300):  # a liveness wait, not a speed bound
                await engine.refresh_stats()
                await asyncio.sleep(0.1)
                if engine.stats.get("kv_blocks_used") == 0 and engine.stats.get("num_running") == 0:
                    break
            assert engine.stats["kv_blocks_used"] == 0 and engine.stats["num_running"] == 0, (
                engine.stats
            )

            # explicit abort ends the stream with finish_reason "abort"
            outs = []
            async for o in engine.generate(
                "d", long_prompt, SamplingParams(max_tokens=200, ignore_eos=True)
            ):
                outs.append(o)
                if len(outs) == 2:
                    await engine.abort("d")
            assert outs[-1].finish_reason == "abort" and len(outs) < 200

            with pytest.raises(RequestRejected, match="exceeds the model's context"):
                async for _ in engine.generate("e", [1] * 8190, SamplingParams(max_tokens=10)):
                    pass
            with pytest.raises(ValueError, match="outside the vocabulary"):
                async for _ in engine.generate("f", [10**7], SamplingParams()):
                    pass

            # the engine process dies: a waiting stream gets an error, not a hang
            gen = engine.generate(
                "g", long_prompt, SamplingParams(max_tokens=1000, ignore_eos=True)
            )
            await gen.__anext__()
            os.kill(engine.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                async for _ in gen:
                    pass
            assert not engine.alive
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate("h", chat, SamplingParams()):
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), timeout=600))


@pytest.mark.parametrize("pause_s", [0.0, 0.05, 0.3])
def test_engine_that_cannot_start_says_why(tmp_path, pause_s):
    """The process reports a fatal error and exits while we shut down. A PUSH send to a peer
    that is going away used to block forever (CI hung here); shutdown must return at any
    point of the child's exit."""

    async def main():
        engine = AsyncEngine(EngineConfig(model=str(tmp_path)))
        try:
            with pytest.raises(EngineDeadError, match=r"has no config\.json"):
                await engine.start(timeout_s=300)
            await asyncio.sleep(pause_s)
        finally:
            await asyncio.wait_for(engine.shutdown(), timeout=120)
        assert not engine.process.is_alive()

    asyncio.run(main())
