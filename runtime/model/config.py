"""`ModelConfig`: every shape and switch the transformer needs, parsed once at the edge.

A config comes from a Hugging Face `config.json` (`ModelConfig.from_hf_dict`), from a GGUF header
(`zerodram.runtime.loading.gguf_file`), or from a named random configuration
(`zerodram.runtime.model.named`). Nothing past this module sees a raw dict.

Families covered: Llama-style dense models (llama, mistral, qwen2, qwen3 without MoE), Mixtral
(softmax top-k, renormalised), Qwen2-MoE (optional renormalisation `norm_topk_prob`, shared expert
with a sigmoid gate, q/k/v biases), Qwen3-MoE (per-head q/k RMSNorm) and DeepSeek-V3-like shapes
without MLA (dense first layers, one ungated shared expert).

A dense model can be served as MoE (`as_dense_moe(num_experts)`): each FFN's intermediate dim is
sliced into E experts, every token routed to all E with unit weights ("dense slices" router),
which reproduces the dense model exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from zerodram.runtime.errors import ConfigError

ROPE_KINDS = ("default", "linear", "llama3", "yarn")
ROUTER_KINDS = ("softmax_topk", "dense_slices")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as the checkpoint states it.

    kind: "default" (none), "linear" (positions divided by `factor`), "llama3" (low frequencies
    divided by `factor`, a smooth ramp between `low_freq_factor` and `high_freq_factor`) or "yarn"
    (frequencies below `beta_slow` rotations over the original context interpolated by `factor`,
    above `beta_fast` kept, a linear ramp between; cos/sin scaled by `attention_factor`, which
    defaults to YaRN's 0.1 ln(factor) + 1, or its mscale / mscale_all_dim ratio when both are set).
    """

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ConfigError(f"rope scaling {self.kind!r} not supported (supported: {ROPE_KINDS})")
        if self.factor <= 0:
            raise ConfigError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and switches of one decoder-only transformer (dense or MoE).

    Dense layers use `intermediate_size`; MoE layers have `num_experts` SwiGLU experts of
    `moe_intermediate_size`, `num_experts_per_tok` chosen per token, plus an optional shared
    expert of `shared_expert_intermediate_size` (gated by a sigmoid of a [D, 1] projection when
    `shared_expert_gate`). A layer is MoE when `num_experts > 0`, its index is at least
    `first_dense_layers`, and `(idx + 1) % moe_layer_step == 0` (Qwen's decoder_sparse_step).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    router_kind: str = "softmax_topk"
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    first_dense_layers: int = 0
    moe_layer_step: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    attention_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}", field=name)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.router_kind not in ROUTER_KINDS:
            raise ConfigError(f"router_kind {self.router_kind!r} not in {ROUTER_KINDS}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..{self.num_experts}"
                )
            if self.moe_intermediate_size <= 0:
                raise ConfigError("an MoE config needs moe_intermediate_size > 0")
            if self.router_kind == "dense_slices" and self.num_experts_per_tok != self.num_experts:
                raise ConfigError("the dense-slices router routes every token to all experts")
        if self.moe_layer_step < 1:
            raise ConfigError(f"moe_layer_step must be >= 1, got {self.moe_layer_step}")
        if self.intermediate_size <= 0 and not all(map(self.is_moe_layer, range(self.num_layers))):
            raise ConfigError(
                f"intermediate_size must be > 0 (the model has dense layers), got {self.intermediate_size}",
                field="intermediate_size",
            )

    # --- derived ---------------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.num_experts > 0
            and layer_idx >= self.first_dense_layers
            and (layer_idx + 1) % self.moe_layer_step == 0
        )

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def as_dense_moe(self, num_experts: int) -> ModelConfig:
        """This dense config served as MoE: the FFN intermediate dim cut into `num_experts` slices
        (a config already served that way is cut again).

        Raises:
            ConfigError: a real MoE model, or the intermediate size does not divide by `num_experts`.
        """
        if self.is_moe and self.router_kind != "dense_slices":
            raise ConfigError(f"{self.arch} is already an MoE model")
        if num_experts < 1 or self.intermediate_size % num_experts:
            raise ConfigError(
                f"intermediate_size={self.intermediate_size} does not split into {num_experts} experts"
            )
        return replace(
            self,
            num_experts=num_experts,
            num_experts_per_tok=num_experts,
            moe_intermediate_size=self.intermediate_size // num_experts,
            router_kind="dense_slices",
        )

    # --- parameter counts (no allocation) --------------------------------------------------

    def _attn_params(self) -> int:
        D = self.hidden_size
        n = D * self.q_size + 2 * D * self.kv_size + self.q_size * D
        if self.attention_bias:
            n += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            n += 2 * self.head_dim
        return n + 2 * D  # two RMSNorm weights per layer

    def _shared_params(self) -> int:
        D = self.hidden_size
        n = 3 * D * self.shared_expert_intermediate_size
        return n + (D if self.shared_expert_gate and self.shared_expert_intermediate_size else 0)

    def param_counts(self) -> tuple[int, int]:
        """(total, active per token) parameters, embeddings and LM head included."""
        D = self.hidden_size
        embed = self.vocab_size * D * (1 if self.tie_word_embeddings else 2) + D
        total = active = embed
        for i in range(self.num_layers):
            attn = self._attn_params()
            total += attn
            active += attn
            if self.is_moe_layer(i):
                expert = 3 * D * self.moe_intermediate_size
                router = D * self.num_experts if self.router_kind == "softmax_topk" else 0
                total += self.num_experts * expert + router + self._shared_params()
                active += self.num_experts_per_tok * expert + router + self._shared_params()
            else:
                dense = 3 * D * self.intermediate_size
                total += dense
                active += dense
        return total, active

    # --- parsing ---------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, cfg: Any, *, source: str = "config.json") -> ModelConfig:
        """Parse a Hugging Face `config.json` (transformers 4.x or 5.x spelling).

        Raises:
            ConfigError (naming `source` and the field): not a JSON object, a missing or mistyped
                field, unknown model type, or a feature this runtime does not implement.
        """
        try:
            return cls(**_hf_fields(cfg))
        except ConfigError as err:
            if err.path is not None:
                raise
            raise ConfigError(err.message, path=source, field=_HF_NAMES.get(err.field, err.field)) from None


# ModelConfig's field names that config.json spells otherwise, for errors found past parsing
_HF_NAMES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
}
_HF_TYPES = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"}
_REQUIRED = object()
_JSON_TYPES = {int: "an integer", float: "a number", bool: "a boolean (true / false)", str: "a string"}


def _get(d: dict[str, Any], key: str, kind: type, default: Any = _REQUIRED, *, within: str = "") -> Any:
    """`d[key]` checked to be of JSON type `kind`; absent or null gives `default` (an error when
    required). Types are strict: `bool("false")` is True and `int(32.7)` is 32, so no coercion,
    and JSON's true / false (Python ints) are booleans only."""
    value = d.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ConfigError("is missing (required)", field=within + key)
        return default
    ok = isinstance(value, (int, float) if kind is float else kind)
    if not ok or (isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"must be {_JSON_TYPES[kind]}, got {json.dumps(value)}", field=within + key)
    return float(value) if kind is float else value


def _hf_fields(cfg: Any) -> dict[str, Any]:
    """`ModelConfig` keyword arguments from a parsed config.json (errors carry no path)."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"must be a JSON object, got {type(cfg).__name__}")
    model_type = _get(cfg, "model_type", str, "")
    if model_type not in _HF_TYPES:
        raise ConfigError(f"model_type {model_type!r} not supported (supported: {sorted(_HF_TYPES)})")
    quant = cfg.get("quantization_config")
    if quant is not None:  # their weights need scales this loader does not read
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ConfigError(
            f"quantized checkpoints (quant_method {method!r}) are not supported; use float32 / float16 / "
            "bfloat16 weights, or a GGUF file",
            field="quantization_config",
        )
    act = _get(cfg, "hidden_act", str, "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} not supported (SwiGLU needs silu)")
    if _get(cfg, "mlp_bias", bool, False):
        raise ConfigError("biases on the MLP projections are not supported", field="mlp_bias")
    # Qwen2's q/k/v biases are implied by its model type; elsewhere attention_bias adds o_proj's too
    if model_type not in ("qwen2", "qwen2_moe") and _get(cfg, "attention_bias", bool, False):
        raise ConfigError("biases on the attention projections are not supported", field="attention_bias")
    D = _get(cfg, "hidden_size", int)
    H = _get(cfg, "num_attention_heads", int)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_ids):
        raise ConfigError(
            f"must be an integer or a list of integers, got {json.dumps(eos)}", field="eos_token_id"
        )
    kw: dict[str, Any] = {
        "arch": model_type,
        "vocab_size": _get(cfg, "vocab_size", int),
        "hidden_size": D,
        "num_layers": _get(cfg, "num_hidden_layers", int),
        "num_heads": H,
        "num_kv_heads": _get(cfg, "num_key_value_heads", int, H),
        "head_dim": _get(cfg, "head_dim", int, D // H if H else 0),  # zero heads: refused by ModelConfig
        "intermediate_size": _get(cfg, "intermediate_size", int, 0),
        "rms_norm_eps": _get(cfg, "rms_norm_eps", float, 1e-6),
        "tie_word_embeddings": _get(cfg, "tie_word_embeddings", bool, False),
        "max_position_embeddings": _get(cfg, "max_position_embeddings", int, 4096),
        "bos_token_id": _get(cfg, "bos_token_id", int, None),
        "eos_token_ids": eos_ids,
    }
    kw["rope_theta"], kw["rope_scaling"] = _parse_rope(cfg)
    if model_type == "mixtral":
        kw.update(
            num_experts=_get(cfg, "num_local_experts", int),
            num_experts_per_tok=_get(cfg, "num_experts_per_tok", int),
            moe_intermediate_size=kw["intermediate_size"],
            norm_topk_prob=True,
        )
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        if cfg.get("mlp_only_layers"):
            raise ConfigError("mlp_only_layers is not supported", field="mlp_only_layers")
        kw.update(
            num_experts=_get(cfg, "num_experts", int, 0) or _get(cfg, "num_local_experts", int),
            num_experts_per_tok=_get(cfg, "num_experts_per_tok", int),
            moe_intermediate_size=_get(cfg, "moe_intermediate_size", int),
            norm_topk_prob=_get(cfg, "norm_topk_prob", bool, False),
            moe_layer_step=_get(cfg, "decoder_sparse_step", int, 1),
        )
        if model_type == "qwen2_moe":
            kw["attention_bias"] = _get(cfg, "qkv_bias", bool, True)
            kw["shared_expert_intermediate_size"] = _get(cfg, "shared_expert_intermediate_size", int, 0)
            kw["shared_expert_gate"] = kw["shared_expert_intermediate_size"] > 0
    if model_type in ("qwen3", "qwen3_moe"):
        kw["qk_norm"] = True
    if model_type == "qwen2":
        kw["attention_bias"] = True
    sliding = _get(cfg, "use_sliding_window", bool, model_type == "mistral")
    if sliding and _get(cfg, "sliding_window", int, None):
        raise ConfigError("sliding-window attention is not supported", field="sliding_window")
    return kw


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling]:
    merged: dict[str, Any] = {}
    within: dict[str, str] = {}  # which section each key came from, for errors
    for section in ("rope_scaling", "rope_parameters"):  # transformers 5's rope_parameters wins
        values = cfg.get(section)
        if values is not None and not isinstance(values, dict):
            raise ConfigError(f"must be a JSON object or null, got {json.dumps(values)}", field=section)
        merged.update(values or {})
        within.update(dict.fromkeys(values or {}, section + "."))

    # the section a missing key belongs to
    absent = "rope_parameters." if cfg.get("rope_parameters") is not None else "rope_scaling."

    def get(key: str, kind: type, default: Any = _REQUIRED) -> Any:
        return _get(merged, key, kind, default, within=within.get(key, absent))

    theta = get("rope_theta", float, None)
    theta = _get(cfg, "rope_theta", float, 10000.0) if theta is None else theta
    kind = get("rope_type", str, None) or get("type", str, "default")
    if kind not in ROPE_KINDS:
        raise ConfigError(f"rope type {kind!r} not supported (supported: {ROPE_KINDS})")
    if kind == "default":
        return theta, RopeScaling()
    max_positions = _get(cfg, "max_position_embeddings", int, 8192)
    llama3 = kind == "llama3"  # transformers requires all of llama3's parameters
    original = get("original_max_position_embeddings", int, _REQUIRED if llama3 else max_positions)
    if original <= 0:
        raise ConfigError(f"original_max_position_embeddings must be > 0, got {original}")
    # DeepSeek-V3 style YaRN may leave out the factor: the ratio of the two context lengths
    factor = get("factor", float, max_positions / original if kind == "yarn" else _REQUIRED)
    return theta, RopeScaling(
        kind=kind,
        factor=factor,
        low_freq_factor=get("low_freq_factor", float, _REQUIRED if llama3 else 1.0),
        high_freq_factor=get("high_freq_factor", float, _REQUIRED if llama3 else 4.0),
        original_max_position_embeddings=original,
        beta_fast=get("beta_fast", float, 32.0),
        beta_slow=get("beta_slow", float, 1.0),
        truncate=get("truncate", bool, True),
        **{k: get(k, float, None) for k in ("attention_factor", "mscale", "mscale_all_dim")},
    )
