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
    def from_hf_dict(cls, cfg: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Parse a Hugging Face `config.json` (transformers 4.x or 5.x spelling).

        Raises:
            ConfigError: unknown model type, or a feature this runtime does not implement.
        """
        model_type = cfg.get("model_type", "")
        if model_type not in _HF_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} not supported (supported: {sorted(_HF_TYPES)})", path=source
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} not supported (SwiGLU needs silu)", path=source)
        D = int(cfg["hidden_size"])
        H = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or D // H
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        kw: dict[str, Any] = {
            "arch": model_type,
            "vocab_size": int(cfg["vocab_size"]),
            "hidden_size": D,
            "num_layers": int(cfg["num_hidden_layers"]),
            "num_heads": H,
            "num_kv_heads": int(cfg.get("num_key_value_heads") or H),
            "head_dim": int(head_dim),
            "intermediate_size": int(cfg.get("intermediate_size") or 0),
            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "max_position_embeddings": int(cfg.get("max_position_embeddings", 4096)),
            "bos_token_id": cfg.get("bos_token_id"),
            "eos_token_ids": eos_ids,
            "attention_bias": bool(cfg.get("attention_bias", False)),
        }
        kw["rope_theta"], kw["rope_scaling"] = _parse_rope(cfg, source)
        if model_type == "mixtral":
            kw.update(
                num_experts=int(cfg["num_local_experts"]),
                num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=kw["intermediate_size"],
                norm_topk_prob=True,
            )
        elif model_type in ("qwen2_moe", "qwen3_moe"):
            if cfg.get("mlp_only_layers"):
                raise ConfigError("mlp_only_layers is not supported", path=source)
            kw.update(
                num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts")),
                num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                moe_layer_step=int(cfg.get("decoder_sparse_step", 1)),
            )
            if model_type == "qwen2_moe":
                kw["attention_bias"] = bool(cfg.get("qkv_bias", True))
                kw["shared_expert_intermediate_size"] = int(cfg.get("shared_expert_intermediate_size", 0))
                kw["shared_expert_gate"] = kw["shared_expert_intermediate_size"] > 0
        if model_type in ("qwen3", "qwen3_moe"):
            kw["qk_norm"] = True
        if model_type == "qwen2":
            kw["attention_bias"] = True
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", model_type == "mistral"):
            raise ConfigError("sliding-window attention is not supported", path=source)
        return cls(**kw)


_HF_TYPES = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"}


def _parse_rope(cfg: dict[str, Any], source: str) -> tuple[float, RopeScaling]:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise ConfigError(f"rope type {kind!r} not supported (supported: {ROPE_KINDS})", path=source)
    if kind == "default":
        return theta, RopeScaling()
    original = int(merged.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192)))
    factor = merged.get("factor")
    if factor is None and kind == "yarn":  # DeepSeek-V3 style: the ratio of the two context lengths
        factor = cfg.get("max_position_embeddings", original) / original
    optional = {k: merged.get(k) for k in ("attention_factor", "mscale", "mscale_all_dim")}
    return theta, RopeScaling(
        kind=kind,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        truncate=bool(merged.get("truncate", True)),
        **{k: None if v is None else float(v) for k, v in optional.items()},
    )
