"""Live KV-quality telemetry: how far the quantized KV cache is from full precision, per layer.

The engine calls `take_turn` at each K/V write of a layer, and on one write in `period` hands
`record_raw` a few of the freshly written rows at full precision with the KV format's round trip,
which runs later, off the step (runtime/engine/metrics_bridge.py). A caller that already has the
dequantized block calls `maybe_sample` (or `record`) with both. Either way the kept rows are sliced,
detached and copied to the host (asynchronously on a GPU, with an event to say when the copy
landed); nothing is computed in the step. `summarize()`, called when a
snapshot is built (publisher thread), turns the landed samples into relative errors:

    k_rel_err     = ||k_deq - k_fp||_F / ||k_fp||_F      over the sampled rows
    v_rel_err     = same for V
    score_rel_err = ||q k_deqᵀ - q k_fpᵀ||_F / ||q k_fpᵀ||_F   when a query was given

Shapes (legend): N rows of the written block, D head dim (always the last dimension), M query rows.
    k_fp, k_deq, v_fp, v_deq   [..., D]  (any leading dims: tokens, heads) -> rows [N, D]
    q                          [..., D]                                    -> rows [M, D]
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zerodram.runtime.metrics.snapshot import KvQualityLayer

log = logging.getLogger("zerodram.metrics")


# (layer_idx, k [n, Hkv, Dh], v [n, Hkv, Dh]) -> (k_deq, v_deq) as the KV format reads them back
Roundtrip = Callable[[int, torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor] | None"]


@dataclass(eq=False)  # identity: samples hold tensors, which have no truth value
class _Sample:
    layer_idx: int
    # k_fp, k_deq, v_fp, v_deq[, q] as [rows, D]; or, with `roundtrip`, k, v, q as written
    tensors: tuple[torch.Tensor, ...]
    ready: Any  # a torch.cuda.Event, or None when the copy was synchronous (CPU)
    roundtrip: Roundtrip | None = None


def _to_host(tensors: list[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Host copies of `tensors` and an event that says when they landed (None on CPU: copied)."""
    if not tensors[0].is_cuda:
        return tuple(t.detach().clone() for t in tensors), None
    # One cat and one D2H copy where the shapes allow (kernel launches are the cost here, not
    # bytes); the copy is enqueued on the current stream and the event says when it is safe to read.
    if len({t.shape[1:] for t in tensors}) == 1:
        packed = torch.cat(tensors).to("cpu", non_blocking=True)
        host = tuple(packed.split([t.shape[0] for t in tensors]))
    else:
        host = tuple(t.to("cpu", non_blocking=True) for t in tensors)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


class KvQualitySampler:
    """Samples K/V blocks at a low rate and reports per-layer relative errors.

    Args:
        num_layers: layers the engine has (samples for other indices raise IndexError).
        period: keep one `maybe_sample` call in `period`, per layer (64 = a ~1.6% rate).
        max_rows: rows of K/V kept per sample (from a strided pick over the block).
        max_query_rows: query rows kept per sample.
        window: samples per layer averaged into the reported errors.
        max_pending: samples waiting for `summarize`; the oldest are dropped beyond that.
    """

    def __init__(
        self,
        num_layers: int,
        *,
        period: int = 64,
        max_rows: int = 32,
        max_query_rows: int = 8,
        window: int = 16,
        max_pending: int = 256,
    ) -> None:
        if period < 1:
            raise ValueError(f"period must be >= 1, got {period}")
        self.num_layers = num_layers
        self.period = period
        self.max_rows = max_rows
        self.max_query_rows = max_query_rows
        # Stagger the layers so that one step does not sample all of them at once.
        self._countdown = [1 + (i % period) for i in range(num_layers)]
        self._pending: deque[_Sample] = deque(maxlen=max_pending)
        self._errors = [deque(maxlen=window) for _ in range(num_layers)]  # (k, v, score | None)
        self._num_samples = [0] * num_layers
        self._lock = threading.Lock()
        self._roundtrip_failed = False

    def maybe_sample(
        self,
        layer_idx: int,
        k_fp: torch.Tensor,
        k_deq: torch.Tensor,
        v_fp: torch.Tensor,
        v_deq: torch.Tensor,
        q: torch.Tensor | None = None,
    ) -> bool:
        """Keep this write for quality measurement if it is this layer's turn; True if kept.

        Cheap when not kept (a counter decrement). When kept: slicing plus a small device-to-host
        copy enqueued on the current stream, no synchronisation.

        Raises:
            IndexError: `layer_idx` outside [0, num_layers).
            ValueError: K and its dequantized copy (or V and its copy) differ in shape.
        """
        if not self.take_turn(layer_idx):
            return False
        self.record(layer_idx, k_fp, k_deq, v_fp, v_deq, q)
        return True

    def take_turn(self, layer_idx: int) -> bool:
        """True when this write of `layer_idx` is to be sampled (then call `record`): lets a
        caller that must compute the dequantized copy do so only for the writes kept."""
        self._countdown[layer_idx] -= 1
        if self._countdown[layer_idx] > 0:
            return False
        self._countdown[layer_idx] = self.period
        return True

    def record(
        self,
        layer_idx: int,
        k_fp: torch.Tensor,
        k_deq: torch.Tensor,
        v_fp: torch.Tensor,
        v_deq: torch.Tensor,
        q: torch.Tensor | None = None,
    ) -> None:
        """Keep this sample unconditionally (see `maybe_sample` for arguments and errors)."""
        if k_fp.shape != k_deq.shape or v_fp.shape != v_deq.shape:
            raise ValueError(
                f"layer {layer_idx}: K {tuple(k_fp.shape)} vs dequantized {tuple(k_deq.shape)}, "
                f"V {tuple(v_fp.shape)} vs dequantized {tuple(v_deq.shape)}"
            )
        rows = [self._rows(t, self.max_rows) for t in (k_fp, k_deq, v_fp, v_deq)]
        if q is not None and q.shape[-1] == k_fp.shape[-1]:
            rows.append(self._rows(q, self.max_query_rows))
        host, ready = _to_host(rows)
        with self._lock:
            self._pending.append(_Sample(layer_idx, host, ready))

    def record_raw(
        self,
        layer_idx: int,
        k_fp: torch.Tensor,
        v_fp: torch.Tensor,
        q: torch.Tensor,
        roundtrip: Roundtrip,
    ) -> None:
        """Keep a few freshly written tokens whose stored values are computed later, off the step.

        k_fp, v_fp [n, Hkv, Dh] and q [n, Hq, Dh] are copied to the host as they are (no sync);
        when the sample is summarized (publisher thread), `roundtrip(layer_idx, k, v)` on those
        host copies gives what the KV format reads them back as (or None: the sample is dropped).
        So a format whose quantizer checks its input or searches scales never syncs the step.
        """
        host, ready = _to_host([k_fp.detach(), v_fp.detach(), q.detach()])
        with self._lock:
            self._pending.append(_Sample(layer_idx, host, ready, roundtrip))

    def _round_trip(self, s: _Sample) -> tuple[torch.Tensor, ...] | None:
        k, v, q = (t.float() for t in s.tensors)
        try:
            back = s.roundtrip(s.layer_idx, k, v)
        except Exception:
            if not self._roundtrip_failed:
                log.exception("KV-quality round trip failed; such samples are dropped (logged once)")
            self._roundtrip_failed = True
            return None
        if back is None:
            return None
        rows = [self._rows(t, self.max_rows) for t in (k, back[0], v, back[1])]
        return (*rows, self._rows(q, self.max_query_rows))

    @staticmethod
    def _rows(t: torch.Tensor, max_rows: int) -> torch.Tensor:
        flat = t.detach().reshape(-1, t.shape[-1])  # [N, D]
        stride = max(1, flat.shape[0] // max_rows)
        return flat[::stride][:max_rows]

    def summarize(self) -> tuple[KvQualityLayer, ...]:
        """Fold the samples whose copies have landed into the per-layer errors; return them.

        Call from any thread but the step thread's hot path (the publisher thread does).
        """
        with self._lock:
            todo = [s for s in self._pending if s.ready is None or s.ready.query()]
            for s in todo:
                self._pending.remove(s)
        for s in todo:
            tensors = s.tensors if s.roundtrip is None else self._round_trip(s)
            if tensors is None:
                continue
            self._errors[s.layer_idx].append(_errors_of(tensors))
            self._num_samples[s.layer_idx] += 1
        out = []
        for layer_idx, errs in enumerate(self._errors):
            if not errs:
                continue
            scores = [e[2] for e in errs if e[2] is not None]
            out.append(
                KvQualityLayer(
                    layer_idx=layer_idx,
                    k_rel_err=sum(e[0] for e in errs) / len(errs),
                    v_rel_err=sum(e[1] for e in errs) / len(errs),
                    score_rel_err=sum(scores) / len(scores) if scores else None,
                    num_samples=self._num_samples[layer_idx],
                )
            )
        return tuple(out)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact||_F / ||exact||_F in float32 (0.0 when both are zero, inf if only exact is)."""
    a, e = approx.float(), exact.float()
    num = torch.linalg.vector_norm(a - e).item()
    den = torch.linalg.vector_norm(e).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def _errors_of(t: tuple[torch.Tensor, ...]) -> tuple[float, float, float | None]:
    k_fp, k_deq, v_fp, v_deq = t[:4]
    score = None
    if len(t) == 5:
        q = t[4].float()  # [M, D]
        score = relative_error(q @ k_deq.float().T, q @ k_fp.float().T)  # [M, N]
    return relative_error(k_deq, k_fp), relative_error(v_deq, v_fp), score
