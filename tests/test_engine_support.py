"""Shared helpers of the engine tests (no transformers import here: rank processes import this)."""

from __future__ import annotations

PROMPTS = [[3, 17, 99, 5, 42, 7, 11, 64, 2, 90], [1, 2, 3], [9, 9, 9, 9, 120, 33]]
MAX_TOKENS = 10
SMOL_QUESTIONS = ("What is the capital of France?", "Name a fruit.")


# The KV formats whose greedy tokens must equal transformers' (fp32 weights and compute): fp32
# pages (plain torch, 4-token pages) and runtime/kv's bf16 pages (32-token pages, its minimum).
PARITY_KV = ("fp32", "bf16")


def engine_greedy(
    model: str, ctx, prompts: list, max_tokens: int, kv: str = "fp32", page_size: int | None = None, **kw
) -> list[list[int]]:
    """Greedy tokens from our engine; small prefill chunks (and pages, where the format allows)
    so that chunking and paging are exercised."""
    from zerodram.runtime.engine import EngineConfig, SamplingParams, SchedulerConfig
    from zerodram.runtime.engine.build import build_engine

    page_size = page_size or (4 if kv == "fp32" else 32)
    cfg = EngineConfig(
        kv_format=kv, num_kv_pages=64, page_size=page_size, scheduler=SchedulerConfig(4, 16, 4)
    )
    engine = build_engine(model, ctx, cfg, **kw)
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [o.token_ids for o in outs]


def rank_parity(ctx, ckpts: dict[str, str], smol_prompts: list[list[int]] | None, allgather: bool) -> dict:
    """Run on every rank: greedy tokens of each model (rank 0's are the results)."""
    import torch

    torch.set_num_threads(1)
    got = {
        f"{kind}/{kv}": engine_greedy(path, ctx, PROMPTS, MAX_TOKENS, kv=kv)
        for kind, path in ckpts.items()
        for kv in PARITY_KV
    }
    if allgather:
        got["mixtral_allgather/fp32"] = engine_greedy(
            ckpts["mixtral"], ctx, PROMPTS, MAX_TOKENS, ep_backend="allgather"
        )
    if smol_prompts is not None:
        for kv in PARITY_KV:
            got[f"smollm2/{kv}"] = engine_greedy("smollm2", ctx, smol_prompts, 6, kv=kv)
    return got
