"""Greedy parity with transformers over 2 and 4 CPU ranks (gloo): expert-parallel MoE through
runtime/moe's EP layer (and the all-gather stopgap at 2 ranks), data-parallel attention (each
request on one rank, its KV there). One launch per world size runs every model, to keep process
start-up off the test budget; the rank function lives in test_engine_support (no transformers).
"""

from __future__ import annotations

import pytest
from multirank import run_ranks
from test_engine_support import rank_parity

pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_greedy_matches_transformers_over_ranks(
    tmp_path_factory: pytest.TempPathFactory, world_size: int
) -> None:
    from test_engine_parity import smollm2_references, tiny_references

    ckpts, want = tiny_references(tmp_path_factory.mktemp("tiny"))
    want = dict(want)
    prompts, want["smollm2"] = smollm2_references(6)
    allgather = world_size == 2
    if allgather:
        want["mixtral_allgather"] = want["mixtral"]
    results = run_ranks(
        rank_parity,
        world_size,
        args=({k: str(p) for k, p in ckpts.items()}, prompts, allgather),
        timeout_s=240,
    )
    for kind, tokens in want.items():
        assert results[0][kind] == tokens, f"{kind} over {world_size} ranks"
