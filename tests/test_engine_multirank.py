"""Greedy parity with transformers over 2 and 4 CPU ranks (gloo), with fp32 and BF16 KV pages:
expert-parallel MoE through runtime/moe's EP layer (and the all-gather stopgap at 2 ranks),
data-parallel attention (each request on one rank, its KV there). One launch per world size runs every model, to keep process
start-up off the test budget; the rank function lives in test_engine_support (no transformers).
"""

from __future__ import annotations

import pytest
from multirank import run_ranks
from test_engine_support import PARITY_KV, rank_parity

pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_greedy_matches_transformers_over_ranks(
    tmp_path_factory: pytest.TempPathFactory, world_size: int
) -> None:
    from test_engine_parity import smollm2_references, tiny_references

    ckpts, tiny = tiny_references(tmp_path_factory.mktemp("tiny"))
    prompts, smol = smollm2_references(6)
    models = {**tiny, "smollm2": smol}
    want = {f"{kind}/{kv}": tokens for kind, tokens in models.items() for kv in PARITY_KV}
    allgather = world_size == 2
    if allgather:
        want["mixtral_allgather/fp32"] = tiny["mixtral"]
    results = run_ranks(
        rank_parity,
        world_size,
        args=({k: str(p) for k, p in ckpts.items()}, prompts, allgather),
        timeout_s=300,
    )
    assert sorted(results[0]) == sorted(want)
    for key, tokens in want.items():
        assert results[0][key] == tokens, f"{key} KV over {world_size} ranks"
