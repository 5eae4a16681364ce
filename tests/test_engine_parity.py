"""Greedy parity with Hugging Face transformers, one process, fp32 and BF16 KV pages: tiny random
Mixtral, Qwen2-MoE (with a gated shared expert) and Qwen3-MoE (q/k norms, head dim 16 != hidden /
heads, YaRN RoPE) checkpoints written in the test, and the
packaged SmolLM2 served as experts (dense-as-MoE).

The multi-rank versions (2 and 4 ranks) are in test_engine_multirank.py and reuse these helpers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine_support import MAX_TOKENS, PARITY_KV, PROMPTS, SMOL_QUESTIONS, engine_greedy

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


TINY = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "initializer_range": 0.15,
    "max_position_embeddings": 256,
}


TINY_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe")


def make_tiny_checkpoint(kind: str, path: Path) -> Path:
    """Save a tiny random `kind` ("mixtral" | "qwen2_moe" | "qwen3_moe") checkpoint (safetensors)
    to `path`."""
    torch.manual_seed(1234)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=4, **TINY)
        model = transformers.MixtralForCausalLM(cfg)
    elif kind == "qwen3_moe":  # q/k RMSNorm, an explicit head dim, renormalised top-k, YaRN RoPE
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4}
        cfg = transformers.Qwen3MoeConfig(
            num_experts=4,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            head_dim=16,
            rope_parameters=yarn,
            **TINY,
        )
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2MoeConfig(
            num_experts=4,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            norm_topk_prob=False,
            **TINY,
        )
        model = transformers.Qwen2MoeForCausalLM(cfg)
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy(path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
            )
            outs.append(ids[0, len(p) :].tolist())
    return outs


_CACHE: dict = {}


def tiny_references(root: Path) -> tuple[dict[str, Path], dict[str, list[list[int]]]]:
    """Tiny checkpoints and transformers' greedy tokens, made once per test session."""
    if "tiny" not in _CACHE:
        ckpts = {k: make_tiny_checkpoint(k, root / k) for k in TINY_KINDS}
        _CACHE["tiny"] = ckpts, {k: hf_greedy(p, PROMPTS, MAX_TOKENS) for k, p in ckpts.items()}
    return _CACHE["tiny"]


def smollm2_references(max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, transformers' greedy tokens) for the packaged SmolLM2, made once per session."""
    from zerodram.runtime.loading.checkpoint import ModelSpec, checkpoint_dir
    from zerodram.runtime.loading.tokenizer import Tokenizer

    if max_tokens not in _CACHE:
        try:
            ckpt = checkpoint_dir(ModelSpec.parse("smollm2"))
        except Exception as err:  # package missing
            pytest.skip(f"packaged model unavailable: {err}")
        tok = Tokenizer(ckpt)
        prompts = [tok.apply_chat([{"role": "user", "content": q}]) for q in SMOL_QUESTIONS]
        _CACHE[max_tokens] = prompts, hf_greedy(ckpt, prompts, max_tokens)
    return _CACHE[max_tokens]


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_references(tmp_path_factory.mktemp("tiny"))[0]


@pytest.mark.parametrize("kv", PARITY_KV)
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_moe_greedy_matches_transformers(tiny_ckpts: dict[str, Path], kind: str, kv: str) -> None:
    want = _CACHE["tiny"][1][kind]
    assert len({tuple(w) for w in want}) > 1
    assert any(len(set(w)) > 3 for w in want)
    got = engine_greedy(str(tiny_ckpts[kind]), None, PROMPTS, MAX_TOKENS, kv=kv)
    assert got == want


def test_tiny_moe_fp8_kv_runs(tiny_ckpts: dict[str, Path]) -> None:
    got = engine_greedy(str(tiny_ckpts["mixtral"]), None, PROMPTS, MAX_TOKENS, kv="fp8")
    assert [len(g) for g in got] == [MAX_TOKENS] * len(PROMPTS)


@pytest.mark.parametrize("kv", PARITY_KV)
def test_smollm2_as_experts_matches_transformers(kv: str) -> None:
    prompts, want = smollm2_references(6)
    assert engine_greedy("smollm2", None, prompts, 6, kv=kv, num_experts=4) == want


def test_dense_as_moe_reproduces_the_dense_model() -> None:
    """Slicing the FFN into E experts with top-E unit weights gives the dense model's logits."""
    from zerodram.runtime.engine.kv import TorchPagedKV
    from zerodram.runtime.loading.placement import expert_layout
    from zerodram.runtime.loading.random_init import random_weights
    from zerodram.runtime.model.attention import PagedAttention
    from zerodram.runtime.model.batch import ForwardBatch
    from zerodram.runtime.model.named import named_config
    from zerodram.runtime.model.transformer import Transformer

    dense = named_config("tiny-dense")
    w = random_weights(dense, None, 0, dtype=torch.float32)
    moe_cfg = dense.as_dense_moe(4)
    mw = {k: v for k, v in w.items() if ".ffn." not in k}
    F = moe_cfg.moe_intermediate_size
    for i in range(dense.num_layers):
        p = f"layers.{i}."
        mw[p + "experts.gate"] = w[p + "ffn.gate"].view(4, F, -1)
        mw[p + "experts.up"] = w[p + "ffn.up"].view(4, F, -1)
        mw[p + "experts.down"] = torch.stack(w[p + "ffn.down"].split(F, dim=1))
        mw[p + "experts.ids"] = torch.arange(4)
    assert expert_layout(4, 2).local_experts(1) == (2, 3)
    logits = []
    for cfg, weights in ((dense, w), (moe_cfg, mw)):
        kv = TorchPagedKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, 8, "fp32")
        kv.reserve(0, 12)
        batch = ForwardBatch.build([], [(0, 0, list(range(5, 17)))], [True], torch.device("cpu"))
        logits.append(Transformer(cfg, weights).forward(batch, PagedAttention(kv, cfg.head_dim**-0.5)))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_the_fused_expert_layout_serves_as_the_per_expert_one(tiny_ckpts: dict[str, Path], tmp_path: Path) -> None:
    """transformers 5's own tensors (`mlp.experts.gate_up_proj` [E, 2M, D], `down_proj` [E, D, M]),
    written from `state_dict()` rather than `save_pretrained`'s per-expert ones, pass the loader's
    shape checks and serve transformers' greedy tokens."""
    import shutil

    from safetensors.torch import save_file

    src = tiny_ckpts["qwen3_moe"]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in tensors), sorted(tensors)[:8]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    got = engine_greedy(str(tmp_path), None, PROMPTS, MAX_TOKENS, kv=PARITY_KV[0])
    assert got == _CACHE["tiny"][1]["qwen3_moe"]
