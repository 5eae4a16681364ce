"""The decode step from static buffers, piecewise: CUDA graphs between the attention calls.

Shape legend: Bp bucket (padded batch), B decode rows of the step, D hidden, Hq / Hkv heads,
Dh head dim, V vocab, K top-k, Ly layers.

What is captured and what is not (docs/engine.md says it for users):

    piece 0        embed -> layer 0's norm, q/k/v projections, q/k norms, RoPE        graph
    attention 0    KV write + decode attention of the B real rows                    eager
    piece i        layer i-1's o_proj + residual + FFN (router, experts, shared)
                   -> layer i's pre-attention                                        graph
    ...
    piece Ly       the last layer's o_proj + FFN -> final norm -> LM head            graph

The KV write stays eager: runtime/kv's append is host bookkeeping (page allocation, tail flush
decisions, a finite-check that reads a flag back) around a torch quantizer, and the decode
attention reads the step's block tables, built on the host each step. Everything between two
attention calls is static in shape once the batch is padded to a bucket, so it is captured:
one graph per piece and bucket, Ly + 1 graphs per bucket. Pieces talk only through the static
buffers (`StaticBuffers`), never through tensors allocated inside a graph.

The same `StaticDecodeStep` runs its pieces eagerly where it does not capture (CPU tests), so
the padding, bucketing and buffer plumbing are tested without a GPU.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.model.attention import PagedAttention
from zerodram.runtime.model.batch import ForwardBatch
from zerodram.runtime.model.ep import ExpertParallel, capturable_ep
from zerodram.runtime.model.transformer import Transformer

log = logging.getLogger("zerodram.engine")


@dataclass(frozen=True)
class StaticBuffers:
    """One bucket's inputs, outputs and the residual stream between pieces.

    token_ids, positions: [Bp] int64; x: [Bp, D] residual (model dtype); q: [Bp, Hq, Dh];
    k, v: [Bp, Hkv, Dh]; o: [Bp, Hq, Dh] attention output; logits: [Bp, V] fp32;
    routed: per layer [Bp, K] int64 expert choices (MoE layers; None for dense ones).
    Rows >= B hold whatever an earlier step left: every op is row-wise, so they reach no real row.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    x: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    logits: torch.Tensor
    routed: tuple[torch.Tensor | None, ...]

    @classmethod
    def allocate(cls, model: Transformer, bucket: int) -> StaticBuffers:
        c, dev, dt = model.config, model.device, model.dtype
        i64 = {"dtype": torch.int64, "device": dev}
        return cls(
            token_ids=torch.zeros(bucket, **i64),
            positions=torch.zeros(bucket, **i64),
            x=torch.zeros(bucket, c.hidden_size, dtype=dt, device=dev),
            q=torch.zeros(bucket, c.num_heads, c.head_dim, dtype=dt, device=dev),
            k=torch.zeros(bucket, c.num_kv_heads, c.head_dim, dtype=dt, device=dev),
            v=torch.zeros(bucket, c.num_kv_heads, c.head_dim, dtype=dt, device=dev),
            o=torch.zeros(bucket, c.num_heads, c.head_dim, dtype=dt, device=dev),
            logits=torch.zeros(bucket, c.vocab_size, dtype=torch.float32, device=dev),
            routed=tuple(
                torch.zeros(bucket, c.num_experts_per_tok, **i64) if layer.is_moe else None
                for layer in model.layers
            ),
        )


class _RoutedInto:
    """The pieces' PhaseTimer: no phase timing inside a graph (events cannot be recorded and read
    there), and each MoE layer's expert choices copied into the static buffers, so that expert-load
    telemetry sees them after the replay."""

    _ctx = nullcontext()

    def __init__(self, routed: tuple[torch.Tensor | None, ...]) -> None:
        self.routed_bufs = routed

    def phase(self, name: str):
        return self._ctx

    def begin_step(self) -> None:
        pass

    def routed(self, layer_idx: int, topk_idx: torch.Tensor) -> None:
        self.routed_bufs[layer_idx].copy_(topk_idx)


class StaticDecodeStep:
    """One bucket's decode step: static buffers and the Ly + 1 pieces between attention calls.

    Args:
        model: the rank's transformer.
        eps: per layer, the capturable expert-parallel twin (None for dense layers).
        bucket: Bp, the padded batch size.
    """

    def __init__(self, model: Transformer, eps: list[ExpertParallel | None], bucket: int) -> None:
        self.model, self.eps, self.bucket = model, eps, bucket
        self.bufs = StaticBuffers.allocate(model, bucket)
        self._timer = _RoutedInto(self.bufs.routed)
        self.graphs: list[torch.cuda.CUDAGraph] | None = None

    def _piece(self, i: int) -> None:
        """Piece i: the layer before attention i (i = 0: the embedding) and attention i's inputs."""
        m, b = self.model, self.bufs
        if i == 0:
            x = F.embedding(b.token_ids, m.embed)  # [Bp, D]
        else:
            prev = m.layers[i - 1]
            x = prev.feed_forward(b.x + prev.attn_output(b.o), self._timer, self.eps[i - 1])
        if i == len(m.layers):
            b.logits.copy_(m.head(x))
            return
        q, k, v = m.layers[i].pre_attention(x, b.positions, m.rope)
        b.x.copy_(x)
        b.q.copy_(q)
        b.k.copy_(k)
        b.v.copy_(v)

    def capture(self) -> None:
        """Warm up every piece on a side stream (cuBLAS handles, lazy inits), then capture each
        into its own graph; the pieces share one memory pool (they replay in capture order and
        pass nothing through it)."""
        pieces = range(len(self.model.layers) + 1)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in pieces:
                self._piece(i)
        torch.cuda.current_stream().wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        graphs = []
        for i in pieces:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._piece(i)
            graphs.append(g)
        self.graphs = graphs

    def _run_piece(self, i: int) -> None:
        if self.graphs is None:
            self._piece(i)
        else:
            self.graphs[i].replay()

    def run(self, batch: ForwardBatch, attn: PagedAttention) -> torch.Tensor:
        """A decode-only batch (B <= Bp rows) -> fp32 logits [B, V], a view of the static buffer
        (valid until this bucket's next step)."""
        m, b, B = self.model, self.bufs, batch.num_decode
        b.token_ids[:B].copy_(batch.token_ids)
        b.positions[:B].copy_(batch.positions)
        for i in range(len(m.layers)):
            self._run_piece(i)
            with m.timer.phase("attention"):
                b.o[:B].copy_(attn(i, b.q[:B], b.k[:B], b.v[:B], batch))
        self._run_piece(len(m.layers))
        for idx, routed in enumerate(b.routed):
            if routed is not None:
                m.timer.routed(idx, routed[:B])
        return b.logits[:B]


def bucket_sizes(max_batch: int) -> tuple[int, ...]:
    """Powers of two below `max_batch`, then `max_batch` itself: 1, 2, 4, ..., max_batch."""
    sizes = [1]
    while sizes[-1] * 2 < max_batch:
        sizes.append(sizes[-1] * 2)
    return tuple([*sizes, max_batch] if max_batch > 1 else sizes)


class DecodeGraphs:
    """The decode step from static buffers, one `StaticDecodeStep` per bucket.

    Args:
        model: the rank's transformer (all experts local: one rank).
        max_batch: the most decode rows of a step (the scheduler's max_num_seqs).
        capture: capture every bucket's pieces now (GPU); False runs them eagerly (CPU tests).

    Raises:
        ConfigError: a layer's experts have no capturable form (expert parallelism across ranks).
    """

    def __init__(self, model: Transformer, *, max_batch: int, capture: bool) -> None:
        eps = [capturable_ep(layer.ep) if layer.is_moe else None for layer in model.layers]
        missing = [
            layer.idx for layer, ep in zip(model.layers, eps, strict=True) if layer.is_moe and ep is None
        ]
        if missing:
            raise ConfigError(
                f"cuda_graphs: the experts of MoE layers {missing} ({type(model.layers[missing[0]].ep).__name__}) "
                "cannot be captured; CUDA graphs serve one rank with all experts local for now"
            )
        self.buckets = bucket_sizes(max_batch)
        self.steps = {bucket: StaticDecodeStep(model, eps, bucket) for bucket in self.buckets}
        if capture:
            t0 = time.perf_counter()
            with torch.inference_mode():  # as Engine.step runs
                for step in self.steps.values():
                    step.capture()
            log.info(
                "captured the decode step for batch buckets %s (%d graphs) in %.1f s",
                list(self.buckets), len(self.buckets) * (len(model.layers) + 1), time.perf_counter() - t0,
            )  # fmt: skip

    @staticmethod
    def dense_moe_layers(model: Transformer) -> list[int]:
        """MoE layers whose capturable experts run every expert on every row (`DenseLocalExperts`)
        while a token picks fewer than all: a graph would cost them E / K times the expert work."""
        from zerodram.runtime.model.ep import DenseLocalExperts

        return [
            layer.idx
            for layer in model.layers
            if layer.is_moe
            and model.config.num_experts > model.config.num_experts_per_tok
            and isinstance(capturable_ep(layer.ep), DenseLocalExperts)
        ]

    def eligible(self, batch: ForwardBatch) -> bool:
        """Decode rows only, at most the largest bucket (mixed prefill steps run eagerly)."""
        return not batch.prefill and 0 < batch.num_decode <= self.buckets[-1]

    def run(self, batch: ForwardBatch, attn: PagedAttention) -> torch.Tensor:
        """The step's logits [B, V] from the smallest bucket that holds its B rows."""
        B = batch.num_decode
        bucket = next(s for s in self.buckets if s >= B)
        return self.steps[bucket].run(batch, attn)
