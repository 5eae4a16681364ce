"""The decode step from static buffers (runtime/engine/graphs.py), run eagerly on CPU: the same
pieces, buckets, padding and buffer plumbing that the GPU replays from CUDA graphs.

Shape legend: B decode rows, Bp bucket, V vocab.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from zerodram.runtime.engine import EngineConfig, SamplingParams, SchedulerConfig
from zerodram.runtime.engine.engine import Engine
from zerodram.runtime.engine.graphs import DecodeGraphs, bucket_sizes
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.loading.random_init import random_weights
from zerodram.runtime.model.ep import AllGatherEP, capturable_ep
from zerodram.runtime.model.local_experts import DenseLocalExperts, LocalExperts, RoutedLocalExperts
from zerodram.runtime.model.named import NAMED_CONFIGS
from zerodram.runtime.model.transformer import Transformer

PROMPTS = [[3, 17, 99, 5, 42, 7, 11, 64, 2, 90], [1, 2, 3], [9, 9, 9, 9, 120, 33], [4, 5]]
# different lengths, so the decode batch shrinks 4 -> 3 -> 2 -> 1 (buckets 4, 4 padded, 2, 1)
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 9, 6, 3)]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(4) == (1, 2, 4)
    assert bucket_sizes(6) == (1, 2, 4, 6)
    assert bucket_sizes(16) == (1, 2, 4, 8, 16)


def _engine(name: str, kv: str, static: bool) -> Engine:
    cfg = NAMED_CONFIGS[name]
    if kv.startswith("fp2"):  # the fused FP2 decode reads head dims 64 and 128
        cfg = dataclasses.replace(cfg, head_dim=64)
    model = Transformer(cfg, random_weights(cfg, None, 0, seed=5, dtype=torch.float32))
    page = 4 if kv == "fp32" else 32
    engine = Engine(
        model,
        EngineConfig(kv_format=kv, num_kv_pages=32, page_size=page, scheduler=SchedulerConfig(4, 16, 4)),
    )
    if static:
        # whole-step mode where the engine would choose it (FP2 fused decode, flush 1)
        whole = engine.attn.decode if getattr(engine.kv, "static_decode_ok", False) else None
        statics = None if whole is None or not hasattr(whole, "static_call") else (engine.kv, whole)
        engine.graphs = DecodeGraphs(model, max_batch=4, capture=False, static=statics)
    return engine


class _Recorder:
    """A PhaseTimer that keeps each step's logits rows count and each MoE layer's routed rows."""

    def __init__(self) -> None:
        self.routed_rows: list[tuple[int, int]] = []

    def phase(self, name: str):
        from contextlib import nullcontext

        return nullcontext()

    def begin_step(self) -> None:
        pass

    def routed(self, layer_idx: int, topk_idx: torch.Tensor) -> None:
        self.routed_rows.append((layer_idx, topk_idx.shape[0]))


@pytest.mark.parametrize(
    ("name", "kv"),
    [
        ("tiny-moe", "fp32"),
        ("tiny-qwen-moe", "bf16"),
        ("tiny-dense", "fp32"),
        # the whole-step mode: FP2 flushing one token at a time (sinks, a 7-token window, flushes)
        ("tiny-moe", "fp2:tail=1,window=7"),
        ("tiny-qwen-moe", "fp2:sinks=0,tail=1,window=0,scale=e8m0"),
    ],
)
def test_static_step_gives_the_eager_tokens(name: str, kv: str) -> None:
    runs = {}
    for static in (False, True):
        engine = _engine(name, kv, static)
        timer = _Recorder()
        engine.attach_observer(timer, None)
        seen: list[torch.Tensor] = []
        if static:
            run = engine.graphs.run

            def recording_run(batch, attn, run=run, seen=seen):
                seen.append(run(batch, attn))
                return seen[-1]

            engine.graphs.run = recording_run
        outs = engine.generate(PROMPTS, PARAMS)
        runs[static] = ([o.token_ids for o in outs], timer.routed_rows, seen)
    (tok_e, routed_e, _), (tok_s, routed_s, seen) = runs[False], runs[True]
    assert tok_s == tok_e
    whole = all(step.static_attn is not None for step in engine.graphs.steps.values())
    assert whole == kv.startswith("fp2"), "FP2 flush-1 formats take the whole-step mode"
    # the static path served the decode-only steps: 3 rows padded into bucket 4, then 2, then 1
    assert {1, 2, 3} <= {t.shape[0] for t in seen}
    # expert-load telemetry sees the same rows either way (the B real rows, not the padding)
    assert sorted(routed_s) == sorted(routed_e)


def test_dense_local_experts_equal_the_routed_ones() -> None:
    cfg = NAMED_CONFIGS["tiny-moe"]
    model = Transformer(cfg, random_weights(cfg, None, 0, seed=2, dtype=torch.float32))
    layer = model.layers[0]
    x = torch.randn(5, cfg.hidden_size)
    idx, w = layer.router(x)
    assert isinstance(layer.ep, LocalExperts)
    torch.testing.assert_close(DenseLocalExperts(layer.ep.experts)(x, idx, w), layer.ep(x, idx, w))


@pytest.mark.parametrize("T", [0, 1, 5, 16])
def test_routed_local_experts_equal_the_per_expert_loop(T: int) -> None:
    """The device-side packing (stable sort, counts, un-permute, weighted sum) with runtime/moe's
    reference path; a shard holding only some experts weighs the others' choices zero."""
    from zerodram.runtime.model.moe import ExpertWeights

    cfg = NAMED_CONFIGS["tiny-moe"]
    model = Transformer(cfg, random_weights(cfg, None, 0, seed=3, dtype=torch.float32))
    layer = model.layers[0]
    x = torch.randn(T, cfg.hidden_size)
    idx, w = layer.router(x)
    idx[::3, -1] = -1  # "no expert" (the comm layer's marker) contributes nothing
    full = layer.ep.experts
    torch.testing.assert_close(RoutedLocalExperts(full, "loop")(x, idx, w), full.forward(x, idx, w))
    keep = [1, 4, 6]  # a rank's shard: choices of the other experts contribute nothing
    part = ExpertWeights(tuple(keep), full.w_gate[keep], full.w_up[keep], full.w_down[keep])
    torch.testing.assert_close(RoutedLocalExperts(part, "loop")(x, idx, w), part.forward(x, idx, w))
    assert isinstance(capturable_ep(layer.ep), DenseLocalExperts)  # CPU: the kernel does not apply


@pytest.mark.parametrize("E", [1, 4])
@pytest.mark.parametrize("T", [1, 5, 16])
def test_every_token_routing_equals_the_general_path_on_dense_slices(E: int, T: int) -> None:
    """A dense FFN cut into E slices on one rank (the router sends every token to every slice with
    weight 1): the shortcut that skips the packing gives the general path's output, and the dense
    FFN's; the model and the engine's EP world turn it on for `dense_slices` only."""
    from zerodram.runtime.model.ep import ExpertParallelWorld
    from zerodram.runtime.model.transformer import swiglu

    cfg = NAMED_CONFIGS["tiny-dense"]
    dense = Transformer(cfg, random_weights(cfg, None, 0, seed=4, dtype=torch.float32))
    sliced_cfg = cfg.as_dense_moe(E)
    model = Transformer(sliced_cfg, random_weights(sliced_cfg, None, 0, seed=4, dtype=torch.float32))
    layer = model.layers[0]
    x = torch.randn(T, cfg.hidden_size)
    idx, w = layer.router(x)
    experts = layer.ep.experts
    shortcut = RoutedLocalExperts(experts, "loop", every_token=True)(x, idx, w)
    torch.testing.assert_close(shortcut, RoutedLocalExperts(experts, "loop")(x, idx, w), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(shortcut, swiglu(x, *dense.layers[0].ffn), rtol=1e-5, atol=1e-5)
    assert isinstance(layer.ep, LocalExperts) and layer.ep.every_token
    world = ExpertParallelWorld(None, expert_to_rank=None, top_k=E, hidden=cfg.hidden_size,
                                max_tokens_per_rank=16, num_moe_layers=1, every_token=True)  # fmt: skip
    assert world(0, experts).every_token
    moe = NAMED_CONFIGS["tiny-moe"]
    assert not Transformer(moe, random_weights(moe, None, 0, seed=1)).layers[0].ep.every_token


@pytest.mark.gpu
@pytest.mark.parametrize(("T", "path"), [(6, "kernel"), (128, "grouped")])
def test_gpu_routed_local_experts_capture_and_match(T: int, path: str) -> None:
    """On a GPU with bf16 weights the captured twin is the routed path: the decode expert kernel
    for a decode-sized bucket, `torch._grouped_mm` past it (128 tokens x top-2 over 8 experts: 32
    choices an expert, over the kernel's 16). Replayed with new routing it matches the eager
    per-expert loop (bf16 tolerances: docs/benchmarks.md, Experts)."""
    from zerodram.runtime.model.moe import ExpertWeights
    from zerodram.runtime.moe.experts import choose_experts_path

    gen = torch.Generator().manual_seed(4)
    El, D, F_, K = 8, 256, 512, 2
    w = [(torch.randn(*s, generator=gen) / s[-1] ** 0.5).to(torch.bfloat16).cuda() for s in ((El, F_, D), (El, F_, D), (El, D, F_))]
    experts = ExpertWeights(tuple(range(El)), *w)
    ep = LocalExperts(experts)
    twin = capturable_ep(ep)
    assert isinstance(twin, RoutedLocalExperts) and ep.routed is not None
    x = torch.randn(T, D, device="cuda").to(torch.bfloat16)
    assert choose_experts_path(x, twin.shard, sent_rows=T * K) == path
    idx = torch.zeros(T, K, dtype=torch.int64, device="cuda")
    wt = torch.zeros(T, K, device="cuda")
    twin(x, idx, wt)  # compile before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = twin(x, idx, wt)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        idx.copy_(torch.rand(T, El, generator=g).topk(K, dim=1).indices)
        wt.copy_(torch.rand(T, K, generator=g).softmax(-1))
        x.copy_(torch.randn(T, D, generator=g))
        graph.replay()
        want = experts.forward(x, idx, wt).float()
        torch.testing.assert_close(y.float(), want, atol=3e-2, rtol=3e-2)
        if path == "kernel":  # eager decode-sized steps take the same path
            torch.testing.assert_close(ep(x, idx, wt), y)


def test_experts_that_cannot_be_captured_are_refused() -> None:
    cfg = NAMED_CONFIGS["tiny-moe"]
    model = Transformer(cfg, random_weights(cfg, None, 0, seed=2, dtype=torch.float32))
    model.layers[1].ep = AllGatherEP(model.layers[1].ep.experts, 2, 0)
    with pytest.raises(ConfigError, match=r"MoE layers \[1\] \(AllGatherEP\)"):
        DecodeGraphs(model, max_batch=4, capture=False)


def test_static_step_on_smollm2_with_fp2_kv() -> None:
    """The dense-as-MoE router (K = E) and the fused FP2 decode path between static pieces."""
    from zerodram.runtime.engine.build import build_engine

    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10], [11, 12, 13]]
    got = []
    for static in (False, True):
        cfg = EngineConfig(
            kv_format="fp2:tail=1,window=7", num_kv_pages=16, scheduler=SchedulerConfig(4, 16, 4)
        )
        try:
            engine = build_engine("smollm2", None, cfg)
        except ConfigError as err:
            pytest.skip(str(err))
        if static:
            engine.graphs = DecodeGraphs(engine.model, max_batch=4, capture=False)
        got.append(
            [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))]
        )
    assert got[1] == got[0]


def test_auto_graphs_skip_models_whose_experts_a_graph_would_run_dense() -> None:
    """`cuda_graphs="auto"` leaves eager a MoE model whose captured experts would all run on every
    row (fp32 weights here); a dense model sliced into experts (every expert chosen) is fine."""
    moe = NAMED_CONFIGS["tiny-moe"]
    model = Transformer(moe, random_weights(moe, None, 0, seed=1, dtype=torch.float32))
    assert DecodeGraphs.dense_moe_layers(model) == [i for i in range(moe.num_layers) if moe.is_moe_layer(i)]
    sliced = NAMED_CONFIGS["tiny-dense"].as_dense_moe(2)
    assert DecodeGraphs.dense_moe_layers(Transformer(sliced, random_weights(sliced, None, 0, seed=1))) == []


def test_only_a_pinned_communicator_is_captured() -> None:
    """A graph bakes the communicator's phase: an unpinned one (alternating phases) is refused."""
    from types import SimpleNamespace

    from zerodram.runtime.model.ep import _TimedEP, _UntimedEP
    from zerodram.runtime.model.timing import NULL_TIMER

    def timed(pinned: bool) -> _TimedEP:
        comm = SimpleNamespace(capturable=True, phase_pinned=pinned)
        return _TimedEP(SimpleNamespace(comm=comm), NULL_TIMER)  # type: ignore[arg-type]

    assert capturable_ep(timed(False)) is None
    assert isinstance(capturable_ep(timed(True)), _UntimedEP)


def test_failed_auto_capture_falls_back_on_one_rank_and_raises_across_ranks(monkeypatch) -> None:
    """Under `cuda_graphs="auto"` a capture that fails leaves one rank eager; across ranks it raises,
    since peers capturing in step would wait for the rank that went eager alone."""
    from types import SimpleNamespace

    from zerodram.runtime.engine import engine as engine_mod

    class BrokenGraphs:
        dense_moe_layers = staticmethod(lambda model: [])

        def __init__(self, *args, **kwargs) -> None:
            raise RuntimeError("capture broke")

    monkeypatch.setattr(engine_mod, "DecodeGraphs", BrokenGraphs)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def fake(world_size: int) -> SimpleNamespace:
        return SimpleNamespace(
            model=SimpleNamespace(layers=[]),
            world_size=world_size,
            attn=SimpleNamespace(decode=None),
            kv=None,
            config=SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=4)),
        )

    assert Engine._capture(fake(1), auto=True) is None  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="capture broke"):
        Engine._capture(fake(2), auto=True)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="capture broke"):
        Engine._capture(fake(1), auto=False)  # type: ignore[arg-type]


def test_ep_world_check_raises_a_device_wait_expiry_and_one_phase_needs_experts_everywhere() -> None:
    """The engine's per-step check reads every NVSHMEM communicator's error word at once and raises
    the expired one's `RankTimeoutError`; the one-phase session is refused where a rank hosts no
    expert (its combine flags could overtake a peer's zeroing)."""
    from types import SimpleNamespace

    from zerodram.runtime.comm import ExpertPlacement
    from zerodram.runtime.errors import RankTimeoutError
    from zerodram.runtime.model.ep import ExpertParallelWorld, _TimedEP, every_rank_hosts_an_expert
    from zerodram.runtime.model.timing import NULL_TIMER

    def comm(expired: bool) -> SimpleNamespace:
        def check() -> None:
            if expired:
                raise RankTimeoutError("rank 0/2 waited 1s on the device for combine rows from rank 1")

        return SimpleNamespace(error=torch.tensor([int(expired), 2, 1, -1]), check=check)

    world = ExpertParallelWorld(None, expert_to_rank=None, top_k=2, hidden=8, max_tokens_per_rank=4, num_moe_layers=2)
    world.built += [_TimedEP(SimpleNamespace(comm=comm(False)), NULL_TIMER) for _ in range(2)]  # type: ignore[arg-type]
    world.check()
    world.built.append(_TimedEP(SimpleNamespace(comm=comm(True)), NULL_TIMER))  # type: ignore[arg-type]
    with pytest.raises(RankTimeoutError, match="from rank 1"):
        world.check()
    assert every_rank_hosts_an_expert(ExpertPlacement.contiguous(0, 2, 4))
    assert not every_rank_hosts_an_expert(ExpertPlacement(0, 2, (0, 0, 0, 0)))
