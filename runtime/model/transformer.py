"""The decoder-only transformer, run one `ForwardBatch` at a time.

Shape legend: T tokens in the step, D hidden, V vocab, Hq/Hkv heads, Dh head dim, N logit rows.

Weights arrive as a flat dict in zerodram's canonical names (the loaders produce it; see
`zerodram.runtime.loading.names`), holding only this rank's experts:

    embed [V, D], lm_head [V, D] (absent when tied), final_norm [D]
    layers.{i}.attn_norm / ffn_norm [D]; q [Hq*Dh, D], k / v [Hkv*Dh, D], o [D, Hq*Dh]
    layers.{i}.q_bias / k_bias / v_bias (optional); q_norm / k_norm [Dh] (Qwen3)
    layers.{i}.ffn.gate / up [F, D], ffn.down [D, F]                        (dense layers)
    layers.{i}.router [E, D]; experts.gate / up [El, F, D], experts.down [El, D, F]   (MoE layers)
    layers.{i}.shared.gate / up / down, shared.sigmoid_gate [1, D] (optional)

Attention is data-parallel (each rank runs its own requests against its KV partition); the routed
experts go through an `ExpertParallel` layer per MoE layer, which is collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.model.attention import PagedAttention
from zerodram.runtime.model.batch import ForwardBatch
from zerodram.runtime.model.config import ModelConfig
from zerodram.runtime.model.ep import ExpertParallel
from zerodram.runtime.model.local_experts import LocalExperts
from zerodram.runtime.model.moe import ExpertWeights, Router, SharedExpert, swiglu
from zerodram.runtime.model.rope import Rope
from zerodram.runtime.model.timing import NULL_TIMER, PhaseTimer

EPFactory = Callable[[int, ExpertWeights], ExpertParallel]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back, then the weight in x's dtype, as Llama/Mixtral/Qwen
    do (torch's `rms_norm` without a weight is the fp32 part: one kernel on a GPU where torch has
    the fused one, instead of five)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class DecoderLayer:
    """Attention block + FFN block (dense SwiGLU, or router + expert-parallel experts + shared)."""

    def __init__(self, config: ModelConfig, idx: int, w: dict[str, torch.Tensor], make_ep: EPFactory) -> None:
        self.cfg, self.idx = config, idx
        p = f"layers.{idx}."
        self.attn_norm, self.ffn_norm = w[p + "attn_norm"], w[p + "ffn_norm"]
        self.q, self.k, self.v, self.o = w[p + "q"], w[p + "k"], w[p + "v"], w[p + "o"]
        self.q_bias, self.k_bias, self.v_bias = (w.get(p + n) for n in ("q_bias", "k_bias", "v_bias"))
        self.q_norm, self.k_norm = w.get(p + "q_norm"), w.get(p + "k_norm")
        self.is_moe = config.is_moe_layer(idx)
        if self.is_moe:
            self.router = Router(config, w.get(p + "router"))
            experts = ExpertWeights(
                expert_ids=tuple(int(e) for e in w[p + "experts.ids"].tolist()),
                w_gate=w[p + "experts.gate"],
                w_up=w[p + "experts.up"],
                w_down=w[p + "experts.down"],
            )
            self.ep = make_ep(idx, experts)
            self.shared = None
            if config.shared_expert_intermediate_size:
                self.shared = SharedExpert(
                    w[p + "shared.gate"],
                    w[p + "shared.up"],
                    w[p + "shared.down"],
                    w.get(p + "shared.sigmoid_gate"),
                )
        else:
            self.ffn = (w[p + "ffn.gate"], w[p + "ffn.up"], w[p + "ffn.down"])

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn: PagedAttention,
        timer: PhaseTimer,
    ) -> torch.Tensor:
        """x [T, D] -> [T, D]; cos_sin: the batch's RoPE angles (`Rope.cos_sin`)."""
        with timer.phase("attention"):
            q, k, v = self.pre_attention(x, cos_sin)
            o = attn(self.idx, q, k, v, batch)  # [T, Hq, Dh]
            x = x + self.attn_output(o)
        return self.feed_forward(x, timer)

    def pre_attention(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> q [T, Hq, Dh], k / v [T, Hkv, Dh], RoPE applied by the angles `cos_sin`
        (`Rope.cos_sin` of the tokens' positions; no KV access: capturable)."""
        cfg, T = self.cfg, x.shape[0]
        h = rms_norm(x, self.attn_norm, cfg.rms_norm_eps)
        q = F.linear(h, self.q, self.q_bias).view(T, cfg.num_heads, cfg.head_dim)  # [T, Hq, Dh]
        k = F.linear(h, self.k, self.k_bias).view(T, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, Dh]
        v = F.linear(h, self.v, self.v_bias).view(T, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        q, k = Rope.apply(q, k, cos_sin)
        return q, k, v

    def attn_output(self, o: torch.Tensor) -> torch.Tensor:
        """The output projection: o [T, Hq, Dh] -> [T, D] (added to the residual by the caller)."""
        return F.linear(o.reshape(o.shape[0], self.cfg.q_size), self.o)

    def feed_forward(
        self, x: torch.Tensor, timer: PhaseTimer, ep: ExpertParallel | None = None
    ) -> torch.Tensor:
        """The FFN block with its residual: x [T, D] -> [T, D].

        ep: the routed experts to use (default: the layer's own; the CUDA-graph step passes a
        capturable twin, see runtime/engine/graphs.py).
        """
        cfg = self.cfg
        h = rms_norm(x, self.ffn_norm, cfg.rms_norm_eps)
        if not self.is_moe:
            with timer.phase("experts"):
                return x + swiglu(h, *self.ffn)
        with timer.phase("router"):
            topk_idx, topk_weight = self.router(h)  # [T, K], [T, K]
            timer.routed(self.idx, topk_idx)
        y = (ep or self.ep)(h, topk_idx, topk_weight)  # collective: every rank, every step
        if self.shared is not None:
            with timer.phase("experts"):
                y = y + self.shared(h)
        return x + y


class Transformer:
    """A decoder-only transformer over one rank's weights.

    Args:
        config: the model's shapes.
        weights: canonical-name tensors on `device`, this rank's experts only.
        make_ep: builds the expert-parallel layer of MoE layer i from its local experts
            (default: all experts local, no communication); if it has a `close()`, the model's
            `close()` calls it (it owns what it built).
        timer: per-phase timing hooks (default: none).

    Raises:
        ConfigError: a weight is missing or has the wrong shape.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        make_ep: EPFactory | None = None,
        timer: PhaseTimer = NULL_TIMER,
    ) -> None:
        self.config = config
        self.timer = timer
        every_token = config.router_kind == "dense_slices"
        make_ep = make_ep or (lambda _idx, experts: LocalExperts(experts, timer, every_token=every_token))
        self._make_ep = make_ep
        try:
            self.embed = weights["embed"]
            self.lm_head = weights["embed"] if config.tie_word_embeddings else weights["lm_head"]
            self.final_norm = weights["final_norm"]
            self.layers = [DecoderLayer(config, i, weights, make_ep) for i in range(config.num_layers)]
        except KeyError as err:
            raise ConfigError(f"checkpoint is missing weight {err.args[0]!r} for {config.arch}") from None
        if tuple(self.embed.shape) != (config.vocab_size, config.hidden_size):
            raise ConfigError(
                f"embedding is {tuple(self.embed.shape)}, config says "
                f"({config.vocab_size}, {config.hidden_size})"
            )
        self.device = self.embed.device
        self.dtype = self.embed.dtype
        self.rope = Rope(config.head_dim, config.rope_theta, config.rope_scaling, self.device)

    def close(self) -> None:
        """End what `make_ep` built (communicators, an NVSHMEM session): collective across ranks
        where those are. Idempotent."""
        close = getattr(self._make_ep, "close", None)
        if close is not None:
            close()

    def check_experts(self) -> None:
        """Raise what a device-side wait of the expert exchange recorded (`RankTimeoutError` naming
        the silent rank), if `make_ep` can tell (NVSHMEM). Between steps: it reads the device."""
        check = getattr(self._make_ep, "check", None)
        if check is not None:
            check()

    def forward(self, batch: ForwardBatch, attn: PagedAttention) -> torch.Tensor:
        """Run every layer over the batch; returns fp32 logits [N, V] for `batch.logits_rows`."""
        x = F.embedding(batch.token_ids, self.embed)  # [T, D]
        cos_sin = self.rope.cos_sin(batch.positions, x.dtype)  # once for every layer
        for layer in self.layers:
            x = layer.forward(x, batch, cos_sin, attn, self.timer)
        with self.timer.phase("lm_head"):
            return self.head(x[batch.logits_rows])

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: x [N, D] -> fp32 logits [N, V]."""
        h = rms_norm(x, self.final_norm, self.config.rms_norm_eps)
        return F.linear(h, self.lm_head).float()
