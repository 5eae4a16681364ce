"""The decode step from static buffers, captured as CUDA graphs.

Shape legend: Bp bucket (padded batch), B decode rows of the step, D hidden, Hq / Hkv heads,
Dh head dim, V vocab, K top-k, Ly layers, Lb length bucket (the longest FP2 range, rounded up).

Two modes, chosen once at construction (docs/engine.md says it for users):

Whole step (FP2 KV read by the fused kernels, flushing one token at a time: the engine's default
format): the step is one graph per (Bp, Lb), captured the first time that pair is used. Each
layer's KV write (`write_decode_static`: fixed shapes, padding rows to a scratch slot) and its
decode attention (`Fp2FusedDecode.static_call`, the grid sized for Lb) are inside the graph;
outside it, once per step, only host bookkeeping (pages, lengths, the step's indices and
metadata, a few small copies into static buffers) and, after the replay, the NaN/Inf flags handed
to the partition's ledger.

Piecewise (every other KV format): CUDA graphs between the attention calls.

    piece 0        embed -> layer 0's norm, q/k/v projections, q/k norms, RoPE        graph
    attention 0    KV write + decode attention of the B real rows                    eager
    piece i        layer i-1's o_proj + residual + FFN (router, experts, shared)
                   -> layer i's pre-attention                                        graph
    ...
    piece Ly       the last layer's o_proj + FFN -> final norm -> LM head            graph

There the KV write stays eager (runtime/kv's general append is host bookkeeping around a torch
quantizer whose shapes vary with the flushes) and the gather + SDPA decode reads a length that
changes every step. Pieces talk only through the static buffers (`StaticBuffers`), never through
tensors allocated inside a graph; one graph per piece and bucket, captured at construction.

The same `StaticDecodeStep` runs eagerly where it does not capture (CPU tests), so the padding,
bucketing, static writes and buffer plumbing are tested without a GPU. Not seen inside a graph:
phase timers and the KV-quality probe (telemetry of the eager path).
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zerodram.runtime.errors import ConfigError, ZerodramError
from zerodram.runtime.model.attention import PagedAttention
from zerodram.runtime.model.batch import ForwardBatch
from zerodram.runtime.model.ep import ExpertParallel, capturable_ep
from zerodram.runtime.model.transformer import Transformer

log = logging.getLogger("zerodram.engine")


@dataclass(frozen=True)
class StaticBuffers:
    """One bucket's inputs, outputs and the residual stream between pieces.

    token_ids, positions: [Bp] int64; x: [Bp, D] residual (model dtype); q: [Bp, Hq, Dh];
    k, v: [Bp, Hkv, Dh]; o: [Bp, Hq, Dh] attention output; cos, sin: [Bp, 1, Dh] the step's RoPE
    angles (`Rope.cos_sin`, made by piece 0 for the later pieces); logits: [Bp, V] fp32;
    routed: per layer [Bp, K] int64 expert choices (MoE layers; None for dense ones).
    Rows >= B hold whatever an earlier step left: every op is row-wise, so they reach no real row.
    The whole-step graph reads token_ids and positions and writes logits and routed only; x, q,
    k, v, o, cos and sin carry values between the piecewise mode's graphs.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    x: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
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
            cos=torch.zeros(bucket, 1, c.head_dim, dtype=dt, device=dev),
            sin=torch.zeros(bucket, 1, c.head_dim, dtype=dt, device=dev),
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


class StaticAttention:
    """One bucket's KV writes and decode attention from static buffers (the whole-step mode).

    Args:
        kv: the partition (`RuntimeKVPartition` whose caches take `write_decode_static`).
        fused: its `Fp2FusedDecode`.
        bucket: Bp.
        num_layers: Ly.
        streams: (capture, write) streams where `fused.defers_write` (`priority_streams`; one pair
            for every bucket: the buckets' graphs share a memory pool, whose blocks are reused
            only by allocations on the stream that freed them).
    """

    def __init__(self, kv, fused, bucket: int, num_layers: int, streams: tuple | None = None) -> None:
        from zerodram.runtime.kv.decode_index import StaticDecodeIndex

        self.kv, self.fused, self.bucket = kv, fused, bucket
        dev = fused.device
        self.ix = StaticDecodeIndex.allocate(bucket, dev)
        self.meta = fused.static_meta(bucket)
        self.bad = torch.zeros(num_layers, bucket, dtype=torch.bool, device=dev)  # [Ly, Bp]
        # Where the decode attends a layer's new tokens before they are written (`defers_write`),
        # the write (the tail, the new tokens' codes, which nothing reads for W steps) runs after
        # it on `write_stream`, beside the rest of the step; `join` brings it back before the step
        # ends. The step is captured on `capture_stream` (`priority_streams`).
        self.capture_stream, self.write_stream = streams if fused.defers_write else (None, None)
        if fused.defers_write and streams is None:
            raise ZerodramError("a deferred KV write needs the (capture, write) streams")
        self._forked = False
        self._rows: tuple[list[int], ...] | None = None
        self._lengths: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    def plan(self, batch: ForwardBatch) -> None:
        """Host bookkeeping of the step (pages and lengths move now; once per step)."""
        seq_ids, positions = batch.decode_seq_ids, batch.decode_positions
        self._rows = self.kv.plan_decode_static(seq_ids, positions)
        self._lengths = (seq_ids, tuple(p + 1 for p in positions))

    def upload(self, scratch: bool = False) -> int:
        """The planned step (or, `scratch`, a step of padding rows only: what a capture's warm-up
        may run) into the static buffers; returns the FP2 length its grid is sized for (the key of
        its captured graph)."""
        slot, page = self.kv.scratch
        if scratch:
            self.ix.fill_scratch(slot, page)
            return self.fused.fill_static(self.meta, (), ())
        self.ix.fill(self._rows, slot, page)
        return self.fused.fill_static(self.meta, *self._lengths)

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_len: int
    ) -> torch.Tensor:
        """Layer `layer_idx`'s KV write and attention, q [Bp, Hq, Dh], k, v [Bp, Hkv, Dh] -> [Bp, Hq, Dh]:
        the write then the decode, or, where the decode path defers it (`defers_write`), the decode
        attending the pending write's tokens, then the write on `write_stream` (joined by `join`)."""
        if self.fused.defers_write:
            pending = self.kv.pending_append(layer_idx, k, v, self.ix, self.bad[layer_idx])
            o = self.fused.static_call(layer_idx, q, self.meta, max_len, pending)
            pending.write_after(self.write_stream)
            self._forked = True
            return o
        self.kv.write_decode_static(layer_idx, k, v, self.ix, self.bad[layer_idx])
        return self.fused.static_call(layer_idx, q, self.meta, max_len)

    def join(self) -> None:
        """The current stream waits for the writes launched since the last join, before the
        step ends: whatever comes after it (the next step's decode reading the tails, and W steps
        on the codes; a freed page's next owner writing it; the end of a graph capture) finds the
        writes made."""
        if self._forked:
            torch.cuda.current_stream().wait_stream(self.write_stream)
            self._forked = False

    def record_nonfinite(self, batch: ForwardBatch) -> None:
        """Hand the step's flags to the partition's ledger (read with the others at step end)."""
        B = batch.num_decode
        for i in range(self.bad.shape[0]):
            self.kv.nonfinite.record_rows(i, batch.decode_seq_ids, batch.decode_positions, self.bad[i, :B])


class StaticDecodeStep:
    """One bucket's decode step: static buffers, and either the Ly + 1 pieces between attention
    calls or (with `static_attn`) the whole step, one graph per length bucket.

    Args:
        model: the rank's transformer.
        eps: per layer, the capturable expert-parallel twin (None for dense layers).
        bucket: Bp, the padded batch size.
        static_attn: the bucket's `StaticAttention` (whole-step mode), or None (piecewise).
    """

    def __init__(
        self,
        model: Transformer,
        eps: list[ExpertParallel | None],
        bucket: int,
        static_attn: StaticAttention | None = None,
    ) -> None:
        self.model, self.eps, self.bucket = model, eps, bucket
        self.bufs = StaticBuffers.allocate(model, bucket)
        self._timer = _RoutedInto(self.bufs.routed)
        self.graphs: list[torch.cuda.CUDAGraph] | None = None
        self.static_attn = static_attn
        self.whole: dict[int, torch.cuda.CUDAGraph] = {}  # Lb -> the whole step's graph
        self.capturing = False
        self.pool = None  # the memory pool every whole-step graph shares (they replay one at a time)

    def _piece(self, i: int) -> None:
        """Piece i: the layer before attention i (i = 0: the embedding) and attention i's inputs."""
        m, b = self.model, self.bufs
        if i == 0:
            x = F.embedding(b.token_ids, m.embed)  # [Bp, D]
            cos, sin = m.rope.cos_sin(b.positions, x.dtype)  # once per step, for every piece
            b.cos.copy_(cos)
            b.sin.copy_(sin)
        else:
            prev = m.layers[i - 1]
            x = prev.feed_forward(b.x + prev.attn_output(b.o), self._timer, self.eps[i - 1])
        if i == len(m.layers):
            b.logits.copy_(m.head(x))
            return
        q, k, v = m.layers[i].pre_attention(x, (b.cos, b.sin))
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

    def _whole_step(self, max_len: int) -> None:
        """Every layer with its static attention, in order (captured whole, or eager). Unlike the
        pieces, nothing between layers goes through the static buffers: inside one graph a copy
        is only one more node to launch (in and out: token ids, positions, logits)."""
        m, b = self.model, self.bufs
        x = F.embedding(b.token_ids, m.embed)  # [Bp, D]
        cos_sin = m.rope.cos_sin(b.positions, x.dtype)  # once for every layer
        try:
            for i, layer in enumerate(m.layers):
                q, k, v = layer.pre_attention(x, cos_sin)
                o = self.static_attn(i, q, k, v, max_len)  # [Bp, Hq, Dh]
                x = layer.feed_forward(x + layer.attn_output(o), self._timer, self.eps[i])
            b.logits.copy_(m.head(x))
        finally:  # also on an error: a capture must close joined (or it reports that, not the cause)
            self.static_attn.join()

    def _capture_whole(self, max_len: int) -> None:
        """Warm up and capture the whole step for `max_len`, the static buffers pointing at
        scratch rows meanwhile (the warm-up runs: it must not write a real sequence's KV)."""
        self.static_attn.upload(scratch=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._whole_step(max_len)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool, stream=self.static_attn.capture_stream):
            self._whole_step(max_len)
        self.whole[max_len] = g

    def run(self, batch: ForwardBatch, attn: PagedAttention) -> torch.Tensor:
        """A decode-only batch (B <= Bp rows) -> fp32 logits [B, V], a view of the static buffer
        (valid until this bucket's next step)."""
        m, b, B = self.model, self.bufs, batch.num_decode
        b.token_ids[:B].copy_(batch.token_ids)
        b.positions[:B].copy_(batch.positions)
        if self.static_attn is not None:
            sa = self.static_attn
            sa.plan(batch)
            max_len = sa.upload()
            if self.capturing and max_len not in self.whole:
                log.info("capturing the decode step for batch bucket %d, FP2 length %d", self.bucket, max_len)
                try:
                    self._capture_whole(max_len)
                except Exception as err:  # a host sync or copy the capture refuses: serve eagerly
                    torch.cuda.synchronize()
                    self.capturing = False
                    log.warning(
                        "decode step of bucket %d not capturable (%s): it runs eagerly from its static "
                        "buffers", self.bucket, str(err).splitlines()[0] if str(err) else type(err).__name__,
                    )  # fmt: skip
                sa.upload()  # the step's own indices again (the warm-up pointed them at scratch)
            if self.capturing:
                self.whole[max_len].replay()
            else:
                self._whole_step(max_len)
            sa.record_nonfinite(batch)
        else:
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


def priority_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """(capture, write) streams of a deferred KV write: the step is captured on a stream of the
    highest priority and the writes launched on one of the lowest. A graph's kernel nodes keep
    their capture stream's priority, so the block scheduler hands SMs to the step's own kernels
    first and the writes' CTAs take what they leave; with equal priorities the writes, launched
    earlier, took SMs ahead of the next kernels (docs/benchmarks.md, "The write after the decode")."""
    least, greatest = torch.cuda.Stream.priority_range()
    return torch.cuda.Stream(device, priority=greatest), torch.cuda.Stream(device, priority=least)


class DecodeGraphs:
    """The decode step from static buffers, one `StaticDecodeStep` per bucket.

    Args:
        model: the rank's transformer (all experts local, or exchanged over NVSHMEM).
        max_batch: the most decode rows of a step (the scheduler's max_num_seqs).
        capture: capture (GPU): every bucket's pieces now, or whole steps at their first use;
            False runs them eagerly (CPU tests).
        static: (kv partition, fused decode) for the whole-step mode (see module docstring), or
            None for the piecewise mode.

    Raises:
        ConfigError: a layer's experts have no capturable form (a host-driven exchange).
    """

    def __init__(
        self, model: Transformer, *, max_batch: int, capture: bool, static: tuple | None = None
    ) -> None:
        eps = [capturable_ep(layer.ep) if layer.is_moe else None for layer in model.layers]
        missing = [
            layer.idx for layer, ep in zip(model.layers, eps, strict=True) if layer.is_moe and ep is None
        ]
        if missing:
            raise ConfigError(
                f"cuda_graphs: the experts of MoE layers {missing} ({type(model.layers[missing[0]].ep).__name__}) "
                "cannot be captured (a host-driven exchange: across ranks, graphs need the NVSHMEM backend)"
            )
        self.buckets = bucket_sizes(max_batch)
        Ly = len(model.layers)
        streams = priority_streams(static[1].device) if static is not None and static[1].defers_write else None
        self.steps = {
            bucket: StaticDecodeStep(
                model, eps, bucket, None if static is None else StaticAttention(*static, bucket, Ly, streams)
            )
            for bucket in self.buckets
        }
        if capture and static is not None:  # whole steps: captured at their first use
            pool = torch.cuda.graph_pool_handle()
            for step in self.steps.values():
                step.capturing, step.pool = True, pool
            log.info(
                "decode steps will be captured whole, per batch bucket %s and FP2 length", list(self.buckets)
            )
        elif capture:
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
        from zerodram.runtime.model.local_experts import DenseLocalExperts

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
