"""Sampler: greedy, temperature, top-p, per-request seeded generators."""

from __future__ import annotations

import pytest
import torch

from zerodram.runtime.engine.request import SamplingParams
from zerodram.runtime.engine.sampler import make_generator, sample, top_p_filter

pytestmark = pytest.mark.usefixtures("one_torch_thread")


CPU = torch.device("cpu")


def test_greedy_is_argmax_and_draws_nothing() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams()] * 5
    gens = [make_generator(p, i, CPU) for i, p in enumerate(params)]
    assert gens == [None] * 5
    assert sample(logits, params, gens) == logits.argmax(-1).tolist()
    assert sample(torch.empty(0, 50), [], []) == []


def test_seeded_sampling_repeats_and_ignores_batch_neighbours() -> None:
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=42)
    alone = [sample(logits[1:2], [p], [g])[0] for g in [make_generator(p, 0, CPU)] for _ in range(20)]
    g2 = make_generator(p, 0, CPU)
    other = SamplingParams(temperature=1.5, seed=7)
    g_other = make_generator(other, 1, CPU)
    batched = [sample(logits[:2], [other, p], [g_other, g2])[1] for _ in range(20)]
    # the same generator state sequence gives the same draws whatever else is in the batch
    g3 = make_generator(p, 0, CPU)
    again = [sample(logits[1:2], [p], [g3])[0] for _ in range(20)]
    assert batched == again
    assert len(set(again)) > 1
    assert alone[0] == again[0]


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    torch.testing.assert_close(top_p_filter(probs, 0.6), torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    torch.testing.assert_close(top_p_filter(probs, 0.4), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(top_p_filter(probs, 1.0), probs)
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    p = SamplingParams(temperature=1.0, top_p=0.01, seed=3)
    g = make_generator(p, 0, CPU)
    assert {sample(logits, [p], [g])[0] for _ in range(10)} == {1}


def test_temperature_sharpens() -> None:
    logits = torch.tensor([[1.0, 1.5, 0.5, 0.0]])
    hot = SamplingParams(temperature=5.0, seed=0)
    cold = SamplingParams(temperature=0.05, seed=0)
    gh, gc = make_generator(hot, 0, CPU), make_generator(cold, 0, CPU)
    hot_draws = {sample(logits, [hot], [gh])[0] for _ in range(100)}
    cold_draws = {sample(logits, [cold], [gc])[0] for _ in range(100)}
    assert len(hot_draws) >= 3
    assert cold_draws == {1}


def test_tiny_temperatures_tend_to_greedy_and_bad_rows_draw_nothing() -> None:
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)) * 30
    logits[1, 5] = float("nan")
    logits[2, 7] = float("inf")
    params = [SamplingParams(temperature=t, seed=1) for t in (1e-40, 5e-324, 1.0)]
    gens = [make_generator(p, i, CPU) for i, p in enumerate(params)]
    assert gens[:2] == [None, None]  # below GREEDY_BELOW: greedy, nothing drawn
    assert sample(logits, params, gens) == [int(logits[0].argmax()), None, None]
    # 5e-324 (the smallest double, 0 in fp32) on a finite row: greedy, not 0 / 0 = NaN
    assert sample(logits[:1], params[1:2], gens[1:2]) == [int(logits[0].argmax())]
    # -inf masks a token (drawn around it); a row of nothing but -inf has nothing to draw
    masked = torch.tensor([[0.0, float("-inf"), 1.0], [float("-inf")] * 3])
    warm = SamplingParams(temperature=1.0, seed=3)
    draws = sample(masked, [warm, warm], [make_generator(warm, 0, CPU), make_generator(warm, 1, CPU)])
    assert draws[0] in (0, 2) and draws[1] is None
    # a small temperature above it on logits near fp32's limit: max subtracted first, no inf
    huge = torch.tensor([[3e38, 2.9e38, -3e38]])
    cold = SamplingParams(temperature=2e-5, seed=2)
    assert sample(huge, [cold], [make_generator(cold, 0, CPU)]) == [0]
