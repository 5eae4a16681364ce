"""Named model configurations for random-weight runs (benchmarks, tests, the dashboard).

    seed-700b          the article's model: hidden 8192, 64 query / 8 KV heads of 128, 54 layers,
                       32 experts of FFN 16384, top-2  (~704B total, ~52B active)
    mixtral-8x7b       Mixtral-8x7B's shapes                          (~46.7B total, ~12.9B active)
    qwen3-30b-a3b      Qwen3-30B-A3B's shapes (q/k norm, 128 experts, top-8, renormalised)
    deepseek-v3-nomla  DeepSeek-V3's MoE shapes with plain GQA attention instead of MLA (8 KV heads
                       of 128), 3 dense layers first, 256 routed experts of 2048 + 1 shared, top-8;
                       its sigmoid/grouped router is approximated by softmax top-8, renormalised
    tiny-moe, tiny-qwen-moe, tiny-dense
                       small shapes for tests and CPU smoke runs
    tiny-moe-wide      tiny-moe at hidden 128: the smallest that the fp8 EP wire's 128-channel
                       scale groups divide (`--ep-wire fp8`)
    smollm2-135m       SmolLM2-135M's shapes, its FFN as one expert (the packaged model's form)

Weights are created by `zerodram.runtime.loading.random_init` (each rank allocates only its own
experts), so a 700B config can be built on one GPU when the expert shard fits.
"""

from __future__ import annotations

from dataclasses import replace

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.model.config import ModelConfig

_TINY_MOE = ModelConfig(
    arch="mixtral",
    vocab_size=256,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=96,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=96,
    norm_topk_prob=True,
    max_position_embeddings=512,
)

NAMED_CONFIGS: dict[str, ModelConfig] = {
    "seed-700b": ModelConfig(
        arch="seed",
        vocab_size=32000,
        hidden_size=8192,
        num_layers=54,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=16384,
        num_experts=32,
        num_experts_per_tok=2,
        moe_intermediate_size=16384,
        norm_topk_prob=True,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        max_position_embeddings=131072,
    ),
    "mixtral-8x7b": ModelConfig(
        arch="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=14336,
        norm_topk_prob=True,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        max_position_embeddings=32768,
    ),
    "qwen3-30b-a3b": ModelConfig(
        arch="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=6144,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        qk_norm=True,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
    ),
    "deepseek-v3-nomla": ModelConfig(
        arch="deepseek_v3_nomla",
        vocab_size=129280,
        hidden_size=7168,
        num_layers=61,
        num_heads=128,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=18432,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        norm_topk_prob=True,
        shared_expert_intermediate_size=2048,
        shared_expert_gate=False,
        first_dense_layers=3,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=163840,
    ),
    "tiny-moe": _TINY_MOE,
    # hidden 128: the smallest that the fp8 EP wire's 128-channel scale groups divide
    "tiny-moe-wide": replace(_TINY_MOE, hidden_size=128, head_dim=32),
    "tiny-qwen-moe": ModelConfig(
        arch="qwen2_moe",
        vocab_size=256,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=False,
        shared_expert_intermediate_size=64,
        shared_expert_gate=True,
        attention_bias=True,
        max_position_embeddings=512,
    ),
    "tiny-dense": ModelConfig(
        arch="llama",
        vocab_size=256,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=512,
    ),
    # SmolLM2-135M's shapes served as MoE the way the packaged model is (its dense FFN as 1 expert):
    # the engine benchmarks' model where the packaged weights are not installed (same work per step)
    "smollm2-135m": ModelConfig(
        arch="llama",
        vocab_size=49152,
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ).as_dense_moe(1),
}


def named_config(name: str) -> ModelConfig:
    """The named configuration; raises `ConfigError` listing the names when unknown."""
    try:
        return NAMED_CONFIGS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model config {name!r}; named configs: {', '.join(NAMED_CONFIGS)}"
        ) from None
