"""Error-feedback rounding: FP2 codes chosen for the error that matters downstream, not for |K - K̂|.

Dimensions: T tokens, H KV heads, D head dim.

A key's quantization error e (in the stored space) moves its score under query q by q'·e, where
q' = (q @ R) * anchor is the query as the decode kernel sees it. Over the queries of the KV head's
group the expected squared score error is eᵀ W e with W = E[q' q'ᵀ]. W is far from isotropic (a few
directions, and the queries' mean, carry most of the query energy), so nearest rounding, which
minimises |e|², leaves much of its error where the queries look. Rounding the channels one after
another and pushing each channel's rounding error onto the channels not yet rounded, through W⁻¹
(the optimal-brain-quantization / GPTQ update for one row), minimises eᵀ W e greedily instead.
For values the error reaches the residual stream through o_proj: W = Σ_g W_o,gᵀ W_o,g over the
group's query heads, expressed in the stored space.

Only the choice of codes changes: block scales are chosen first by the side's rule on the unmodified
values, and pages, layout and the decode kernel stay as they are. Cost: D²/2 multiply-adds per
token and head, on write only (2k for D = 64), plus one [H, D, D] factor per layer and side kept by
the writer (never read by the decode kernel, not part of the stored format).
"""

from __future__ import annotations

import torch

from zerodram.kernels.feedback import feedback_codes_cuda, supports_head_dim
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv.levels import midpoints

# Ridge added to W before inverting, relative to its mean diagonal: keeps the factor well conditioned
# when calibration leaves directions unexplored (0.01 and 0.1 measured the same on SmolLM2).
DAMP = 0.01


def block_mask(head_dim: int, block: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[D, D] bool: True where channels i and j lie in one block of `block` consecutive channels
    (`fbblk`; 0: one block, the whole head)."""
    idx = torch.arange(head_dim, device=device) // (block or head_dim)
    return idx[:, None] == idx[None, :]


def feedback_factor(weight: torch.Tensor, damp: float = DAMP, block: int = 0) -> torch.Tensor:
    """Upper Cholesky factor U of (W + damp * mean(diag W) * I)⁻¹, so that Uᵀ U is that inverse.

    weight: [H, D, D] symmetric positive semi-definite error weight W (stored space).
    block: 0, or the width of the diagonal blocks of W kept (`fbblk`): W's other entries are taken
    as 0, so U is block diagonal and a rounding error reaches only the channels of its own block of
    `block` consecutive channels. Each block is then a chain of its own, which a writer may run
    beside the others: the same codes as the one chain over the head (a zero factor subtracts an
    exact zero). On SmolLM2 (D = 64) blocks of 32 kept 80-86% of the feedback's perplexity gain
    (docs/kv-quality.md).
    Returns fp32 [H, D, D], upper triangular.

    Raises:
        ConfigError: a block that does not divide the head dim.
    """
    w = weight.double()
    D = w.shape[-1]
    if block and D % block:  # (a block wider than the head leaves a remainder too)
        raise ConfigError(f"feedback blocks of {block} channels do not divide the head dim {D}", field="fbblk")
    if block:
        w = w * block_mask(D, block, w.device)
    ridge = damp * w.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-12)
    w = w + ridge[:, None, None] * torch.eye(D, dtype=w.dtype, device=w.device)
    inv = torch.cholesky_inverse(torch.linalg.cholesky(w))
    return torch.linalg.cholesky(inv, upper=True).float().contiguous()  # upper=True returns a transposed view


def feedback_codes(
    y: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    levels: torch.Tensor,
    factor: torch.Tensor,
    exact: torch.Tensor | None = None,
) -> torch.Tensor:
    """Codes of y rounded channel by channel with error feedback.

    y: [T, H, D] fp32 stored-space values; scales / offsets: [T, H, D] per element (block values
    broadcast; anything broadcastable to y); factor: [H, D, D] from `feedback_factor`; exact:
    [T, H, D] bool, elements kept exactly (sparse outliers: no rounding error to feed forward).
    Returns uint8 [T, H, D] on y's device. Ties and clipping follow `nearest_code`.

    Backend, from y's device: on CUDA the kernel (kernels/feedback.py, one launch, codes identical
    to this loop's on the same device), for every combination of offsets / exact; elsewhere, and
    on CUDA for a head dim over the kernel's 256, `feedback_codes_reference` (the torch loop).

    Raises:
        KVInputError: shapes, dtypes or devices the kernel cannot take (after the casts below).
    """
    if y.is_cuda and supports_head_dim(y.shape[-1]):
        # The reference's own casts and broadcasts (no copies for fp32 inputs: views, read in place).
        return feedback_codes_cuda(
            y.float(),
            torch.broadcast_to(scales, y.shape).float(),
            None if offsets is None else torch.broadcast_to(offsets, y.shape).float(),
            levels.to(y.device).float().contiguous(),
            factor.float().contiguous(),
            exact,
        )
    return feedback_codes_reference(y, scales, offsets, levels, factor, exact)


def feedback_codes_reference(
    y: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    levels: torch.Tensor,
    factor: torch.Tensor,
    exact: torch.Tensor | None = None,
) -> torch.Tensor:
    """`feedback_codes` as a plain torch loop on any device: the definition the kernel matches.

    Same arguments and result; D sequential steps of ~6 tensor ops each.
    """
    D = y.shape[-1]
    # Channel-major copies, so that each step reads and updates contiguous rows; the factor's rows
    # are divided by their diagonal once. The loop is sequential over channels (D steps): on a
    # decode write (T = 1) its cost is the number of tensor ops per step, so keep it small.
    # clone, not contiguous(): for T = H = 1 the permuted view is already "contiguous", and the
    # loop's in-place updates would write into the caller's y
    yc = y.float().permute(2, 0, 1).clone(memory_format=torch.contiguous_format)  # [D, T, H]
    sc = torch.broadcast_to(scales, y.shape).float().permute(2, 0, 1).contiguous()
    oc = None if offsets is None else torch.broadcast_to(offsets, y.shape).float().permute(2, 0, 1).contiguous()
    keep = None if exact is None else (~exact).permute(2, 0, 1).float()  # 0 where kept exactly
    rows = (factor.float() / factor.diagonal(dim1=-2, dim2=-1)[..., None]).permute(1, 2, 0)  # [D, D, H]
    rows = rows.contiguous()
    lv = levels.to(y.device).float()
    mids = midpoints(lv)
    codes = []
    for c in range(D):
        x = yc[c] if oc is None else yc[c] - oc[c]  # [T, H]
        code = torch.bucketize(x / sc[c], mids, right=True)
        codes.append(code)
        if c + 1 < D:
            err = x - lv[code] * sc[c]  # offsets cancel: (y - o) - (L s)
            if keep is not None:
                err = err * keep[c]
            yc[c + 1 :].addcmul_(rows[c, c + 1 :, None, :], err, value=-1.0)
    return torch.stack(codes, -1).to(torch.uint8)  # [T, H, D]
