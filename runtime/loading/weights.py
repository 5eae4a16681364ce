"""Build one rank's canonical weights from a checkpoint's tensors (Hugging Face names).

Replicated on every rank: embeddings, LM head, norms, attention, routers, shared experts and dense
FFNs. Sharded: routed experts, read only for the rank's `ExpertLayout.local_experts(rank)`.

Expert layouts understood (per MoE layer, prefix `model.layers.{i}.`):
    block_sparse_moe.experts.{e}.w1 / w3 / w2      Mixtral (gate / up / down), one tensor per expert
    mlp.experts.{e}.gate_proj / up_proj / down_proj  Qwen-MoE, one tensor per expert
    mlp.experts.gate_up_proj [E, 2M, D], mlp.experts.down_proj [E, D, M]   transformers 5 fused
A dense checkpoint served as MoE (`config.router_kind == "dense_slices"`) reads expert e of layer
i as rows [e*M, (e+1)*M) (M = F/E) of mlp.gate_proj / up_proj and the same columns of mlp.down_proj.

Every tensor is taken through one function that checks its whole shape against the config's, in
the letters of this legend: V vocab, D hidden, Q query heads x head dim, K kv heads x head dim,
H head dim, F dense FFN width, M expert width, G 2M (gate and up fused), S shared-expert width,
E experts, 1 one.
"""

from __future__ import annotations

import torch

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.loading.sources import TensorSource
from zerodram.runtime.model.config import ModelConfig
from zerodram.runtime.topology.placement import ExpertLayout

_ATTN = {
    "q": ("self_attn.q_proj.weight", "QD"),
    "k": ("self_attn.k_proj.weight", "KD"),
    "v": ("self_attn.v_proj.weight", "KD"),
    "o": ("self_attn.o_proj.weight", "DQ"),
    "attn_norm": ("input_layernorm.weight", "D"),
    "ffn_norm": ("post_attention_layernorm.weight", "D"),
}
_BIASES = {  # config.attention_bias (Qwen2)
    "q_bias": ("self_attn.q_proj.bias", "Q"),
    "k_bias": ("self_attn.k_proj.bias", "K"),
    "v_bias": ("self_attn.v_proj.bias", "K"),
}
_QK_NORMS = {  # config.qk_norm (Qwen3)
    "q_norm": ("self_attn.q_norm.weight", "H"),
    "k_norm": ("self_attn.k_norm.weight", "H"),
}
_DENSE = {
    "ffn.gate": ("mlp.gate_proj.weight", "FD"),
    "ffn.up": ("mlp.up_proj.weight", "FD"),
    "ffn.down": ("mlp.down_proj.weight", "DF"),
}
_SHARED = {
    "shared.gate": ("mlp.shared_expert.gate_proj.weight", "SD"),
    "shared.up": ("mlp.shared_expert.up_proj.weight", "SD"),
    "shared.down": ("mlp.shared_expert.down_proj.weight", "DS"),
}
_SHARED_GATE = {"shared.sigmoid_gate": ("mlp.shared_expert_gate.weight", "1D")}  # Qwen2-MoE
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
    placement: ExpertLayout | None,
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
        ConfigError (naming the checkpoint): a tensor is missing or not of the shape the config
            implies, the checkpoint has experts or biases the config does not use, or its expert
            layout is unknown.
    """
    c = config
    sizes = {
        "V": c.vocab_size,
        "D": c.hidden_size,
        "Q": c.q_size,
        "K": c.kv_size,
        "H": c.head_dim,
        "F": c.intermediate_size,
        "M": c.moe_intermediate_size,
        "G": 2 * c.moe_intermediate_size,
        "S": c.shared_expert_intermediate_size,
        "E": c.num_experts,
        "1": 1,
    }
    taken: set[str] = set()

    def get(
        name: str, dims: str, dim0: slice | list[int] | None = None, dim1: slice | None = None
    ) -> torch.Tensor:
        if not source.has(name):
            raise ConfigError(f"{source.path}: checkpoint has no tensor {name!r} (needed by {c.arch})")
        want, got = tuple(sizes[d] for d in dims), source.shape(name)
        if got != want:
            raise ConfigError(
                f"{source.path}: tensor {name!r} has shape {list(got)}, the config implies {list(want)} "
                f"[{', '.join(dims)}]"
            )
        taken.add(name)
        return source.read(name, dim0, dim1).to(device=device, dtype=dtype).contiguous()

    w: dict[str, torch.Tensor] = {
        "embed": get("model.embed_tokens.weight", "VD"),
        "final_norm": get("model.norm.weight", "D"),
    }
    if not c.tie_word_embeddings:  # no fallback to the embedding: an untied head that is missing is an error
        w["lm_head"] = get("lm_head.weight", "VD")
    local = placement.local_experts(rank) if placement is not None else tuple(range(c.num_experts))
    for i in range(c.num_layers):
        p, pre = f"layers.{i}.", f"model.layers.{i}."
        moe = c.is_moe_layer(i)
        shared = moe and c.shared_expert_intermediate_size > 0
        for table in (
            _ATTN,
            _BIASES if c.attention_bias else {},
            _QK_NORMS if c.qk_norm else {},
            {} if moe else _DENSE,
            _SHARED if shared else {},
            _SHARED_GATE if shared and c.shared_expert_gate else {},
        ):
            for ours, (theirs, dims) in table.items():
                w[p + ours] = get(pre + theirs, dims)
        if not moe:
            continue
        if c.router_kind == "softmax_topk":
            mixtral = source.has(pre + "block_sparse_moe.gate.weight")
            w[p + "router"] = get(
                pre + ("block_sparse_moe.gate.weight" if mixtral else "mlp.gate.weight"), "ED"
            )
        gate, up, down = _read_experts(get, source, c, pre, list(local), dtype, device)
        w[p + "experts.gate"], w[p + "experts.up"], w[p + "experts.down"] = gate, up, down
        w[p + "experts.ids"] = torch.tensor(local, dtype=torch.int64)
    # A bias the model would not apply changes its function: refuse rather than drop it silently.
    ignored = [n for n in source.names() if n.endswith(".bias") and n not in taken]
    if ignored:
        raise ConfigError(f"{source.path}: tensor {ignored[0]!r} is a bias the config does not use")
    return w


def _read_experts(get, source: TensorSource, config: ModelConfig, c: str, local: list[int], dtype, device):
    """(gate [El, M, D], up [El, M, D], down [El, D, M]) of the local experts of one layer."""
    M, D, E = config.moe_intermediate_size, config.hidden_size, config.num_experts
    if not local:
        empty = torch.empty(0, M, D, dtype=dtype, device=device)
        return empty, empty.clone(), torch.empty(0, D, M, dtype=dtype, device=device)
    if config.router_kind == "dense_slices":
        rows = [slice(e * M, (e + 1) * M) for e in local]
        gate = torch.stack([get(c + "mlp.gate_proj.weight", "FD", r) for r in rows])
        up = torch.stack([get(c + "mlp.up_proj.weight", "FD", r) for r in rows])
        down = torch.stack([get(c + "mlp.down_proj.weight", "DF", None, r) for r in rows])
        return gate, up, down
    for g, u, d in _PER_EXPERT:
        if source.has(c + g.format(e=local[0])):
            if source.has(c + g.format(e=E)):
                raise ConfigError(
                    f"{source.path}: {c + g.format(e=E)!r} exists, but the config has {E} experts"
                )
            gate = torch.stack([get(c + g.format(e=e), "MD") for e in local])
            up = torch.stack([get(c + u.format(e=e), "MD") for e in local])
            down = torch.stack([get(c + d.format(e=e), "DM") for e in local])
            return gate, up, down
    fused = c + "mlp.experts.gate_up_proj"
    if source.has(fused):
        gate_up = get(fused, "EGD", local)  # [El, 2M, D]
        return (
            gate_up[:, :M].contiguous(),
            gate_up[:, M:].contiguous(),
            get(c + "mlp.experts.down_proj", "EDM", local),
        )
    raise ConfigError(f"{source.path}: no routed-expert tensors found under {c!r} (unknown expert layout)")
