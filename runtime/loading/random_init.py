"""Random weights for a named (or any) `ModelConfig`, this rank's experts only.

Every tensor is drawn from its own generator seeded by (seed, tensor name), and expert e's from
(seed, layer, e), so ranks agree on the replicated tensors and an expert's values do not depend on
where it is placed: a 1-rank and an 8-rank run of the same config compute the same function.
A dense model served as MoE (`dense_slices`) draws its dense FFN under the dense names and cuts
it, so any number of slices, on any number of ranks, computes the dense model's function.
Scales keep activations O(1): projections ~ N(0, 1/fan_in), norms 1, router N(0, 1/D).
"""

from __future__ import annotations

import hashlib

import torch

from zerodram.runtime.model.config import ModelConfig
from zerodram.runtime.topology.placement import ExpertLayout


def _seed_of(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1


def _randn(
    shape: tuple[int, ...], name: str, seed: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(_seed_of(seed, name))
    fan_in = shape[-1]
    w = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * fan_in**-0.5
    return w.to(dtype)


def random_weights(
    config: ModelConfig,
    placement: ExpertLayout | None,
    rank: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Canonical-name weights for one rank (see `zerodram.runtime.model.transformer`)."""
    device = torch.device(device)
    c = config
    D, Dh = c.hidden_size, c.head_dim

    def rnd(name: str, *shape: int) -> torch.Tensor:
        return _randn(shape, name, seed, dtype, device)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype, device=device)

    w = {"embed": rnd("embed", c.vocab_size, D) * D**0.5 / 4, "final_norm": ones(D)}
    if not c.tie_word_embeddings:
        w["lm_head"] = rnd("lm_head", c.vocab_size, D)
    local = placement.local_experts(rank) if placement is not None else tuple(range(c.num_experts))
    for i in range(c.num_layers):
        p = f"layers.{i}."
        w[p + "attn_norm"], w[p + "ffn_norm"] = ones(D), ones(D)
        w[p + "q"], w[p + "k"] = rnd(p + "q", c.q_size, D), rnd(p + "k", c.kv_size, D)
        w[p + "v"], w[p + "o"] = rnd(p + "v", c.kv_size, D), rnd(p + "o", D, c.q_size)
        if c.attention_bias:
            for n, size in (("q_bias", c.q_size), ("k_bias", c.kv_size), ("v_bias", c.kv_size)):
                w[p + n] = rnd(p + n, size) * 0.1
        if c.qk_norm:
            w[p + "q_norm"], w[p + "k_norm"] = ones(Dh), ones(Dh)
        if not c.is_moe_layer(i):
            F = c.intermediate_size
            w[p + "ffn.gate"], w[p + "ffn.up"] = rnd(p + "ffn.gate", F, D), rnd(p + "ffn.up", F, D)
            w[p + "ffn.down"] = rnd(p + "ffn.down", D, F)
            continue
        F = c.moe_intermediate_size
        if c.router_kind == "softmax_topk":
            w[p + "router"] = rnd(p + "router", c.num_experts, D)
        if c.shared_expert_intermediate_size:
            Fs = c.shared_expert_intermediate_size
            w[p + "shared.gate"], w[p + "shared.up"] = (
                rnd(p + "shared.gate", Fs, D),
                rnd(p + "shared.up", Fs, D),
            )
            w[p + "shared.down"] = rnd(p + "shared.down", D, Fs)
            if c.shared_expert_gate:
                w[p + "shared.sigmoid_gate"] = rnd(p + "shared.sigmoid_gate", 1, D)
        if c.router_kind == "dense_slices":  # expert e: rows (gate, up) / columns (down) e*F .. (e+1)*F
            Fd = c.intermediate_size
            whole = {
                n: rnd(p + "ffn." + n, *((D, Fd) if n == "down" else (Fd, D))) for n in ("gate", "up", "down")
            }
            gate = [whole["gate"][e * F : (e + 1) * F] for e in local]
            up = [whole["up"][e * F : (e + 1) * F] for e in local]
            down = [whole["down"][:, e * F : (e + 1) * F] for e in local]
        else:
            gate = [rnd(f"{p}experts.{e}.gate", F, D) for e in local]
            up = [rnd(f"{p}experts.{e}.up", F, D) for e in local]
            down = [rnd(f"{p}experts.{e}.down", D, F) for e in local]
        empty = (0, F, D)
        w[p + "experts.gate"] = torch.stack(gate) if gate else torch.empty(empty, dtype=dtype, device=device)
        w[p + "experts.up"] = torch.stack(up) if up else torch.empty(empty, dtype=dtype, device=device)
        w[p + "experts.down"] = (
            torch.stack(down) if down else torch.empty((0, D, F), dtype=dtype, device=device)
        )
        w[p + "experts.ids"] = torch.tensor(local, dtype=torch.int64)
    return w
