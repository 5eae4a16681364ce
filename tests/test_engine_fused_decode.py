"""The engine's fused FP2 decode path (runtime/engine/fp2_decode.py) against gather + SDPA, on CPU
(where Fp2DecodeAttention runs the plain-torch reference of the kernels).

Shape legend: B sequences, Hq query heads, Hkv KV heads, Dh head dim, L cached tokens.

Both paths read the same pages, so they differ only by rounding (fp32 here): per layer to 1e-4,
and the engine's greedy tokens must be identical.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from test_engine_support import SMOL_QUESTIONS

from zerodram.runtime.engine import EngineConfig, SamplingParams, SchedulerConfig
from zerodram.runtime.engine.engine import Engine
from zerodram.runtime.engine.fp2_decode import Fp2FusedDecode, make_decode_attention
from zerodram.runtime.engine.kv_adapter import RuntimeKVPartition
from zerodram.runtime.loading.random_init import random_weights
from zerodram.runtime.model.attention import PagedAttention
from zerodram.runtime.model.config import ModelConfig
from zerodram.runtime.model.transformer import Transformer

# A tiny random MoE whose head dim the kernels take (64); G = 3 as in SmolLM2.
TINY64 = ModelConfig(
    arch="mixtral", vocab_size=256, hidden_size=96, num_layers=2, num_heads=6, num_kv_heads=2,
    head_dim=64, intermediate_size=96, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=64, norm_topk_prob=True, max_position_embeddings=512,
)  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _randomize_params(kv: RuntimeKVPartition, g: torch.Generator) -> None:
    """Non-trivial anchors on both sides and a key center, as calibration would set them (the
    uncalibrated defaults are anchors of 1 and no center, which would hide a mix-up)."""
    for cache in kv.caches:
        kp, vp = cache.params
        H, D = kp.anchor.shape
        kp = dataclasses.replace(
            kp, anchor=torch.rand(H, D, generator=g) + 0.5, center=torch.randn(H, D, generator=g)
        )
        vp = dataclasses.replace(vp, anchor=torch.rand(H, D, generator=g) + 0.5)
        cache.params = (kp, vp)


@pytest.mark.parametrize(
    ("spec", "Hq", "Hkv", "D"),
    [
        ("fp2", 8, 2, 128),
        ("fp2:sinks=4,tail=1,window=5", 6, 2, 64),
        ("fp2:sinks=2,tail=8,window=3,rot=0,scale=e8m0", 4, 4, 64),
    ],
)
def test_fused_equals_gather_sdpa_per_layer(spec: str, Hq: int, Hkv: int, D: int) -> None:
    """Random caches over several pages (sinks, FP2 pages and a bf16 tail), every layer."""
    g = torch.Generator().manual_seed(7)
    kv = RuntimeKVPartition(spec, 2, Hkv, D, 40, 32, torch.float32, torch.device("cpu"))
    _randomize_params(kv, g)
    lengths = [1, 3, 9, 33, 70, 130]
    for sid, n in enumerate(lengths):
        kv.reserve(sid, n + 4)
        for layer in range(2):
            k, v = torch.randn(n, Hkv, D, generator=g) * 2, torch.randn(n, Hkv, D, generator=g)
            kv.write(layer, sid, 0, k[: n // 2], v[: n // 2])  # a chunk, then token by token
            for pos in range(n // 2, n):
                kv.write(layer, sid, pos, k[pos : pos + 1], v[pos : pos + 1])
    fused = make_decode_attention(kv, num_q_heads=Hq, scale=D**-0.5, max_batch=8)
    assert isinstance(fused, Fp2FusedDecode)
    gather = PagedAttention(kv, D**-0.5)
    seq_ids = tuple(range(len(lengths)))
    for layer in range(2):
        q = torch.randn(len(lengths), Hq, D, generator=g) * 2  # [B, Hq, Dh]
        got = fused(layer, q, seq_ids, tuple(lengths))
        want = gather.decode(layer, q, seq_ids, tuple(lengths))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # a subset in another order, then a slot reused by a new sequence with the same id
    sub = (4, 0, 2)
    q = torch.randn(3, Hq, D, generator=g)
    torch.testing.assert_close(
        fused(0, q, sub, tuple(lengths[s] for s in sub)),
        gather.decode(0, q, sub, tuple(lengths[s] for s in sub)),
        rtol=1e-4, atol=1e-4,
    )  # fmt: skip
    kv.free(4)
    kv.reserve(4, 80)
    for layer in range(2):
        kv.write(layer, 4, 0, torch.randn(75, Hkv, D, generator=g), torch.randn(75, Hkv, D, generator=g))
    torch.testing.assert_close(
        fused(0, q, sub, (75, lengths[0], lengths[2])),
        gather.decode(0, q, sub, (75, lengths[0], lengths[2])),
        rtol=1e-4, atol=1e-4,
    )  # fmt: skip


@pytest.mark.parametrize("spec", ["fp2:kblk=t32", "fp2:vcenter=1", "fp2:scale=bf16", "bf16"])
def test_formats_the_kernels_cannot_read_keep_the_gather_path(spec: str, caplog) -> None:
    kv = RuntimeKVPartition(spec, 1, 2, 64, 4, 32, torch.float32, torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="zerodram.engine"):
        assert make_decode_attention(kv, num_q_heads=4, scale=0.125, max_batch=4) is None
    if spec != "bf16":
        assert "gather + SDPA" in caplog.text


def test_key_codebooks_off_the_int8_grid_take_the_fp16_key_kernel() -> None:
    """Int8 keys (the kernels' default) hold the key levels times 64 exactly; a calibrated codebook
    with an inner level off that grid sends every layer to the fp16-key kernel, decided at
    construction."""
    kv = RuntimeKVPartition("fp2", 2, 2, 64, 4, 32, torch.float32, torch.device("cpu"))
    assert make_decode_attention(kv, num_q_heads=4, scale=0.125, max_batch=4).attn.key_s8
    kp, vp = kv.caches[1].params
    odd = torch.tensor([-1.5, -1 / 128, 1 / 128, 1.5], dtype=kp.levels.dtype)  # e5m2-exact, not int8 x 1/64
    kv.caches[1].params = (dataclasses.replace(kp, levels=odd), vp)
    assert not make_decode_attention(kv, num_q_heads=4, scale=0.125, max_batch=4).attn.key_s8


def _tiny_engine(kv: str, fused: bool, max_num_seqs: int = 4) -> Engine:
    model = Transformer(TINY64, random_weights(TINY64, None, 0, seed=3, dtype=torch.float32))
    cfg = EngineConfig(
        kv_format=kv, num_kv_pages=32, page_size=32, fused_decode=fused,
        scheduler=SchedulerConfig(max_num_seqs, 16, 8),
    )  # fmt: skip
    return Engine(model, cfg)


def _record_logits(engine: Engine) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    forward = engine.model.forward

    def wrapped(batch, attn):
        out = forward(batch, attn)
        seen.append(out.clone())
        return out

    engine.model.forward = wrapped
    return seen


def test_engine_fused_matches_gather_on_a_tiny_random_model() -> None:
    """Greedy tokens identical and every step's logits within 1e-3 (fp32, ~70 decode steps with a
    short window so tokens cross the bf16 tail into FP2 pages and a second page)."""
    prompts = [[3, 17, 99, 5, 42, 7, 11, 64, 2, 90, 1, 2, 3, 4], [1, 2, 3], [9, 9, 9, 9, 120, 33]]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    spec = "fp2:sinks=2,tail=4,window=4"
    runs = {}
    for fused in (True, False):
        engine = _tiny_engine(spec, fused)
        assert isinstance(engine.attn.decode, Fp2FusedDecode) == fused
        logits = _record_logits(engine)
        runs[fused] = ([o.token_ids for o in engine.generate(prompts, params)], logits)
    (tok_f, log_f), (tok_g, log_g) = runs[True], runs[False]
    assert tok_f == tok_g
    assert len(log_f) == len(log_g)
    for a, b in zip(log_f, log_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_engine_fused_matches_gather_on_smollm2(capsys: pytest.CaptureFixture) -> None:
    from zerodram.runtime.engine.build import build_engine
    from zerodram.runtime.errors import ConfigError
    from zerodram.runtime.loading.checkpoint import ModelSpec, checkpoint_dir
    from zerodram.runtime.loading.tokenizer import Tokenizer

    try:
        tok = Tokenizer(checkpoint_dir(ModelSpec.parse("smollm2")))
    except ConfigError as err:
        pytest.skip(str(err))
    prompts = [tok.apply_chat([{"role": "user", "content": q}]) for q in SMOL_QUESTIONS]
    spec = "fp2:tail=1,window=7"  # FP2 pages from the prompt on, and a flush every decode step
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    got = {}
    for f in (True, False):
        engine = build_engine("smollm2", None, EngineConfig(kv_format=spec, num_kv_pages=16, fused_decode=f))
        assert isinstance(engine.attn.decode, Fp2FusedDecode) == f
        got[f] = [o.token_ids for o in engine.generate(prompts, params)]
    fused, gather = got[True], got[False]
    with capsys.disabled():
        for q, a, b in zip(SMOL_QUESTIONS, fused, gather, strict=True):
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
            print(f"\nfused vs gather FP2 decode, {q!r}: first divergence at {first}")
    assert fused == gather


def test_decode_scoring_runs_the_serving_path_and_the_e4m3_probe() -> None:
    """score_tokens(decode_from=1) scores through decode rows: on fp32 pages the same log-probs as
    prefilled chunks of one token (same attention, two code paths; 1e-4), and chunks followed by
    decode rows the same as chunks alone; on FP2 pages through the fused path, whose e4m3
    value-product emulation moves them (not identical; on this random model by ~0.05 nats on
    average, 0.1 allowed, what it costs a trained model is benchmarks/engine_kv_ppl.py's question).
    A value product that no path can honour is refused at construction."""
    from zerodram.runtime.engine.score import score_tokens
    from zerodram.runtime.errors import ConfigError

    ids = [int(x) for x in torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(5))]

    def engine(kv: str, vp: str = "exact") -> Engine:
        model = Transformer(TINY64, random_weights(TINY64, None, 0, seed=3, dtype=torch.float32))
        return Engine(model, EngineConfig(kv_format=kv, num_kv_pages=8, decode_value_product=vp))

    fp32 = engine("fp32")
    torch.testing.assert_close(
        score_tokens(fp32, ids, decode_from=1).logprobs, score_tokens(fp32, ids, chunk=1).logprobs, rtol=1e-4, atol=1e-4
    )
    # chunks, then decode rows from token 61 (how the needle benchmark scores an answer)
    mixed, chunks = score_tokens(fp32, ids, chunk=16, decode_from=61), score_tokens(fp32, ids, chunk=16)
    torch.testing.assert_close(mixed.logprobs, chunks.logprobs, rtol=1e-4, atol=1e-4)
    assert mixed.argmax.shape == (len(ids) - 1,) and float((mixed.argmax == chunks.argmax).float().mean()) > 0.95
    with pytest.raises(ConfigError, match="decode_from"):
        score_tokens(fp32, ids, decode_from=0)
    spec = "fp2:sinks=2,tail=1,window=8"
    exact, fp8 = engine(spec), engine(spec, "e4m3")
    assert isinstance(fp8.attn.decode, Fp2FusedDecode) and fp8.attn.decode.attn.value_product == "e4m3"
    a, b = score_tokens(exact, ids, decode_from=1).logprobs, score_tokens(fp8, ids, decode_from=1).logprobs
    assert not torch.equal(a, b) and float((a - b).abs().mean()) < 0.1, float((a - b).abs().mean())
    with pytest.raises(ConfigError, match="decode_value_product"):
        EngineConfig(decode_value_product="e5m2")
    with pytest.raises(ConfigError, match="fused FP2 decode"):
        engine("bf16", "e4m3")


def test_defer_write_config() -> None:
    """EngineConfig.defer_write: True, False or "auto" (the default); on CPU the fused path never
    defers the write (the write and the reference decode run apart), whatever was asked."""
    from zerodram.runtime.errors import ConfigError

    assert EngineConfig().defer_write == "auto" and EngineConfig(defer_write=False).defer_write is False
    with pytest.raises(ConfigError, match="defer_write"):
        EngineConfig(defer_write="always")
    kv = RuntimeKVPartition("fp2:tail=1,window=4", 1, 2, 64, 8, 32, torch.float32, torch.device("cpu"))
    for mode in (True, "auto"):
        fused = make_decode_attention(kv, num_q_heads=2, scale=0.125, max_batch=2, defer_write=mode)
        assert isinstance(fused, Fp2FusedDecode) and not fused.defers_write
    # a format the kernels cannot read keeps the gather path on CPU, where the option means nothing
    kv = RuntimeKVPartition("fp2:kblk=t32", 1, 2, 64, 8, 32, torch.float32, torch.device("cpu"))
    assert make_decode_attention(kv, num_q_heads=2, scale=0.125, max_batch=2, defer_write=True) is None


def test_static_metadata_holds_the_lengths_after_the_write() -> None:
    """`fill_static` uploads each row's FP2 range and bf16 count after the step's write, whether the
    step makes the write before the decode or after it (`defers_write`: the codes of the range's
    rows were written when they arrived, a window earlier), padding rows with one scratch-slot
    token, and returns the grid length (CPU: the host half alone)."""
    g = torch.Generator().manual_seed(3)
    kv = RuntimeKVPartition("fp2:sinks=4,tail=1,window=5", 2, 2, 64, 40, 32, torch.float32, torch.device("cpu"))
    lengths = (2, 9, 10, 40, 97)  # a sink row, the window full, flushing rows, a page boundary
    for sid, n in enumerate(lengths):
        kv.reserve(sid, n)
        for layer in range(2):
            kv.write(layer, sid, 0, torch.randn(n, 2, 64, generator=g), torch.randn(n, 2, 64, generator=g))
    fused = make_decode_attention(kv, num_q_heads=6, scale=0.125, max_batch=8, defer_write="auto")
    assert isinstance(fused, Fp2FusedDecode) and not fused.defers_write  # CPU: the write comes first
    rule, meta = fused.rule, fused.static_meta(8)
    after = [rule.num_quantized(n) for n in lengths]
    assert fused.fill_static(meta, tuple(range(len(lengths))), lengths) == fused.grid_len(max(after))
    assert meta.fp2_len.tolist() == [*after, 0, 0, 0]
    assert meta.hp_len.tolist() == [*(n - f for n, f in zip(lengths, after, strict=True)), 1, 1, 1]
