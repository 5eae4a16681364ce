"""Continuous batching with chunked prefill over one rank's KV partition.

Each step the scheduler builds one `ForwardBatch`:

1. every running request that has finished its prompt decodes one token;
2. waiting requests are admitted in arrival order while the batch has room (`max_num_seqs`) and
   the KV partition can reserve pages for the request's whole budget (prompt + max_tokens);
   the head of the queue that does not fit now waits (FIFO: later ones do not jump it);
3. requests still in prefill get prompt chunks of at most `prefill_chunk` tokens, within the
   step's token budget (`max_step_tokens`, decode tokens counted first).

Reserving the whole budget at admission means a running request never runs out of pages, so
there is no preemption; requests that could never fit were rejected by `validate`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from zerodram.runtime.engine.kv import KVCapacityError, KVPartition
from zerodram.runtime.engine.request import Request
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.model.batch import ForwardBatch


@dataclass(frozen=True)
class SchedulerConfig:
    """max_num_seqs: running requests per rank; max_step_tokens: tokens per step;
    prefill_chunk: prompt tokens per request per step."""

    max_num_seqs: int = 16
    max_step_tokens: int = 256
    prefill_chunk: int = 128

    def __post_init__(self) -> None:
        if min(self.max_num_seqs, self.max_step_tokens, self.prefill_chunk) < 1:
            raise ConfigError(f"scheduler limits must be >= 1: {self}")
        if self.max_step_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_step_tokens={self.max_step_tokens} < max_num_seqs={self.max_num_seqs}: "
                "a full decode batch would not fit one step"
            )


@dataclass(frozen=True)
class ScheduledStep:
    """The batch plus, for each logits row, the request it samples for."""

    batch: ForwardBatch
    sampled: tuple[Request, ...]
    num_prefill_tokens: int


class Scheduler:
    """Owns the waiting queue and the running set of one rank."""

    def __init__(self, kv: KVPartition, config: SchedulerConfig, device: torch.device) -> None:
        self.kv = kv
        self.config = config
        self.device = device
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            try:
                self.kv.reserve(req.request_id, req.max_total_tokens)
            except KVCapacityError:
                self.kv.free(req.request_id)  # drop a partial reservation; wait for pages
                return
            self.running.append(self.waiting.popleft())

    def schedule(self) -> ScheduledStep:
        """The next step's batch (possibly empty)."""
        self._admit()
        budget = self.config.max_step_tokens
        decode, sampled = [], []
        for req in self.running:
            if req.prefill_done and req.finish_reason is None:
                pos = req.num_tokens - 1  # the last sampled token is not in the cache yet
                decode.append((req.request_id, pos, req.output_ids[-1]))
                sampled.append(req)
                budget -= 1
        prefill, wants, prefill_reqs = [], [], []
        for req in self.running:
            if req.prefill_done or budget <= 0:
                continue
            n = min(len(req.prompt_ids) - req.num_prefilled, self.config.prefill_chunk, budget)
            start = req.num_prefilled
            prefill.append((req.request_id, start, req.prompt_ids[start : start + n]))
            last = start + n == len(req.prompt_ids)
            wants.append(last)
            if last:
                prefill_reqs.append(req)
            req.num_prefilled += n
            budget -= n
        batch = ForwardBatch.build(decode, prefill, wants, self.device)
        num_prefill = sum(len(t) for _, _, t in prefill)
        return ScheduledStep(batch, tuple(sampled + prefill_reqs), num_prefill)

    def finish(self, req: Request, reason: str) -> None:
        """Mark `req` finished, free its pages, drop it from the running set."""
        req.finish_reason = reason
        self.kv.free(req.request_id)
        self.running.remove(req)
