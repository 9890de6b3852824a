"""The state of one request inside the engine.

There are no prefill and decode phases: a request has ``num_tokens`` (prompt + output so far)
and ``num_computed_tokens`` (those whose K/V are in the cache), and each step computes some of
the difference. A step that brings ``num_computed_tokens`` up to ``num_tokens`` samples the next
token. Times are wall-clock nanoseconds (``time.time_ns()``) so the API process can build spans
from them.

The planner (``plan.simulate``) replays recorded traffic through the engine's scheduler with
these same requests, over a declared seam: tokens are appended only through
:meth:`Request.append_token`, and whatever the replay keeps per request sits in
:attr:`Request.driver_state`; it sets no other attribute of its own.
"""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from .messages import CacheMiss, RequestEvent, RequestStats
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = ["FINISH_REASONS", "Request", "RequestEvent", "RequestStatus"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"
    # prefilled here and handed to a decode engine core with its KV (disaggregation): done on
    # this core, its blocks held until the hand-off is taken
    FINISHED_HANDED_OFF = "finished_handed_off"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_HANDED_OFF: "handoff",
}


class Request:
    """One request: tokens, progress, KV blocks, timestamps and counters.

    Args:
        request_id: unique id (the API's ``x-request-id``).
        prompt_token_ids: the prompt, tokenized.
        params: its :class:`SamplingParams`.
        priority: lower is served first under the ``priority`` policy.
        tenant: owner; salts prefix-cache hashes under ``prefix_cache_scope=tenant``.
        arrival_ns: when the request arrived (default: now).

    Attributes:
        driver_state: whatever the code that drives the scheduler keeps per request; the
            engine never reads or sets it. The planner's replay (``plan.simulate``) keeps
            its workload row and prefix-cache bookkeeping there.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        tenant: str = "",
        arrival_ns: int | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.times_skipped = 0  # later requests admitted ahead of it (skip_ahead admission)
        self.params = params
        self.priority = priority
        self.tenant = tenant
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        # chained prefix-cache hashes of its full blocks (BlockManager.extend_hashes)
        self.block_hashes: list[Hashable] = []
        self.content_hashes: list[Hashable] = []  # salt-free (BlockManager.explain_misses)
        # why its prompt blocks missed the prefix cache at first admission; sent once
        self.cache_misses: list[CacheMiss] | None = None

        self.arrival_ns = arrival_ns if arrival_ns is not None else time.time_ns()
        self.token_ns: list[int] = []
        self.finished_ns: int | None = None
        # its counters and milestones, as every output and the requests row carry them
        self.stats = RequestStats(input_tokens=len(self.prompt_token_ids), queued_ns=time.time_ns())

        # speculative decoding: drafts proposed for the next step
        self.spec_token_ids: list[int] = []

        self.events: list[RequestEvent] = []
        self.stop_reason: int | str | None = None
        self.error_type: str | None = None
        self.error_message: str | None = None
        # disaggregation: end on this core after the first token, KV held for take_handoff
        self.hand_off = False
        self.driver_state: Any = None

    @functools.cached_property
    def generator(self) -> torch.Generator | None:
        """Its own CPU random generator when it has a seed, made on first use: only the engine
        core samples, so the scheduler and the planner never import torch."""
        if self.params.seed is None:
            return None
        import torch

        return torch.Generator().manual_seed(self.params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def sort_key(self) -> tuple[int, int]:
        """Rank under the ``priority`` policy: lower priority value, then earlier arrival."""
        return (self.priority, self.arrival_ns)

    def append_token(self, token_id: int, now_ns: int | None, count: int = 1) -> None:
        """Append a sampled token to its tokens and its output, ``count`` times: the one way a
        token is added (the engine core after each step, a token at a time; the planner's
        replay, a run of ``count`` decode steps' stand-in token at once).

        ``now_ns``: when it was sampled, kept per token (``token_ns``) and as the first
        token's time; None keeps no times (the replay books its own).
        """
        if count == 1:
            self.all_token_ids.append(token_id)
            self.output_token_ids.append(token_id)
        else:
            run = [token_id] * count
            self.all_token_ids.extend(run)
            self.output_token_ids.extend(run)
        self.stats.output_tokens = len(self.output_token_ids)
        if now_ns is not None:
            self.token_ns.extend([now_ns] * count)
            if self.stats.first_token_ns is None:
                self.stats.first_token_ns = now_ns

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, computed {self.num_computed_tokens}/"
            f"{self.num_tokens}, blocks {self.block_ids})"
        )
