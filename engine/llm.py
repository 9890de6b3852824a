"""Offline batch inference: ``LLM(...).generate(prompts, params)`` runs an in-process
:class:`EngineCore` until every prompt finishes — the same scheduler, cache and sampler as the
server, without the process boundary."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from .config import EngineConfig
from .core import EngineCore
from .messages import RequestOutput, RequestStats, StepRecord
from .sampling import SamplingParams
from .tokenizer import encode_chat


@dataclass
class CompletedRequest:
    """A finished request with its whole output and timings.

    ``ttft_s`` (time to first token) and ``e2e_s`` (end-to-end latency) are measured from the
    request's arrival, in seconds; ``itl_s`` holds the inter-token latencies (s); ``stats`` the
    engine's counters (cached and recomputed tokens, preemptions, speculation).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error_type: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    arrival_ns: int = 0
    token_ns: list[int] = field(default_factory=list)
    finished_ns: int | None = None

    @property
    def ttft_s(self) -> float | None:
        return (self.token_ns[0] - self.arrival_ns) / 1e9 if self.token_ns else None

    @property
    def e2e_s(self) -> float | None:
        return (self.finished_ns - self.arrival_ns) / 1e9 if self.finished_ns else None

    @property
    def itl_s(self) -> list[float]:
        return [(b - a) / 1e9 for a, b in itertools.pairwise(self.token_ns)]

    def absorb(self, out: RequestOutput) -> None:
        self.token_ids.extend(out.new_token_ids)
        self.token_ns.extend(out.token_ns)
        self.text += out.new_text
        self.finish_reason = out.finish_reason
        self.stop_reason = out.stop_reason
        self.error_type = out.error_type
        self.stats = out.stats
        self.arrival_ns = out.arrival_ns
        self.finished_ns = out.finished_ns


class LLM:
    """Offline engine.

    Args:
        model: Hugging Face folder (None = the default SmolLM2 model).
        **engine_args: any :class:`EngineConfig` field (``max_num_seqs``, ``enable_prefix_caching``…).

    Raises:
        ModelLoadError, ValueError: bad model folder or engine arguments.
    """

    def __init__(self, model: str | None = None, *, core: EngineCore | None = None, **engine_args):
        self.config = EngineConfig(model=model, **engine_args)
        self.core = core or EngineCore(self.config)
        self.tokenizer = self.core.tokenizer
        self.step_records: list[StepRecord] = []
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallel ranks), if any."""
        self.core.close()

    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        priorities: list[int] | None = None,
        tenants: list[str] | None = None,
    ) -> list[CompletedRequest]:
        """Run prompts (text or token ids) to completion; results in prompt order.

        Raises:
            ValueError / RequestRejected: a bad prompt or parameters (nothing is run then).
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} sampling params for {len(prompts)} prompts")
        results: dict[str, CompletedRequest] = {}
        order = []
        added = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, plist)):
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                rid = f"offline-{next(self._ids)}"
                self.core.add_request(
                    rid,
                    ids,
                    p,
                    priority=priorities[i] if priorities else 0,
                    tenant=tenants[i] if tenants else "",
                )
                added.append(rid)
                results[rid] = CompletedRequest(rid, ids)
                order.append(rid)
        except Exception:
            self.core.abort(added)
            raise
        pending = set(order)
        try:
            self._run(pending, results)
        except BaseException:
            self.core.abort(list(pending))  # leave the engine usable for the next call
            raise
        return [results[rid] for rid in order]

    def _run(self, pending: set[str], results: dict[str, CompletedRequest]) -> None:
        while pending:
            outputs, record = self.core.step()
            if record is not None:
                self.step_records.append(record)
            for out in outputs:
                results[out.request_id].absorb(out)
                if out.finished:
                    pending.discard(out.request_id)

    def chat(
        self, messages: list[str | list[dict]], params: SamplingParams | None = None
    ) -> list[CompletedRequest]:
        """Like :meth:`generate` for chats (one user message or a list of role/content dicts)."""
        return self.generate([encode_chat(self.tokenizer, m) for m in messages], params)
