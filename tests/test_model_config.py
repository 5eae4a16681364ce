"""ModelConfig: parsing HF configs, named configs, parameter counts (no allocation), RoPE scaling."""

from __future__ import annotations

import pytest
import torch

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.model.config import ModelConfig, RopeScaling
from zerodram.runtime.model.named import NAMED_CONFIGS, named_config
from zerodram.runtime.model.rope import inv_frequencies


def test_seed_700b_param_count() -> None:
    cfg = named_config("seed-700b")
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (8192, 64, 8, 128)
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.num_layers) == (
        32,
        16384,
        2,
        54,
    )
    total, active = cfg.param_counts()
    # per layer: attention 2*8192*8192 + 2*8192*1024, experts 32 * 3*8192*16384, router 8192*32
    per_layer = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 32 * 3 * 8192 * 16384 + 8192 * 32 + 2 * 8192
    assert total == 54 * per_layer + 2 * 32000 * 8192 + 8192
    assert 700e9 < total < 706e9  # ≈ 703B
    assert 51e9 < active < 53e9  # ≈ 52B


@pytest.mark.parametrize(
    ("name", "total_b", "active_b"), [("mixtral-8x7b", 46.7, 12.9), ("qwen3-30b-a3b", 30.5, 3.3)]
)
def test_named_counts_match_the_published_models(name: str, total_b: float, active_b: float) -> None:
    total, active = named_config(name).param_counts()
    assert total / 1e9 == pytest.approx(total_b, rel=0.02)
    assert active / 1e9 == pytest.approx(active_b, rel=0.05)


def test_every_named_config_is_valid_and_unknown_names_list_them() -> None:
    for cfg in NAMED_CONFIGS.values():
        total, active = cfg.param_counts()
        if cfg.router_kind == "dense_slices":  # a dense FFN served as experts: every slice is active
            assert total == active
        else:
            assert total > active or not cfg.is_moe
    with pytest.raises(ConfigError, match="seed-700b"):
        named_config("nope")


def test_dense_as_moe_slices_the_ffn() -> None:
    cfg = named_config("tiny-dense")
    moe = cfg.as_dense_moe(4)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 4, 32)
    assert moe.router_kind == "dense_slices"
    assert moe.param_counts() == cfg.param_counts()
    with pytest.raises(ConfigError, match="does not split"):
        cfg.as_dense_moe(5)
    again = moe.as_dense_moe(2)  # a dense-sliced config is cut again from the whole FFN
    assert (again.num_experts, again.moe_intermediate_size) == (2, 64)
    assert again.param_counts() == cfg.param_counts()
    with pytest.raises(ConfigError, match="already an MoE"):
        named_config("tiny-moe").as_dense_moe(2)


def test_parse_hf_configs_v4_and_v5_spellings() -> None:
    base = {
        "vocab_size": 100,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "hidden_act": "silu",
    }
    v5 = ModelConfig.from_hf_dict(
        {
            **base,
            "model_type": "qwen2_moe",
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24,
            "norm_topk_prob": False,
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
        }
    )
    assert v5.shared_expert_gate
    assert v5.attention_bias
    assert not v5.norm_topk_prob
    assert v5.rope_theta == 5e5
    assert v5.rope_scaling == RopeScaling("linear", 2.0)
    v4 = ModelConfig.from_hf_dict(
        {
            **base,
            "model_type": "llama",
            "rope_theta": 5e5,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert v4.rope_scaling.kind == "llama3"
    assert not v4.is_moe
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_hf_dict({**base, "model_type": "gpt2"})
    with pytest.raises(ConfigError, match="rope type"):
        ModelConfig.from_hf_dict(
            {**base, "model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}
        )


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_theta": 500000.0,
        },
        # Qwen3 long context: yarn 4x over 32k, attention factor from the factor
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6},
        # DeepSeek-V3 style: mscale ratio, beta bounds, no truncation
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
            "truncate": False,
            "rope_theta": 10000.0,
        },
        # an explicit attention factor
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 65536,
            "attention_factor": 1.3,
            "rope_theta": 10000.0,
        },
    ],
)
def test_rope_frequencies_match_transformers(params: dict) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from zerodram.runtime.model.rope import Rope

    hf_cfg = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=2, max_position_embeddings=131072, rope_parameters=dict(params)
    )
    ours = ModelConfig.from_hf_dict({**hf_cfg.to_dict(), "model_type": "llama"})
    got = inv_frequencies(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    want_scale = 1.0
    if params["rope_type"] == "default":
        want = 1.0 / (params["rope_theta"] ** (torch.arange(0, 128, 2).float() / 128))
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_cfg, "cpu")
    torch.testing.assert_close(got, want.float(), rtol=0, atol=0)
    rope = Rope(ours.head_dim, ours.rope_theta, ours.rope_scaling, torch.device("cpu"))
    assert rope.scale == pytest.approx(want_scale, rel=1e-12)
    cos, _ = rope.cos_sin(torch.tensor([0, 70000]), torch.float32)
    assert float(cos[0].max()) == pytest.approx(want_scale)  # cos(0) = 1, times the factor


def test_smollm2_shaped_config_has_smollm2s_parameter_count() -> None:
    """random:smollm2-135m stands in for the packaged model in engine benchmarks: same shapes (the
    published 134.5M parameters), its FFN served as one expert like the packaged model."""
    from zerodram.runtime.model.named import named_config

    cfg = named_config("smollm2-135m")
    assert cfg.param_counts() == (134_515_008, 134_515_008)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.router_kind) == (1, 1, "dense_slices")


_LLAMA = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
}


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"hidden_size": None}, "field 'hidden_size': is missing"),
        ({"hidden_size": "thirty-two"}, "field 'hidden_size': must be an integer, got \"thirty-two\""),
        ({"hidden_size": 32.7}, "field 'hidden_size': must be an integer, got 32.7"),
        ({"num_hidden_layers": True}, "field 'num_hidden_layers': must be an integer, got true"),
        ({"num_attention_heads": 0}, "field 'num_attention_heads': num_heads must be > 0"),
        ({"num_key_value_heads": 3}, "not a multiple of num_kv_heads=3"),
        ({"intermediate_size": None}, "field 'intermediate_size': .*dense layers"),
        ({"tie_word_embeddings": "false"}, "field 'tie_word_embeddings': must be a boolean"),
        ({"eos_token_id": ["a"]}, "field 'eos_token_id': must be an integer or a list of integers"),
        ({"rope_scaling": 2.0}, "field 'rope_scaling': must be a JSON object or null, got 2.0"),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": "x"}},
            "field 'rope_scaling.factor': must be a number",
        ),
        ({"rope_scaling": {"rope_type": "linear"}}, "field 'rope_scaling.factor': is missing"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "factor must be > 0"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method 'awq'"),
        ({"mlp_bias": True}, "field 'mlp_bias': biases on the MLP"),
        ({"attention_bias": True}, "field 'attention_bias'"),
    ],
)
def test_bad_hf_configs_name_the_file_and_field(edit: dict, match: str) -> None:
    """config.json is parsed with strict JSON types (no int("32.7"), no bool("false")); every
    refusal, those of ModelConfig's own checks included, names the file and the field."""
    with pytest.raises(ConfigError, match=match) as err:
        ModelConfig.from_hf_dict({**_LLAMA, **edit}, source="ckpt/config.json")
    assert str(err.value).startswith("ckpt/config.json: ")


def test_a_config_that_is_not_a_json_object_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^ckpt/config\.json: must be a JSON object, got list"):
        ModelConfig.from_hf_dict([1, 2], source="ckpt/config.json")
    ok = ModelConfig.from_hf_dict(
        {**_LLAMA, "head_dim": None, "eos_token_id": [1, 2], "tie_word_embeddings": True}
    )
    assert (ok.head_dim, ok.eos_token_ids, ok.tie_word_embeddings) == (8, (1, 2), True)
