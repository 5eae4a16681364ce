"""The EP MoE layer over 2 and 4 gloo ranks equals the single-process reference (host-driven path).

Every rank rebuilds every rank's tokens and the global weights from one seed, runs the layer on its
own tokens and compares with the reference on those tokens. All cases of one world size run in one
spawn (process start-up dominates on two cores).
"""

from __future__ import annotations

import pytest
import torch
from multirank import run_ranks

from zerodram.runtime.comm import EpLayout, ExpertPlacement, create_communicator
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.moe import EpMoELayer, MoEWeights, RouterConfig, reference_experts, reference_moe

pytestmark = pytest.mark.slow

D, F = 128, 64

# name, E, K, tokens per rank (by rank), routing ("router", "one_expert", "skewed", "masked"),
# scoring, wire, dtype, replicas
CASES = [
    ("topk2_uneven", 8, 2, (5, 9, 0, 3), "router", "softmax", "bf16", torch.float32, False),
    ("topk1", 8, 1, (7, 7, 7, 7), "router", "softmax", "bf16", torch.float32, False),
    ("topk8_sigmoid", 16, 8, (4, 1, 6, 2), "router", "sigmoid", "bf16", torch.float32, False),
    ("all_to_one_expert", 8, 1, (6, 3, 5, 1), "one_expert", "softmax", "bf16", torch.float32, False),
    ("skewed_idle_experts", 16, 2, (8, 8, 2, 0), "skewed", "softmax", "bf16", torch.float32, False),
    ("masked_choices", 8, 2, (4, 4, 4, 4), "masked", "softmax", "bf16", torch.float32, False),
    ("all_ranks_empty", 8, 2, (0, 0, 0, 0), "router", "softmax", "bf16", torch.float32, False),
    ("bf16_data", 8, 2, (6, 2, 9, 4), "router", "softmax", "bf16", torch.bfloat16, False),
    ("fp8_wire", 8, 2, (6, 2, 9, 4), "router", "softmax", "fp8", torch.float32, False),
    ("replicas", 8, 2, (9, 5, 7, 3), "router", "softmax", "bf16", torch.float32, True),
]
MAX_TOKENS = 12


def _inputs(seed: int, W: int, counts: tuple[int, ...], E: int, K: int, kind: str, dtype: torch.dtype):
    """Every rank's x [T_r, D] and, for forced routings, topk [T_r, K]: identical on all ranks."""
    g = torch.Generator().manual_seed(seed)
    xs, topks = [], []
    for r in range(W):
        T = counts[r % len(counts)]
        xs.append(torch.randn(T, D, generator=g).to(dtype))
        if kind == "one_expert":
            idx = torch.full((T, K), 3, dtype=torch.int64)
        elif kind == "skewed":  # experts 0 and 1 take nearly everything; most get nothing
            idx = torch.stack([torch.zeros(T, dtype=torch.int64), torch.ones(T, dtype=torch.int64)], 1)[:, :K]
            idx[: T // 3, 1 % K] = 5
        elif kind == "masked":
            idx = (
                torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
                if T
                else torch.zeros(0, K)
            )
            idx = idx.to(torch.int64)
            idx[::2, 1] = -1
        else:
            idx = None
        w = torch.rand(T, K, generator=g) if idx is not None else None
        topks.append((idx, w))
    return xs, topks


def _placement(rank: int, W: int, E: int, replicas: bool) -> ExpertPlacement:
    base = ExpertPlacement.contiguous(rank, W, E)
    if not replicas:
        return base
    reps = tuple(((e // (E // W) + 1) % W,) if e % 2 == 0 else () for e in range(E))  # even experts twice
    ring = tuple((rank - s) % W for s in range(W))  # a different visit order than rank order
    return ExpertPlacement(rank, W, base.expert_to_rank, reps, ring)


def _run_cases(ctx) -> list[str]:
    W, rank = ctx.world_size, ctx.rank
    done = []
    for i, (name, E, K, counts, kind, scoring, wire, dtype, replicas) in enumerate(CASES):
        weights = MoEWeights.random(E, D, F, seed=100 + i, dtype=dtype, shared_ffn=32 if i % 3 == 0 else 0)
        router = RouterConfig(E, K, scoring=scoring, renormalize=scoring == "softmax")
        placement = _placement(rank, W, E, replicas)
        layout = EpLayout(placement, D, K, MAX_TOKENS, wire, dtype)
        comm = create_communicator(ctx, layout, router, backend="torch")
        layer = EpMoELayer(
            comm, weights.shard(layout.local_experts), gate_weight=weights.gate_weight, shared=weights.shared
        )
        xs, topks = _inputs(7 + i, W, counts, E, K, kind, dtype)
        x = xs[rank]
        tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
        if wire == "fp8":
            tol = {"atol": 6e-2, "rtol": 6e-2}
        idx, w = topks[rank]
        if idx is None:
            y = layer.forward(x)
            ref, _, _ = reference_moe(x, weights, router)
        else:
            y = layer(x, idx, w)
            ref = reference_experts(x, idx, w, weights)
        torch.testing.assert_close(y, ref, **tol, msg=lambda m, name=name: f"case {name} rank {rank}: {m}")
        # the load counters saw exactly what the reference routing sends to this rank's experts
        if not replicas:
            all_idx = torch.cat(
                [
                    topks[r][0] if topks[r][0] is not None else reference_moe(xs[r], weights, router)[1]
                    for r in range(W)
                ]
            )
            want = (
                torch.stack([(all_idx == e).sum() for e in layout.local_experts])
                if layout.local_experts
                else None
            )
            if want is not None:
                assert torch.equal(layer.expert_load, want), (name, layer.expert_load, want)
        layer.close()
        done.append(name)
    return done


@pytest.mark.parametrize("world_size", [2, 4])
def test_ep_layer_matches_reference(world_size: int) -> None:
    results = run_ranks(_run_cases, world_size, timeout_s=150, rank_timeout_s=30)
    assert all(r == [c[0] for c in CASES] for r in results)


def _world_lifetime(ctx) -> list:
    from zerodram.runtime.model.ep import ExpertParallelWorld
    from zerodram.runtime.model.moe import ExpertWeights

    world = ExpertParallelWorld(
        ctx, expert_to_rank=(0, 0, 1, 1), top_k=2, hidden=8, max_tokens_per_rank=4, num_moe_layers=2
    )
    e = 2 * ctx.rank
    experts = ExpertWeights((e, e + 1), torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.zeros(2, 8, 4))
    eps = [world(i, experts) for i in range(2)]
    comms = [ep.layer.comm for ep in eps]
    world.close()
    world.close()  # idempotent
    return [world.backend, [c._closed for c in comms], world.built]


def test_expert_parallel_world_builds_and_closes_every_layer() -> None:
    """A model's layers come from one ExpertParallelWorld (backend resolved once) that closes them
    all; the NVSHMEM backend on a CPU rank is refused by name."""
    from zerodram.runtime.comm import resolve_backend

    assert run_ranks(_world_lifetime, 2) == [["torch", [True, True], []]] * 2
    cpu = type("Ctx", (), {"rank": 0, "device": torch.device("cpu")})()
    with pytest.raises(ConfigError, match="nvshmem needs a GPU; rank 0 runs on cpu"):
        resolve_backend(cpu, "nvshmem")
    with pytest.raises(ConfigError, match="EP backend 'mpi'"):
        resolve_backend(cpu, "mpi")
    # NVSHMEM moves bf16 rows: "auto" leaves an fp32 model on the torch backend, "nvshmem" says why
    gpu = type("Ctx", (), {"rank": 0, "device": torch.device("cuda", 0)})()
    assert resolve_backend(gpu, "auto", torch.float32) == "torch"
    with pytest.raises(ConfigError, match=r"moves bf16 rows, this model computes in torch\.float32"):
        resolve_backend(gpu, "nvshmem", torch.float32)


def _rank_without_experts(ctx) -> float:
    """One expert over two ranks: rank 1 holds none (W > E), yet takes part in every dispatch."""
    from zerodram.runtime.model.ep import ExpertParallelWorld
    from zerodram.runtime.model.moe import ExpertWeights

    g = torch.Generator().manual_seed(3)
    D, F = 8, 4
    full = ExpertWeights((0,), torch.randn(1, F, D, generator=g), torch.randn(1, F, D, generator=g),
                         torch.randn(1, D, F, generator=g))  # fmt: skip
    mine = full if ctx.rank == 0 else ExpertWeights((), full.w_gate[:0], full.w_up[:0], full.w_down[:0])
    world = ExpertParallelWorld(
        ctx, expert_to_rank=(0,), top_k=1, hidden=D, max_tokens_per_rank=4, num_moe_layers=1
    )
    ep = world(0, mine)
    x = torch.randn(3 + ctx.rank, D, generator=torch.Generator().manual_seed(10 + ctx.rank))
    idx, w = torch.zeros(x.shape[0], 1, dtype=torch.int64), torch.ones(x.shape[0], 1)
    err = float((ep(x, idx, w) - full.forward(x, idx, w)).abs().max())
    world.close()
    return err


def test_a_rank_without_experts_takes_part() -> None:
    assert all(e < 1e-5 for e in run_ranks(_rank_without_experts, 2))


WIRE_PROMPTS = [[3, 17, 99, 5, 42, 7, 11], [1, 2, 3], [9, 9, 120, 33], [4, 5, 6, 7, 8]]


def _engine_over_wires(ctx) -> dict:
    """The engine's `ep_wire` as `build_engine` takes it from `--ep-wire`: every MoE layer's layout
    carries it, and each request's first logits (after its prompt: the same inputs on both wires)
    come back per wire (tiny-moe-wide: hidden 128, fp8's scale group)."""
    from zerodram.runtime.engine import EngineConfig, SamplingParams, SchedulerConfig
    from zerodram.runtime.engine.build import build_engine

    torch.set_num_threads(1)
    config = EngineConfig(kv_format="fp32", num_kv_pages=64, page_size=4, scheduler=SchedulerConfig(4, 16, 4))
    got = {}
    for wire in ("bf16", "fp8"):
        engine = build_engine("random:tiny-moe-wide", ctx, config, seed=11, ep_wire=wire)
        layouts = [(ep.layer.comm.layout.wire, ep.layer.comm.layout.msg_bytes) for ep in engine.model._make_ep.built]
        first: dict[int, torch.Tensor] = {}

        def tap(ids: list[int], logits: torch.Tensor, first: dict = first) -> None:
            for rid, row in zip(ids, logits, strict=True):
                first.setdefault(rid, row.clone())

        engine.on_logits = tap
        with engine:
            outs = engine.generate(WIRE_PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
        got[wire] = (layouts, [len(o.token_ids) for o in outs], first)
    return got


def test_the_engine_sends_the_wire_it_is_given() -> None:
    """`--ep-wire fp8` reaches every layer (144 bytes a row of 128 channels against the unquantized
    wire's 512: the model computes in fp32, and that wire carries its rows as they are) and
    serves; each request's first logits, computed on its own rank, stay within 0.1 of the largest
    |logit| of the bf16 wire's (e4m3 rounds each value sent by up to 1/16; measured: 0.014-0.027)
    and differ from them (the rows did go through fp8)."""
    results = run_ranks(_engine_over_wires, 2, timeout_s=150, rank_timeout_s=60)
    for got in results:
        assert got["bf16"][0] == [("bf16", 512)] * 2 and got["fp8"][0] == [("fp8", 144)] * 2
    assert results[0]["bf16"][1] == results[0]["fp8"][1] == [4] * len(WIRE_PROMPTS)  # rank 0 reports all
    firsts = [(r["bf16"][2], r["fp8"][2]) for r in results]
    assert sum(len(b) for b, _ in firsts) == len(WIRE_PROMPTS)  # each request's rank tapped it
    moved = []
    for bf16, fp8 in firsts:
        for rid, want in bf16.items():
            err = float((fp8[rid] - want).abs().max())
            assert 0 < err <= 0.1 * float(want.abs().max()), (rid, err, float(want.abs().max()))
            moved.append(err / float(want.abs().max()))
    print(f"fp8 wire: first logits moved by {min(moved):.3f}-{max(moved):.3f} of the largest |logit|")


def _engine_with_this_ranks_options(ctx) -> str:
    """Rank 1 started with another dtype and KV format than rank 0 (another node's command line)."""
    from zerodram.runtime.engine import EngineConfig
    from zerodram.runtime.engine.build import build_engine

    torch.set_num_threads(1)
    config = EngineConfig(kv_format=("fp32", "bf16")[ctx.rank], num_kv_pages=8, page_size=4)
    try:
        build_engine("random:tiny-moe", ctx, config, dtype=("fp32", "bf16")[ctx.rank], seed=5)
    except ConfigError as err:
        return str(err)
    return "built"


def test_ranks_started_with_different_options_are_refused_on_every_rank() -> None:
    """Every rank raises the same error, naming each differing option, before any buffer or
    expert-parallel collective (which would exchange rows of other sizes, or wait forever)."""
    results = run_ranks(_engine_with_this_ranks_options, 2, timeout_s=120, rank_timeout_s=30)
    assert results[0] == results[1]
    assert results[0].startswith("ranks were started with different settings (every rank needs the same): ")
    assert "dtype: rank 0 'fp32', rank 1 'bf16'" in results[0]
    assert "engine.kv_format: rank 0 'fp32', rank 1 'bf16'" in results[0]
    assert "model." not in results[0] and "seed" not in results[0]


def test_long_settings_travel_as_digests() -> None:
    from zerodram.runtime.engine.build import digested

    long = repr(tuple((e % 8,) for e in range(4096)))
    got = digested({"placement": long, "dtype": "'bf16'"})
    assert got["dtype"] == "'bf16'" and got["placement"].startswith("(sha256 ") and len(got["placement"]) == 25
    assert got != digested({"placement": long.replace("(7,)", "(6,)", 1), "dtype": "'bf16'"})


def _engine_with_this_ranks_calibration_and_backend(ctx) -> str:
    """Rank 1 calibrates from a file where rank 0 runs the collective "auto", and its environment
    names another EP backend (what each rank would do, not what it was told, is compared)."""
    import os

    from zerodram.runtime.engine import EngineConfig
    from zerodram.runtime.engine.build import build_engine

    torch.set_num_threads(1)
    os.environ["ZERODRAM_EP_BACKEND"] = ("torch", "nvshmem")[ctx.rank]
    calib = ("auto", "/nonexistent/kv.json")[ctx.rank]
    config = EngineConfig(kv_format="fp2:kblk=c16,vblk=c16,tail=1,window=3", num_kv_pages=8, page_size=32,
                          kv_calibration=calib, kv_calibration_save=f"/tmp/rank{ctx.rank}.json")  # fmt: skip
    try:
        build_engine("random:tiny-moe", ctx, config, seed=5)
    except ConfigError as err:
        return str(err)
    return "built"


def test_ranks_that_would_calibrate_or_exchange_differently_are_refused() -> None:
    results = run_ranks(_engine_with_this_ranks_calibration_and_backend, 2, timeout_s=120, rank_timeout_s=30)
    assert results[0] == results[1]
    assert "engine.kv_calibration: rank 0 'auto', rank 1 'a file'" in results[0]
    assert "ep_backend: rank 0 'torch', rank 1 '(refused: EP backend nvshmem needs a GPU; rank 1 runs on cpu)'" in results[0]
    assert "kv_calibration_save" not in results[0]


def test_a_wire_the_model_cannot_send_is_refused_by_name() -> None:
    """fp8 needs hidden % 128 (its scale groups) and runtime/moe's layer: both refused at build,
    before any collective, naming what is wrong."""
    from zerodram.runtime.model.ep import ExpertParallelWorld

    ctx = type("Ctx", (), {"rank": 0, "world_size": 2, "device": torch.device("cpu")})()
    kw = dict(expert_to_rank=(0, 0, 1, 1), top_k=2, max_tokens_per_rank=4, num_moe_layers=2)
    with pytest.raises(ConfigError, match="fp8 wire needs hidden % 128 == 0, got hidden 576"):
        ExpertParallelWorld(ctx, hidden=576, wire="fp8", **kw)
    with pytest.raises(ConfigError, match="the allgather stopgap gathers whole rows"):
        ExpertParallelWorld(ctx, hidden=128, wire="fp8", backend="allgather", **kw)
    with pytest.raises(ConfigError, match="wire format 'fp4'"):
        ExpertParallelWorld(ctx, hidden=128, wire="fp4", **kw)
    assert ExpertParallelWorld(ctx, hidden=128, wire="fp8", backend="torch", **kw).wire == "fp8"


REPLICA_TOPOLOGY = """\
cluster: replicas-2
device: cpu
fabric:
  intra_node: {kind: shm, gbps: 80}
nodes:
  - name: localhost
    cpu_ranks: 2
experts:
  num_experts: 8
  placement: contiguous   # rank 0: experts 0-3, rank 1: 4-7
"""


def _engine_with_placement(ctx) -> dict:
    """Each request's first logits and, per MoE layer, the experts this rank holds weights of and
    the ranks each expert's tokens may go to (tiny-moe: 8 experts, as the topology places them)."""
    from zerodram.runtime.engine import EngineConfig, SamplingParams, SchedulerConfig
    from zerodram.runtime.engine.build import build_engine

    torch.set_num_threads(1)
    config = EngineConfig(kv_format="fp32", num_kv_pages=64, page_size=4, scheduler=SchedulerConfig(4, 16, 4))
    engine = build_engine("random:tiny-moe", ctx, config, seed=5, ep_backend="torch")
    layers = [ep.layer for ep in engine.model._make_ep.built]
    held = [tuple(int(e) for e in layer.experts.expert_ids) for layer in layers]
    owners = [[layer.comm.layout.placement.owners(e) for e in range(8)] for layer in layers]
    first: dict[int, torch.Tensor] = {}
    engine.on_logits = lambda ids, logits: [first.setdefault(r, x.clone()) for r, x in zip(ids, logits, strict=True)]
    with engine:
        outs = engine.generate(WIRE_PROMPTS * 2, SamplingParams(max_tokens=3, ignore_eos=True))
    return {"held": held, "owners": owners, "first": first, "lengths": [len(o.token_ids) for o in outs]}


def test_the_engine_serves_a_topologys_replicas(tmp_path) -> None:
    """A topology's `experts.replicas` reach the engine: the replica's rank holds the expert's
    weights and the dispatch may send its tokens there. The logits match the same model without
    replicas (an expert's weights are the same on every rank that holds it; rows cross ranks as
    bf16 either way, so the two differ by rounding where a token's expert moved rank)."""
    from zerodram.runtime.topology import load_topology

    got = {}
    for name, extra in (("plain", ""), ("replicas", "  replicas: {1: [1], 6: [0]}\n")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(REPLICA_TOPOLOGY + extra)
        got[name] = run_ranks(_engine_with_placement, 2, topology=load_topology(path), timeout_s=150, rank_timeout_s=60)
    plain, reps = got["plain"], got["replicas"]
    assert [r["held"][0] for r in plain] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [r["held"][0] for r in reps] == [(0, 1, 2, 3, 6), (1, 4, 5, 6, 7)]
    assert all(r["held"] == [r["held"][0]] * len(r["held"]) for r in reps)  # every MoE layer
    assert reps[0]["owners"][0][1] == (0, 1) and reps[0]["owners"][0][6] == (6 // 4, 0)
    assert plain[0]["lengths"] == reps[0]["lengths"] == [3] * 2 * len(WIRE_PROMPTS)
    for p, r in zip(plain, reps, strict=True):
        assert p["first"].keys() == r["first"].keys()
        for rid, want in p["first"].items():
            err = float((r["first"][rid] - want).abs().max())
            assert err <= 0.05 * float(want.abs().max()), (rid, err)


def test_replicas_through_the_allgather_stopgap_are_refused(tmp_path) -> None:
    from zerodram.runtime.model.ep import ExpertParallelWorld
    from zerodram.runtime.topology import load_topology

    path = tmp_path / "replicas.yaml"
    path.write_text(REPLICA_TOPOLOGY + "  replicas: {1: [1]}\n")
    ctx = type("Ctx", (), {"rank": 0, "world_size": 2, "device": torch.device("cpu"), "topology": load_topology(path)})()
    kw = dict(expert_to_rank=(0, 0, 0, 0, 1, 1, 1, 1), top_k=2, max_tokens_per_rank=4, num_moe_layers=2, hidden=64)
    with pytest.raises(ConfigError, match=r"experts\.replicas need the dispatch"):
        ExpertParallelWorld(ctx, backend="allgather", **kw)
