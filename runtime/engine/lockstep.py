"""The step loop that keeps all ranks in lockstep.

Attention is data-parallel but every MoE layer is collective, so every rank must run every step's
forward pass, even with zero tokens. The loop does one small control exchange per step, on the
CPU (a gloo group: the default group on CPU ranks, a separate gloo group next to NCCL on GPUs):

    payload_r = {events of r's last step, busy_r, (rank 0) new assignments, (rank 0) closing}
    gathered  = all_gather_object(payload_r)        # every rank sees every rank's payload
    add the assignments addressed to me; run = any(busy) or any(assignments)
    run  -> every rank steps (forward over its batch, maybe empty; MoE collectives inside)
    idle -> nobody steps; leave when rank 0 is closing, else rank 0 naps briefly and polls again

Because every rank decides from the same gathered data, the decision is identical everywhere: no
rank can enter a forward pass the others skip. Events of step k reach rank 0 at exchange k+1; the
loop ends only after an exchange where no rank is busy, so nothing is lost. Rank 0 validates
requests (a bad one becomes an error event at once and is never assigned) and assigns each valid
one to the rank with the fewest outstanding requests; that rank owns its KV for its whole life.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Protocol

from zerodram.runtime.engine.request import RequestError, SamplingParams, TokenEvent
from zerodram.runtime.errors import ZerodramError

IDLE_NAP_S = 0.005


class RequestSource(Protocol):
    """Rank 0's incoming requests: (request_id, prompt_ids or an error, params)."""

    def poll(self) -> list[tuple[int, Any, SamplingParams]]: ...

    @property
    def closed(self) -> bool:
        """True once no request will ever come again and `poll` has handed out everything."""
        ...


class ListSource:
    """All requests known up front (`Engine.generate`)."""

    def __init__(self, items: list[tuple[int, Any, SamplingParams]]) -> None:
        self._items = list(items)

    def poll(self) -> list[tuple[int, Any, SamplingParams]]:
        items, self._items = self._items, []
        return items

    @property
    def closed(self) -> bool:
        return not self._items


class _Control:
    """The per-step CPU exchange (none in a single process): the context's bounded all-gather."""

    def __init__(self, engine: Any) -> None:
        self.world_size = engine.world_size
        self.ctx = engine.ctx

    def exchange(self, payload: dict) -> list[dict]:
        if self.world_size == 1:
            return [payload]
        return self.ctx.all_gather_object(payload, "the step's control payload")


def run_lockstep(engine: Any, source: RequestSource) -> Iterator[TokenEvent]:
    """Drive `engine` until `source` is closed and every rank is idle; rank 0 yields all events."""
    control = _Control(engine)
    rank, W = engine.rank, engine.world_size
    outstanding = [0] * W  # rank 0's count of unfinished requests per rank
    last_events: list[TokenEvent] = []
    while True:
        payload: dict[str, Any] = {"events": last_events, "busy": engine.has_work}
        early: list[TokenEvent] = []
        if rank == 0:
            assign = []
            for rid, prompt, params in source.poll():
                try:
                    if isinstance(prompt, ZerodramError):
                        raise RequestError(str(prompt))
                    req = engine.validate(rid, prompt, params)
                except (RequestError, ZerodramError, TypeError) as err:
                    early.append(TokenEvent(rid, None, "error", error=str(err)))
                    if engine.on_error is not None:
                        engine.on_error(f"request {rid} refused: {err}")
                    continue
                dst = min(range(W), key=lambda r: (outstanding[r], r))
                outstanding[dst] += 1
                assign.append((dst, req))
            payload["assign"] = assign
            payload["closing"] = source.closed
        gathered = control.exchange(payload)
        yield from early
        if rank == 0:
            for p in gathered:
                for ev in p["events"]:
                    if ev.finish_reason is not None:
                        outstanding[ev.rank] -= 1
                    yield ev
        assigned = gathered[0]["assign"]
        for dst, req in assigned:
            if dst == rank:
                engine.add_request(req)
        if any(p["busy"] for p in gathered) or assigned:
            last_events = engine.step()
            continue
        last_events = []
        if gathered[0]["closing"]:
            return
        if rank == 0:
            time.sleep(IDLE_NAP_S)
