"""The engine on a CUDA device: greedy parity with transformers and the CPU engine (bf16 KV), the
fused FP2 decode kernels against the gather path, and CUDA graphs against eager decode.

Every test is marked `gpu` (skipped without CUDA) and prints the first divergence of any pair of
token lists it compares. Weights are fp32 (no TF32: torch's default for matmuls), so the GPU and
CPU engines compute the same function up to summation order.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_engine_support import MAX_TOKENS, PROMPTS

from zerodram.runtime.context import RankContext
from zerodram.runtime.engine import EngineConfig, SamplingParams, SchedulerConfig
from zerodram.runtime.engine.build import build_engine
from zerodram.runtime.engine.fp2_decode import Fp2FusedDecode

pytestmark = pytest.mark.gpu

CUDA = SimpleNamespace(device=torch.device("cuda"), rank=0, world_size=1, topology=None)
FP2_SPEC = "fp2:tail=1,window=7"  # the kernels' format; FP2 pages from the prompt on


def _greedy(
    model: str, ctx, prompts: list, max_tokens: int, kv: str, dtype: str = "fp32", **cfg
) -> tuple[list[list[int]], object]:
    """Greedy tokens of our engine (small prefill chunks, as test_engine_support.engine_greedy)."""
    config = EngineConfig(
        kv_format=kv, num_kv_pages=64, page_size=4 if kv == "fp32" else 32,
        scheduler=SchedulerConfig(4, 16, 4), **cfg,
    )  # fmt: skip
    engine = build_engine(model, ctx, config, dtype=dtype)
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [o.token_ids for o in outs], engine


def _compare(what: str, got: list[list[int]], want: list[list[int]]) -> float:
    """Print agreement and the first divergence per prompt; returns the agreeing fraction."""
    same = total = 0
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        first = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        same, total = same + sum(x == y for x, y in zip(a, b, strict=True)), total + len(b)
        print(f"{what}, prompt {i}: first divergence at {first}")
    return same / max(total, 1)


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("transformers")
    from test_engine_parity import tiny_references

    ckpts, hf = tiny_references(tmp_path_factory.mktemp("tiny-gpu"))
    return str(ckpts["mixtral"]), hf["mixtral"]


def test_gpu_engine_bf16_kv_matches_transformers_and_cpu_on_tiny_mixtral(tiny_mixtral) -> None:
    path, hf = tiny_mixtral
    gpu, _ = _greedy(path, CUDA, PROMPTS, MAX_TOKENS, "bf16")
    cpu, _ = _greedy(path, None, PROMPTS, MAX_TOKENS, "bf16")
    assert _compare("cuda vs transformers", gpu, hf) == 1.0
    assert _compare("cuda vs cpu engine", gpu, cpu) == 1.0


def test_gpu_engine_bf16_kv_matches_transformers_on_smollm2() -> None:
    pytest.importorskip("transformers")
    from test_engine_parity import smollm2_references

    prompts, hf = smollm2_references(6)
    gpu, _ = _greedy("smollm2", CUDA, prompts, 6, "bf16")
    assert _compare("smollm2 cuda vs transformers", gpu, hf) == 1.0


def test_gpu_fused_fp2_decode_against_gather_on_smollm2() -> None:
    """The CUDA kernels (fp16 q, fp32 accumulation) vs gather + fp32 SDPA over the same pages: not
    bit-equal, so greedy tokens may part after a near-tie; most must agree."""
    pytest.importorskip("transformers")
    from test_engine_parity import smollm2_references

    prompts, _ = smollm2_references(6)
    fused, engine = _greedy("smollm2", CUDA, prompts, 24, FP2_SPEC)
    assert isinstance(engine.attn.decode, Fp2FusedDecode)
    gather, _ = _greedy("smollm2", CUDA, prompts, 24, FP2_SPEC, fused_decode=False)
    assert _compare("smollm2 fp2 fused vs gather (cuda)", fused, gather) >= 0.8


@pytest.mark.parametrize("odd_keys", [False, True])
def test_gpu_fused_fp2_decode_per_layer_on_random_caches(odd_keys: bool) -> None:
    """One random partition on the GPU: kernels vs gather + SDPA, every layer, rel. error < 3e-3.
    odd_keys: layer 1's key codebook off the int8 kernel's grid (as a calibration could make it),
    which takes every layer to the fp16-key kernel."""
    import dataclasses

    from zerodram.runtime.engine.fp2_decode import make_decode_attention
    from zerodram.runtime.engine.kv_adapter import RuntimeKVPartition
    from zerodram.runtime.model.attention import PagedAttention

    dev, Hq, Hkv, D = torch.device("cuda"), 12, 4, 128
    g = torch.Generator(device=dev).manual_seed(3)
    kv = RuntimeKVPartition(FP2_SPEC, 2, Hkv, D, 64, 32, torch.float32, dev)
    if odd_keys:  # e5m2-exact, but 1/128 is not on the int8 table's 1/64 grid
        kp, vp = kv.caches[1].params
        odd = torch.tensor([-1.5, -1 / 128, 1 / 128, 1.5], dtype=kp.levels.dtype, device=kp.levels.device)
        kv.caches[1].params = (dataclasses.replace(kp, levels=odd), vp)
    lengths = [1, 9, 40, 300, 700]
    for sid, n in enumerate(lengths):
        kv.reserve(sid, n)
        for layer in range(2):
            kv.write(layer, sid, 0, torch.randn(n, Hkv, D, device=dev, generator=g) * 2,
                     torch.randn(n, Hkv, D, device=dev, generator=g))  # fmt: skip
    fused = make_decode_attention(kv, num_q_heads=Hq, scale=D**-0.5, max_batch=8)
    assert isinstance(fused, Fp2FusedDecode) and fused.attn.key_s8 == (not odd_keys)
    gather = PagedAttention(kv, D**-0.5)
    ids = tuple(range(len(lengths)))
    for layer in range(2):
        q = torch.randn(len(lengths), Hq, D, device=dev, generator=g)
        got, want = fused(layer, q, ids, tuple(lengths)), gather.decode(layer, q, ids, tuple(lengths))
        rel = float((got - want).norm() / want.norm())
        assert rel < 3e-3, f"layer {layer}: rel. error {rel:.2e}"


@pytest.mark.parametrize(
    ("model", "kv"),
    [
        ("tiny", "bf16"),
        ("smollm2", "bf16"),
        ("smollm2", FP2_SPEC),
        ("random:smollm2-135m", FP2_SPEC),  # the whole-step graphs where the package is missing
    ],
)
def test_gpu_cuda_graphs_give_the_eager_tokens(model: str, kv: str, tiny_mixtral) -> None:
    """cuda_graphs=True vs eager decode: piecewise graphs (bf16 KV) or, for FP2 flushing one
    token at a time, the whole step in one graph per (bucket, FP2 length): KV writes and fused
    attention captured, padded buckets, dense local experts."""
    if model == "smollm2":
        from zerodram.runtime.loading.checkpoint import ModelSpec, checkpoint_dir

        try:
            checkpoint_dir(ModelSpec.parse("smollm2"))  # converted once; needs the package and gguf
        except Exception as err:  # the package that carries the GGUF, or the gguf reader, is missing
            pytest.skip(f"packaged model unavailable: {err}")
    path = tiny_mixtral[0] if model == "tiny" else model
    prompts = PROMPTS if model == "tiny" else [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10], [11, 12, 13]]
    eager, _ = _greedy(path, CUDA, prompts, 16, kv)
    graphs, engine = _greedy(path, CUDA, prompts, 16, kv, cuda_graphs=True)
    steps = engine.graphs.steps.values()
    if not kv.startswith("fp2"):
        assert all(s.graphs is not None for s in steps)
        assert _compare(f"{model} {kv} graphs vs eager", graphs, eager) == 1.0
        return
    # the whole step: captured replays against the same static step run eagerly (the same ops and
    # splits: to the bit), and against the eager engine (its attention splits by B and the exact
    # length: to rounding, so greedy tokens may part at a near-tie)
    assert all(s.static_attn is not None for s in steps) and any(s.whole for s in steps)
    config = EngineConfig(
        kv_format=kv, num_kv_pages=64, page_size=32, scheduler=SchedulerConfig(4, 16, 4), cuda_graphs=True
    )
    static = build_engine(path, CUDA, config, dtype="fp32")
    for s in static.graphs.steps.values():
        s.capturing = False
    outs = static.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert _compare(f"{model} {kv} graphs vs static eager", graphs, [o.token_ids for o in outs]) == 1.0
    assert _compare(f"{model} {kv} graphs vs eager", graphs, eager) >= 0.9


def test_gpu_bf16_weights_route_experts_through_the_kernel_in_graphs_and_eager() -> None:
    """bf16 weights (random tiny-moe: dims the kernel takes): decode-sized expert calls, eager and
    captured, take the routed decode expert kernel (`RoutedLocalExperts`); graphs and eager must give
    the same tokens, and most tokens must match the fp32-weight engine (bf16 weights: a near-tie on
    a random model may part)."""
    from zerodram.runtime.model.local_experts import RoutedLocalExperts

    model = "random:tiny-moe"
    eager, e_engine = _greedy(model, CUDA, PROMPTS, 16, "bf16", dtype="bf16")
    graphs, g_engine = _greedy(model, CUDA, PROMPTS, 16, "bf16", dtype="bf16", cuda_graphs=True)
    moe = [layer for layer in e_engine.model.layers if layer.is_moe]
    assert moe and all(layer.ep.routed is not None for layer in moe)
    twins = [ep for step in g_engine.graphs.steps.values() for ep in step.eps if ep is not None]
    assert twins and all(isinstance(ep, RoutedLocalExperts) for ep in twins)
    assert _compare("tiny-moe bf16 weights: graphs vs eager", graphs, eager) == 1.0
    fp32, _ = _greedy(model, CUDA, PROMPTS, 16, "bf16")
    assert _compare("tiny-moe bf16 vs fp32 weights", eager, fp32) >= 0.5


def _tap_logits(engine) -> dict[int, list]:
    """Each request's logits [V] (fp32 numpy: they cross process boundaries by value) in output
    order, recorded as `engine` steps."""
    rows: dict[int, list] = {}

    def tap(ids: list[int], logits: torch.Tensor) -> None:
        for rid, row in zip(ids, logits.float().cpu(), strict=True):
            rows.setdefault(rid, []).append(row.numpy())

    engine.on_logits = tap
    return rows


def _agree_to_a_near_tie(what: str, got: tuple, want: tuple, rtol: float) -> None:
    """got, want: (tokens per prompt, logits per request id). Up to each prompt's first differing
    token the logits must agree within rtol of the largest |logit| (the inputs were the same), and
    where the tokens part, the two tokens' logits under `want` must lie within that bound too (a
    near-tie, not a wrong model). Prints the largest relative error seen."""
    worst = 0.0
    for i, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        for j, (x, y) in enumerate(zip(a, b, strict=True)):
            la, lb = torch.from_numpy(got[1][i][j]), torch.from_numpy(want[1][i][j])
            bound = rtol * float(lb.abs().max())
            err = float((la - lb).abs().max())
            worst = max(worst, err / float(lb.abs().max()))
            assert err <= bound, f"{what}, prompt {i}, token {j}: logits differ by {err:.4g} > {bound:.4g}"
            if x != y:
                margin = float(lb[y] - lb[x])
                print(f"{what}, prompt {i}: tokens part at {j} (margin {margin:.4g}, bound {bound:.4g})")
                assert margin <= 2 * bound, f"{what}, prompt {i}, token {j}: not a near-tie ({margin:.4g})"
                break
    print(f"{what}: largest logit error {worst:.4f} of max |logit| (allowed {rtol})")


def _pe_on_the_one_gpu(ctx: RankContext) -> RankContext:
    """The rank context of an NVSHMEM PE on cuda:0, from `run_ranks`' gloo rank: the same process
    group (its bounded exchanges included), another device (several PEs share the one GPU: correct,
    not fast). The caller's `ctx` stays the owner: this one is never closed."""
    torch.cuda.set_device(0)
    return RankContext(ctx.env, torch.device("cuda", 0), ctx.backend, topology=None, timeout_s=120.0)


def _rank_nvshmem_engine(
    ctx, model: str, prompts: list, max_tokens: int, kvs: tuple[str, ...], cuda_graphs: bool = False
) -> dict:
    """One rank of the engine over NVSHMEM: ranks from `run_ranks` (gloo), all on cuda:0 (several
    PEs share the one GPU: correct, not fast), bf16 weights (NVSHMEM moves bf16 rows), a dense model's
    FFN sliced into one expert per rank (a MoE checkpoint keeps its own). Each engine is closed
    (collective) before the next; the test gives each process one engine (NVSHMEM's init after a
    finalize is not promised here).
    Returns per KV format (rank 0's tokens, the logits of this rank's requests)."""
    gctx = _pe_on_the_one_gpu(ctx)
    got = {}
    for kv in kvs:
        config = EngineConfig(
            kv_format=kv, num_kv_pages=64, page_size=32, scheduler=SchedulerConfig(4, 16, 4),
            cuda_graphs=cuda_graphs,
        )  # fmt: skip
        # a dense model is sliced into one expert per rank by default; a MoE checkpoint keeps its own
        engine = build_engine(model, gctx, config, dtype="bf16", ep_backend="nvshmem")
        with engine:
            world = engine.model._make_ep
            assert world.backend == "nvshmem" and world.session is not None
            assert (engine.graphs is not None) == cuda_graphs
            moe = [layer for layer in engine.model.layers if layer.is_moe]
            assert moe and all(layer.ep.layer.comm.session is world.session for layer in moe)
            # one phase of buffers, shared by every layer's communicator (NvshmemComm, one_phase)
            assert world.session.one_phase and len({layer.ep.layer.comm.buffer.data_ptr() for layer in moe}) == 1
            logits = _tap_logits(engine)
            outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            got[kv] = ([o.token_ids for o in outs], logits)
        assert world.session is None and not world.built
    return got


@pytest.mark.slow
def test_gpu_engine_over_two_nvshmem_ranks_matches_one_rank() -> None:
    """The engine over 2 ranks with the NVSHMEM backend (one session per rank shared by every MoE
    layer; SmolLM2's shapes, random bf16 weights, each FFN sliced into 2 experts) against the
    one-rank GPU engine (the FFN whole): bf16 KV, and FP2 through the fused decode on each rank.
    Slicing changes only the bf16 summation order, and random weights give flat logits, so tokens
    may part at a near-tie: the logits are compared, to the first parting (`_agree_to_a_near_tie`)."""
    from multirank import run_ranks

    model = "random:smollm2-135m"
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10], [11, 12, 13]]
    for kv, rtol in (("bf16", 0.05), (FP2_SPEC, 0.1)):
        results = run_ranks(
            _rank_nvshmem_engine, 2, args=(model, prompts, 8, (kv,)), timeout_s=600, rank_timeout_s=180,
            device="cpu",
        )  # fmt: skip
        two_ranks = (results[0][kv][0], {**results[0][kv][1], **results[1][kv][1]})
        config = EngineConfig(
            kv_format=kv, num_kv_pages=64, page_size=32, scheduler=SchedulerConfig(4, 16, 4)
        )
        engine = build_engine(model, CUDA, config, dtype="bf16")
        logits = _tap_logits(engine)
        outs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        _agree_to_a_near_tie(
            f"2 NVSHMEM ranks vs one rank, {kv}", two_ranks, ([o.token_ids for o in outs], logits), rtol
        )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_gpu_engine_over_two_nvshmem_ranks_on_tiny_moe_checkpoints(kind: str, tmp_path_factory) -> None:
    """A MoE checkpoint (tiny, random, written in the test) over 2 NVSHMEM ranks, each loading only
    its own experts' tensors: bf16 KV against the one-rank GPU engine on the same bf16 weights, to a
    near-tie (the ranks change only the combine's summation order). The agreement with
    transformers' greedy tokens (fp32 weights) is printed, not held: bf16 weights part from fp32
    at this model's near-ties."""
    pytest.importorskip("transformers")
    from multirank import run_ranks
    from test_engine_parity import tiny_references

    ckpts, hf = tiny_references(tmp_path_factory.mktemp("tiny-nvshmem"))
    path = str(ckpts[kind])
    results = run_ranks(
        _rank_nvshmem_engine, 2, args=(path, PROMPTS, MAX_TOKENS, ("bf16",)), timeout_s=600, rank_timeout_s=180,
        device="cpu",
    )  # fmt: skip
    two_ranks = (results[0]["bf16"][0], {**results[0]["bf16"][1], **results[1]["bf16"][1]})
    config = EngineConfig(kv_format="bf16", num_kv_pages=64, page_size=32, scheduler=SchedulerConfig(4, 16, 4))
    engine = build_engine(path, CUDA, config, dtype="bf16")
    logits = _tap_logits(engine)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    one_rank = ([o.token_ids for o in outs], logits)
    _agree_to_a_near_tie(f"tiny {kind}: 2 NVSHMEM ranks vs one rank, bf16", two_ranks, one_rank, 0.05)
    _compare(f"tiny {kind}: 2 NVSHMEM ranks (bf16 weights) vs transformers (fp32)", two_ranks[0], hf[kind])


@pytest.mark.slow
def test_gpu_engine_over_two_nvshmem_ranks_replays_graphs() -> None:
    """CUDA graphs across 2 NVSHMEM ranks: piecewise graphs captured on both ranks at construction
    (the warm-ups run the exchange in step), replayed while the other rank replays or runs eager
    (prefill, uneven batches: prompt 0 is long); the communicators' phases pinned. Against the same
    2 ranks eager: the same values (graphs and eager run the same ops), to a near-tie."""
    from multirank import run_ranks

    model = "random:smollm2-135m"
    prompts = [list(range(1, 41)), [9, 10], [11, 12, 13]]
    for kv in ("bf16", FP2_SPEC):
        runs = []
        for graphs in (False, True):
            args = (model, prompts, 8, (kv,), graphs)
            runs.append(
                run_ranks(_rank_nvshmem_engine, 2, args=args, timeout_s=600, rank_timeout_s=240, device="cpu")
            )
        eager, graphs = ((r[0][kv][0], {**r[0][kv][1], **r[1][kv][1]}) for r in runs)
        _agree_to_a_near_tie(f"2 NVSHMEM ranks, graphs vs eager, {kv}", graphs, eager, 0.01)


def _rank_nvshmem_wire(ctx, wire: str, prompts: list) -> tuple:
    """One NVSHMEM rank of tiny-moe-wide (its own 4 of 8 experts, bf16 weights and KV) sending
    `wire` rows, decoding in CUDA graphs: (rank 0's tokens, this rank's requests' logits)."""
    gctx = _pe_on_the_one_gpu(ctx)
    config = EngineConfig(kv_format="bf16", num_kv_pages=64, page_size=32, scheduler=SchedulerConfig(4, 16, 4),
                          cuda_graphs=True)  # fmt: skip
    engine = build_engine("random:tiny-moe-wide", gctx, config, dtype="bf16", ep_backend="nvshmem", ep_wire=wire)
    with engine:
        assert engine.graphs is not None
        assert [ep.layer.comm.layout.wire for ep in engine.model._make_ep.built] == [wire, wire]
        logits = _tap_logits(engine)
        outs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    return [o.token_ids for o in outs], logits


@pytest.mark.slow
def test_gpu_engine_sends_fp8_rows_over_nvshmem() -> None:
    """`--ep-wire fp8` over 2 NVSHMEM ranks, decode in CUDA graphs (the dispatch kernel's fp8 rows
    captured): against the bf16 wire, to a near-tie within 0.1 of the largest |logit| (e4m3 rounds
    each value sent by up to 1/16; on the CPU ranks the first logits moved by 0.014-0.027)."""
    from multirank import run_ranks

    prompts = [list(range(1, 21)), [9, 10], [11, 12, 13]]
    runs = {
        wire: run_ranks(_rank_nvshmem_wire, 2, args=(wire, prompts), timeout_s=600, rank_timeout_s=240, device="cpu")
        for wire in ("bf16", "fp8")
    }
    bf16, fp8 = ((r[0][0], {**r[0][1], **r[1][1]}) for r in (runs["bf16"], runs["fp8"]))
    assert fp8[1].keys() == bf16[1].keys() and any(
        not (a == b).all() for rid in bf16[1] for a, b in zip(fp8[1][rid], bf16[1][rid], strict=False)
    ), "the fp8 wire's logits equal the bf16 wire's: were the rows sent as fp8?"
    _agree_to_a_near_tie("2 NVSHMEM ranks, fp8 wire vs bf16 wire", fp8, bf16, 0.1)


@pytest.mark.parametrize("kv", [FP2_SPEC, "default"])
def test_gpu_defer_write_gives_the_two_kernel_tokens(kv: str) -> None:
    """EngineConfig.defer_write: the whole-step graphs with each layer's KV write made after its
    decode (the decode reading the new tokens from the step's tensors; the write on the
    low-priority write stream, joined at the step's end) give the tokens of the same graphs with
    the write as a kernel of its own before the decode, on SmolLM2's shape with random weights
    (FP2_SPEC, and the default format calibrated with error feedback), with "auto" (the default)
    and True; prompts in their sinks, filling the window and flushing. The decode kernel computes
    the same outputs either way (test_kv_decode_write.py: bit for bit); compared to a near-tie as
    graphs against eager decode above."""
    from zerodram.runtime.kv.format import DEFAULT_FP2

    kv = DEFAULT_FP2 if kv == "default" else kv
    model = "random:smollm2-135m"
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (90, 60, 3)]
    two, apart = _greedy(model, CUDA, prompts, 24, kv, cuda_graphs=True, defer_write=False)
    assert not apart.attn.decode.defers_write
    for mode in ("auto", True):
        one, engine = _greedy(model, CUDA, prompts, 24, kv, cuda_graphs=True, defer_write=mode)
        assert engine.attn.decode.defers_write and any(s.whole for s in engine.graphs.steps.values())
        assert _compare(f"{kv} deferred write ({mode}) vs two kernels", one, two) >= 0.9


def test_gpu_defer_write_needs_a_window() -> None:
    """A format without a window attends a new token as FP2 in the step it arrives, so its write
    cannot wait: "auto" keeps the write as a launch of its own before the decode, True refuses."""
    from zerodram.runtime.errors import ConfigError

    config = lambda mode: EngineConfig(  # noqa: E731
        kv_format="fp2:tail=1,window=0", num_kv_pages=16, page_size=32, cuda_graphs=True, defer_write=mode
    )
    engine = build_engine("random:smollm2-135m", CUDA, config("auto"), dtype="fp32")
    assert not engine.attn.decode.defers_write
    with pytest.raises(ConfigError, match="window"):
        build_engine("random:smollm2-135m", CUDA, config(True), dtype="fp32")


def test_gpu_engine_with_the_default_format_calibrates_and_serves() -> None:
    """What `zerodram generate` now does on a GPU: the default FP2 format calibrated at start (the
    error-feedback factors from a prefill), the fused decode, CUDA graphs as `--cuda-graphs auto`
    decides; prompts long enough to flush past the 47-token window. Random weights give flat
    logits, so the agreement with bf16 KV is printed, not held to a bound."""
    from zerodram.runtime.kv.format import DEFAULT_FP2

    model = "random:smollm2-135m"
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (90, 60)]
    fp2, engine = _greedy(model, CUDA, prompts, 24, DEFAULT_FP2, cuda_graphs="auto")
    assert engine.kv_calibration is not None
    assert isinstance(engine.attn.decode, Fp2FusedDecode)
    assert [len(t) for t in fp2] == [24, 24]
    bf16, _ = _greedy(model, CUDA, prompts, 24, "bf16")
    print(f"default FP2 vs bf16 KV: {_compare('default FP2 vs bf16 KV', fp2, bf16):.2f} of the tokens agree")
