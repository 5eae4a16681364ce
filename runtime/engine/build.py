"""Wire a model argument into a ready `Engine` on this rank (what the CLI and the jobs call).

    engine = build_engine("smollm2", ctx, EngineConfig(kv_format="fp2"))

Loads this rank's share of the weights (its experts only), binds each MoE layer's experts to the
expert-parallel layer for the world, loads the tokenizer, and builds the engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch

from zerodram.runtime.engine.config import EngineConfig, StepStats
from zerodram.runtime.engine.engine import Engine
from zerodram.runtime.loading.checkpoint import ModelSpec, RankModel, load_for_rank
from zerodram.runtime.model.ep import ExpertParallelWorld
from zerodram.runtime.model.timing import NULL_TIMER, PhaseTimer
from zerodram.runtime.model.transformer import Transformer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_model(
    rm: RankModel,
    ctx: Any | None,
    timer: PhaseTimer = NULL_TIMER,
    *,
    max_step_tokens: int = 256,
    ep_backend: str | None = None,
    ep_wire: str = "bf16",
) -> Transformer:
    """The rank's `Transformer`, its MoE layers bound to the world's expert parallelism.

    Args:
        ctx: the rank context (None: one process, all experts local).
        max_step_tokens: the most tokens one step sends through a MoE layer (EP buffer sizing).
        ep_backend: "torch", "nvshmem", "auto" (runtime/moe's layer) or "allgather" (stopgap).
        ep_wire: the dispatch's row format across ranks, "bf16" or "fp8" (`ExpertParallelWorld`).
    """
    cfg = rm.config
    world = ExpertParallelWorld(
        ctx,
        timer,
        expert_to_rank=rm.placement.expert_to_rank if rm.placement is not None else None,
        top_k=cfg.num_experts_per_tok,
        hidden=cfg.hidden_size,
        max_tokens_per_rank=max_step_tokens,
        num_moe_layers=sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers)),
        backend=ep_backend,
        dtype=rm.weights["embed"].dtype,
        every_token=cfg.router_kind == "dense_slices",
        wire=ep_wire,
    )
    # No close on an error here: closing is collective, and a rank that failed alone would pair
    # its close with the others' next layer; process exit tears NVSHMEM down (as Engine.__exit__).
    return Transformer(cfg, rm.weights, world, timer)


def build_engine(
    model: str,
    ctx: Any | None,
    config: EngineConfig | None = None,
    *,
    dtype: str = "fp32",
    num_experts: int | None = None,
    seed: int = 0,
    timer: PhaseTimer = NULL_TIMER,
    on_step: Any = None,
    ep_backend: str | None = None,
    ep_wire: str = "bf16",
) -> Engine:
    """Load `model` (see `ModelSpec.parse`) for this rank and return its engine.

    Raises:
        ConfigError: bad model argument, checkpoint, or engine limits; on every rank, ranks whose
            settings differ (`check_ranks_agree`).
        RankTimeoutError: a rank never joined that check.
    """
    from zerodram.runtime.loading.tokenizer import Tokenizer

    rank = getattr(ctx, "rank", 0)
    world_size = getattr(ctx, "world_size", 1)
    device = getattr(ctx, "device", torch.device("cpu"))
    spec = ModelSpec.parse(model)
    rm = load_for_rank(
        spec,
        rank,
        world_size,
        topology=getattr(ctx, "topology", None),
        num_experts=num_experts,
        dtype=DTYPES[dtype],
        device=device,
        seed=seed,
    )
    tokenizer = Tokenizer(rm.tokenizer_dir) if rm.tokenizer_dir is not None else None
    config = config or EngineConfig()
    if world_size > 1:  # before the first collective that the settings shape (EP, NVSHMEM buffers)
        check_ranks_agree(ctx, engine_settings(ctx, rm, config, dtype, seed, ep_backend, ep_wire))
    model_ = build_model(
        rm, ctx, timer, max_step_tokens=config.scheduler.max_step_tokens, ep_backend=ep_backend, ep_wire=ep_wire
    )
    engine = Engine(model_, config, tokenizer=tokenizer, ctx=ctx, on_step=on_step)
    engine.model_name = rm.name
    placement = rm.placement
    engine._expert_to_rank = placement.expert_to_rank if placement is not None else None
    engine._expert_owners = (
        tuple(placement.owners(e) for e in range(placement.num_experts)) if placement is not None else None
    )
    return engine


def engine_settings(
    ctx: Any, rm: RankModel, config: EngineConfig, dtype: str, seed: int, ep_backend: str | None, ep_wire: str
) -> dict[str, str]:
    """What every rank's engine must share, flat: field name -> its repr.

    As each rank will use it, not as it was spelled: the model by its config (a node's checkpoint
    path need not be another's), the expert placement (each node reads its own topology file), the
    EP backend resolved (a rank's ZERODRAM_EP_BACKEND, device and nvshmem4py decide "auto"; a rank
    that cannot have it shows its error), and the KV calibration by its mode: "auto" is collective
    (prefill through the experts, then broadcasts), "none" and a file are not; the files' paths
    may differ, and each rank applies its file to its own KV.
    """
    from zerodram.runtime.comm import resolve_backend
    from zerodram.runtime.errors import ConfigError

    out = {f"model.{k}": repr(v) for k, v in dataclasses.asdict(rm.config).items()}
    p = rm.placement
    out["placement"] = repr(None if p is None else tuple(p.owners(e) for e in range(p.num_experts)))
    try:  # the allgather stopgap is the model's own choice (runtime/model/ep.py), not a comm backend
        backend = ep_backend if ep_backend == "allgather" else resolve_backend(ctx, ep_backend, DTYPES[dtype])
    except ConfigError as err:
        backend = f"(refused: {err})"
    out |= {"dtype": repr(dtype), "seed": repr(seed), "ep_backend": repr(backend), "ep_wire": repr(ep_wire)}
    for k, v in dataclasses.asdict(config).items():
        if k == "kv_calibration":
            out["engine.kv_calibration"] = repr(v if v in ("auto", "none") else "a file")
        elif k != "kv_calibration_save":  # a path, written by rank 0
            out[f"engine.{k}"] = repr(v)
    return out


def digested(settings: dict[str, str], longest: int = 200) -> dict[str, str]:
    """Values past `longest` characters (a placement of many experts) as digests: every rank receives
    every rank's settings, so their size is multiplied by the world size."""
    return {k: v if len(v) <= longest else f"(sha256 {hashlib.sha256(v.encode()).hexdigest()[:16]})" for k, v in settings.items()}


def check_ranks_agree(ctx: Any, settings: dict[str, str]) -> None:
    """Raise the same ConfigError on every rank when any rank's settings differ from rank 0's
    (several ranks: `build_engine` calls it only then, and `ctx` is their RankContext).

    Ranks started with other options (another node's command line, say) would otherwise build
    buffers of other sizes or another wire and exchange garbage, or wait on each other forever.
    One small exchange at construction, on the CPU group; every rank sees every rank's settings, so
    they all raise, or none does.

    Raises:
        ConfigError: naming each differing field with rank 0's value and the other ranks'.
        RankTimeoutError: the exchange failed or a rank never joined it.
    """
    from zerodram.runtime.errors import ConfigError

    gathered = ctx.all_gather_object(digested(settings), "the engine settings")
    diffs = []
    for key in sorted(set().union(*gathered)):
        values = [g.get(key, "(unset)") for g in gathered]
        others = [f"rank {r} {v}" for r, v in enumerate(values) if r and v != values[0]]
        if others:  # a few ranks by name: with thousands of ranks, one line must stay one line
            more = f", and {len(others) - 4} more ranks" if len(others) > 4 else ""
            diffs.append(f"{key}: rank 0 {values[0]}, " + ", ".join(others[:4]) + more)
    if diffs:
        shown = "; ".join(diffs[:8]) + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "")
        raise ConfigError(f"ranks were started with different settings (every rank needs the same): {shown}")


__all__ = ["Engine", "EngineConfig", "StepStats", "build_engine", "build_model"]
