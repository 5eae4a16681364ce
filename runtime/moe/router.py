"""Top-k routing: gate logits -> K experts per token and their weights.

Shape legend: T tokens, D hidden, E experts, K top-k.

The math of the fused CUDA router (the top-k inside `kernels/cuda/dispatch.cu`, after `gate_logits`),
in fp32:

    logits   x @ gate_weight.T, accumulated in fp32 (`gate_logits`)      # [T, E]
    scores   softmax(logits) over E, or sigmoid(logits)                   # [T, E]
    choice   the K largest logits, largest first (ties: lowest expert id) # [T, K]
    weight   the chosen scores, divided by their sum when `renormalize`   # [T, K]

Non-finite logits: a NaN ranks below every number, -inf included (so it is never chosen before a
real expert), and NaNs tie among themselves (lowest id); a chosen NaN gets a NaN weight (softmax:
any NaN makes the whole row NaN), which the engine's non-finite checks turn into an error for that
token's request. A renormalisation sum of 0 (sigmoid scores that all underflow) divides by 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerodram.runtime.errors import ConfigError

SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RouterConfig:
    """How tokens pick experts.

    Attributes:
        num_experts: E.
        top_k: K (1..8).
        scoring: "softmax" (Mixtral, Qwen-MoE) or "sigmoid" (DeepSeek-V3 style, without the
            group-limited selection and correction bias).
        renormalize: divide the K weights by their sum.

    Raises:
        ConfigError: unknown scoring, or K outside 1..min(8, E).
    """

    num_experts: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ConfigError(f"router scoring {self.scoring!r}; expected one of {SCORINGS}")
        if not 1 <= self.top_k <= min(8, self.num_experts):
            raise ConfigError(f"router top_k {self.top_k} outside 1..min(8, E={self.num_experts})")

    @property
    def scoring_id(self) -> int:
        """The kernel's code for `scoring` (0 softmax, 1 sigmoid)."""
        return SCORINGS.index(self.scoring)


def gate_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """x [T, D], gate_weight [E, D] -> logits [T, E] fp32: the exact products summed in fp32.

    bf16 operands on a GPU take one GEMM with an fp32 output (cuBLAS), which reads the operands as
    they are, with no fp32 copies (the [E, D] weight's would be 7 MB at E = 256, D = 7168).
    Elsewhere the operands are widened first. The two sum in different orders, so they agree to
    fp32 rounding, not bit for bit.
    """
    if x.is_cuda and x.dtype == gate_weight.dtype == torch.bfloat16:
        return torch.mm(x, gate_weight.t(), out_dtype=torch.float32)
    return x.float() @ gate_weight.float().t()


def route(logits: torch.Tensor, cfg: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (topk_idx [T, K] int64, topk_weight [T, K] fp32).

    Raises:
        ConfigError: logits have a different E than the config.
    """
    if logits.shape[-1] != cfg.num_experts:
        raise ConfigError(f"router logits have {logits.shape[-1]} experts, config says {cfg.num_experts}")
    logits = logits.float()
    scores = torch.softmax(logits, -1) if cfg.scoring == "softmax" else torch.sigmoid(logits)  # [T, E]
    # Chosen on the logits, as the kernel chooses: the scores are monotonic in them but saturate
    # (sigmoid 1.0) and round into ties the logits do not have. A stable sort keeps the lowest
    # expert id first among equal keys; torch.topk promises no order among ties.
    order = torch.sort(logit_keys(logits), dim=-1, descending=True, stable=True).indices  # [T, E]
    idx = order[..., : cfg.top_k]  # [T, K]
    weight = scores.gather(-1, idx)  # [T, K]
    if cfg.renormalize:
        total = weight.sum(-1, keepdim=True)  # [T, 1]
        # Sigmoid scores of very negative logits underflow to 0, and 0 / 0 would give NaN weights
        # to a token whose logits are all finite. A zero sum divides by 1 instead (the weights stay
        # 0: a token no expert wants); a NaN sum stays NaN. The kernel guards the same way.
        weight = weight / total.masked_fill(total == 0, 1.0)
    return idx, weight


NAN_KEY = -(2**31) + 1  # below every number's key (-inf's is -2**31 + 2**23 - 1)


def logit_keys(logits: torch.Tensor) -> torch.Tensor:
    """fp32 logits [..., E] -> int32 selection keys [..., E]: the kernel's `logit_key`.

    Ordered as the logits, with -0 and +0 one key (they tie) and every NaN the key NAN_KEY, below
    -inf. Sorting the floats cannot promise this: torch.sort ranks NaN above +inf, and a radix sort
    (which torch's CUDA sort can use) orders -0 below +0 where the CPU sort ties them. Integer keys
    sort the same on every device.
    """
    bits = logits.float().contiguous().view(torch.int32)
    mag = bits & 0x7FFFFFFF
    keys = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # negative: a larger magnitude ranks lower
    keys = keys.masked_fill(mag == 0, 0)
    return keys.masked_fill(mag > 0x7F800000, NAN_KEY)
