"""Build one rank's canonical weights from a checkpoint's tensors (Hugging Face names).

Replicated on every rank: embeddings, LM head, norms, attention, routers, shared experts and dense
FFNs. Sharded: routed experts, read only for the rank's `ExpertPlacement.local_experts(rank)`.

Expert layouts understood (per MoE layer, prefix `model.layers.{i}.`):
    block_sparse_moe.experts.{e}.w1 / w3 / w2      Mixtral (gate / up / down), one tensor per expert
    mlp.experts.{e}.gate_proj / up_proj / down_proj  Qwen-MoE, one tensor per expert
    mlp.experts.gate_up_proj [E, 2F, D], mlp.experts.down_proj [E, D, F]   transformers 5 fused
A dense checkpoint served as MoE (`config.router_kind == "dense_slices"`) reads expert e of layer
i as rows [e*F/E, (e+1)*F/E) of mlp.gate_proj / up_proj and the same columns of mlp.down_proj.
"""

from __future__ import annotations

import torch

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.loading.placement import ExpertPlacement
from zerodram.runtime.loading.sources import TensorSource
from zerodram.runtime.model.config import ModelConfig

_ATTN = {
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "attn_norm": "input_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
}
_OPTIONAL = {
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}
_DENSE = {
    "ffn.gate": "mlp.gate_proj.weight",
    "ffn.up": "mlp.up_proj.weight",
    "ffn.down": "mlp.down_proj.weight",
}
_SHARED = {
    "shared.gate": "mlp.shared_expert.gate_proj.weight",
    "shared.up": "mlp.shared_expert.up_proj.weight",
    "shared.down": "mlp.shared_expert.down_proj.weight",
    "shared.sigmoid_gate": "mlp.shared_expert_gate.weight",
}
_PER_EXPERT = (
    (
        "block_sparse_moe.experts.{e}.w1.weight",
        "block_sparse_moe.experts.{e}.w3.weight",
        "block_sparse_moe.experts.{e}.w2.weight",
    ),
    (
        "mlp.experts.{e}.gate_proj.weight",
        "mlp.experts.{e}.up_proj.weight",
        "mlp.experts.{e}.down_proj.weight",
    ),
)


def load_model_weights(
    source: TensorSource,
    config: ModelConfig,
    placement: ExpertPlacement | None,
    rank: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """One rank's weights in canonical names (see `zerodram.runtime.model.transformer`).

    Args:
        source: the checkpoint's tensors by Hugging Face name.
        config: the parsed config (`as_dense_moe(E)` to serve a dense checkpoint as E experts).
        placement: expert placement (None: this rank hosts every expert).
        rank: this rank.

    Raises:
        ConfigError: a tensor is missing or the checkpoint's expert layout is unknown.
    """

    def get(name: str, dim0: slice | list[int] | None = None, dim1: slice | None = None) -> torch.Tensor:
        if not source.has(name):
            raise ConfigError(f"checkpoint has no tensor {name!r} (needed by {config.arch})")
        return source.read(name, dim0, dim1).to(device=device, dtype=dtype).contiguous()

    w: dict[str, torch.Tensor] = {
        "embed": get("model.embed_tokens.weight"),
        "final_norm": get("model.norm.weight"),
    }
    if not config.tie_word_embeddings:
        w["lm_head"] = get("lm_head.weight") if source.has("lm_head.weight") else w["embed"]
    local = placement.local_experts(rank) if placement is not None else tuple(range(config.num_experts))
    for i in range(config.num_layers):
        p, c = f"layers.{i}.", f"model.layers.{i}."
        for ours, theirs in _ATTN.items():
            w[p + ours] = get(c + theirs)
        for ours, theirs in _OPTIONAL.items():
            if source.has(c + theirs):
                w[p + ours] = get(c + theirs)
        if not config.is_moe_layer(i):
            for ours, theirs in _DENSE.items():
                w[p + ours] = get(c + theirs)
            continue
        if config.router_kind == "softmax_topk":
            router = c + (
                "block_sparse_moe.gate.weight"
                if source.has(c + "block_sparse_moe.gate.weight")
                else "mlp.gate.weight"
            )
            w[p + "router"] = get(router)
        if config.shared_expert_intermediate_size:
            for ours, theirs in _SHARED.items():
                if ours != "shared.sigmoid_gate" or config.shared_expert_gate:
                    w[p + ours] = get(c + theirs)
        gate, up, down = _read_experts(get, source, config, c, list(local), dtype, device)
        w[p + "experts.gate"], w[p + "experts.up"], w[p + "experts.down"] = gate, up, down
        w[p + "experts.ids"] = torch.tensor(local, dtype=torch.int64)
    return w


def _read_experts(get, source: TensorSource, config: ModelConfig, c: str, local: list[int], dtype, device):
    """(gate [El, F, D], up [El, F, D], down [El, D, F]) of the local experts of one layer."""
    F, D = config.moe_intermediate_size, config.hidden_size
    if not local:
        empty = torch.empty(0, F, D, dtype=dtype, device=device)
        return empty, empty.clone(), torch.empty(0, D, F, dtype=dtype, device=device)
    if config.router_kind == "dense_slices":
        rows = [slice(e * F, (e + 1) * F) for e in local]
        gate = torch.stack([get(c + "mlp.gate_proj.weight", r) for r in rows])
        up = torch.stack([get(c + "mlp.up_proj.weight", r) for r in rows])
        down = torch.stack([get(c + "mlp.down_proj.weight", None, r) for r in rows])
        return gate, up, down
    for g, u, d in _PER_EXPERT:
        if source.has(c + g.format(e=local[0])):
            gate = torch.stack([get(c + g.format(e=e)) for e in local])
            up = torch.stack([get(c + u.format(e=e)) for e in local])
            down = torch.stack([get(c + d.format(e=e)) for e in local])
            return gate, up, down
    fused = c + "mlp.experts.gate_up_proj"
    if source.has(fused):
        gate_up = get(fused, local)  # [El, 2F, D]
        return (
            gate_up[:, :F].contiguous(),
            gate_up[:, F:].contiguous(),
            get(c + "mlp.experts.down_proj", local),
        )
    raise ConfigError(f"no routed-expert tensors found under {c!r} (unknown expert layout)")
