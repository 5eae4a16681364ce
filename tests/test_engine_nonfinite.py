"""NaN/Inf in one request's K/V: that request ends with an error, every other request goes on with
exactly the tokens of a clean run, no page is leaked, and nothing non-finite is stored."""

from __future__ import annotations

import pytest
import torch

from zerodram.runtime.engine import EngineConfig, SamplingParams, SchedulerConfig
from zerodram.runtime.engine.build import build_engine

PROMPTS = [[3, 17, 99, 5, 42, 7, 11, 64, 2, 90], [1, 2, 3, 4, 5], [9, 9, 9, 9, 120, 33]]
TARGET, LAYER = 1, 1  # request 1's K turns NaN in layer 1


def _engine(kv: str):
    cfg = EngineConfig(kv_format=kv, num_kv_pages=64, page_size=4 if kv == "fp32" else 32, scheduler=SchedulerConfig(4, 16, 4))
    return build_engine("random:tiny-moe", None, cfg)


def _poison(engine, where: str) -> None:
    """Make request TARGET's K non-finite once, in layer LAYER, at its first decode step or prefill
    chunk (the model itself stays intact: only what reaches the KV partition is changed). "huge":
    a whole decode row of finite 3e38, whose FP2 stored value overflows (not saturated:
    docs/fp2-format.md, "Non-finite input")."""
    kv, done = engine.kv, []

    def write(layer_idx, seq_id, start_pos, k, v, _orig=kv.write):
        if where == "prefill" and not done and layer_idx == LAYER and seq_id == TARGET:
            k = k.clone()
            k[-1, 0, 1] = float("nan")
            done.append(1)
        return _orig(layer_idx, seq_id, start_pos, k, v)

    def write_decode(layer_idx, seq_ids, positions, k, v, _orig=kv.write_decode):
        if where in ("decode", "huge") and not done and layer_idx == LAYER and TARGET in seq_ids:
            k = k.clone()
            if where == "huge":
                k[list(seq_ids).index(TARGET)] = 3e38
            else:
                k[list(seq_ids).index(TARGET), 1, 2] = float("inf")
            done.append(1)
        return _orig(layer_idx, seq_ids, positions, k, v)

    kv.write, kv.write_decode = write, write_decode


@pytest.mark.parametrize("where", ["prefill", "decode"])
@pytest.mark.parametrize("kv", ["fp32", "bf16", "fp2:kblk=c16,vblk=c16,tail=1,window=3"])  # fp2: flushes within the run
def test_nonfinite_kv_ends_only_its_request(kv: str, where: str) -> None:
    torch.manual_seed(0)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    clean = _engine(kv).generate(PROMPTS, params)
    engine = _engine(kv)
    _poison(engine, where)
    errors: list[str] = []
    engine.on_error = errors.append  # the metrics hook: the dashboard counts it
    outs = engine.generate(PROMPTS, params)
    bad = outs[TARGET]
    assert bad.finish_reason == "error" and "non-finite" in bad.error and f"layer {LAYER}" in bad.error
    for i, (got, want) in enumerate(zip(outs, clean, strict=True)):
        if i != TARGET:
            assert got.error is None and got.token_ids == want.token_ids, f"request {i} was disturbed"
    assert engine.kv.num_free_pages() == engine.kv.num_pages  # the failed request's pages came back
    assert engine.kv.take_nonfinite() == {}
    assert len(errors) == 1 and f"request {TARGET} stopped" in errors[0]


def test_fp2_stored_value_overflow_ends_only_its_request() -> None:
    """Finite K past what the FP2 stored space holds: the token is stored as inf / NaN, and the
    request ends at its next non-finite check (a later layer's K/V or its logits); the others go
    on with a clean run's tokens and every page comes back."""
    torch.manual_seed(0)
    kv = "fp2:kblk=c16,vblk=c16,tail=1,window=3"
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    clean = _engine(kv).generate(PROMPTS, params)
    engine = _engine(kv)
    _poison(engine, "huge")
    outs = engine.generate(PROMPTS, params)
    assert outs[TARGET].finish_reason == "error" and "non-finite" in outs[TARGET].error, outs[TARGET]
    for i in (0, 2):
        assert outs[i].error is None and outs[i].token_ids == clean[i].token_ids
    assert engine.kv.num_free_pages() == engine.kv.num_pages


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["prefill", "decode"])
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_nonfinite_kv_on_the_fused_fp2_path(where: str, graphs: bool) -> None:
    """The same on a GPU through the fused FP2 decode kernels (head dim 64), bf16 weights (the
    routed expert kernel), eager and with CUDA graphs: only the poisoned request ends."""
    import dataclasses

    from zerodram.runtime.engine.engine import Engine
    from zerodram.runtime.engine.fp2_decode import Fp2FusedDecode
    from zerodram.runtime.loading.random_init import random_weights
    from zerodram.runtime.model.named import named_config
    from zerodram.runtime.model.transformer import Transformer

    cfg = dataclasses.replace(named_config("tiny-moe"), hidden_size=256, head_dim=64, num_heads=4, num_kv_heads=2)

    def engine() -> Engine:
        weights = random_weights(cfg, None, 0, seed=3, dtype=torch.bfloat16)
        model = Transformer(cfg, {k: w.cuda() for k, w in weights.items()})
        config = EngineConfig(
            kv_format="fp2:tail=1,window=3", num_kv_pages=64, page_size=64,
            scheduler=SchedulerConfig(4, 16, 4), cuda_graphs=graphs,
        )  # fmt: skip
        e = Engine(model, config)
        assert isinstance(e.attn.decode, Fp2FusedDecode)
        return e

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    clean = engine().generate(PROMPTS, params)
    e = engine()
    _poison(e, where)
    outs = e.generate(PROMPTS, params)
    assert outs[TARGET].finish_reason == "error" and "non-finite" in outs[TARGET].error
    # the others finish normally; their tokens may part from the clean run's after a near-tie,
    # since without request 1 the batch (and cuBLAS's choice of kernel for it) changes shape
    same = total = 0
    for i in (0, 2):
        assert outs[i].error is None and len(outs[i].token_ids) == params.max_tokens
        same += sum(a == b for a, b in zip(outs[i].token_ids, clean[i].token_ids, strict=True))
        total += params.max_tokens
    assert same / total >= 0.75
    assert e.kv.num_free_pages() == e.kv.num_pages


def test_scoring_stops_on_nonfinite_kv_and_leaves_no_record() -> None:
    """`score_tokens` over K/V gone NaN raises rather than scoring zeros, and the record does not
    outlive it (a later request of the same id would be ended by it)."""
    from zerodram.runtime.engine.score import score_tokens
    from zerodram.runtime.errors import ZerodramError

    engine = _engine("fp32")
    kv, clean_write = engine.kv, engine.kv.write

    def write(layer_idx, seq_id, start_pos, k, v):
        if layer_idx == LAYER and start_pos == 4:
            k = k.clone()
            k[0, 0, 1] = float("nan")
        return clean_write(layer_idx, seq_id, start_pos, k, v)

    kv.write = write
    with pytest.raises(ZerodramError, match=f"scoring stopped at tokens 4..7: non-finite K/V at layer {LAYER}"):
        score_tokens(engine, PROMPTS[0], chunk=4)
    kv.write = clean_write
    assert engine.kv.take_nonfinite() == {}
    assert engine.kv.num_free_pages() == engine.kv.num_pages
    out = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.finish_reason == "length", out.error
