"""FP2 quantize / dequantize in plain torch (CPU or GPU): the reference the CUDA kernel matches.

Dimensions: T tokens, H KV heads, D head dim, NB blocks, BS block size, C scale candidates.

Stored value of element (t, h, c), in the rotated space (docs/fp2-format.md):
    x_rot[t, h, :] = x[t, h, :] @ R                       (R orthogonal, or identity)
    y[t, h, c]     = x_rot[t, h, c] / anchor[h, c]         (coarse tier, per channel)
    y_hat          = scale[block] * levels[code] + offset[block]   (fine tier, per block)
    x_hat[t, h, :] = (anchor[h, :] * y_hat[t, h, :]) @ R^T
Outliers (optional) replace y_hat at their positions with their bf16 value of y.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerodram.runtime.device import constant_on
from zerodram.runtime.kv.errors import KVInputError, KVNonFiniteError
from zerodram.runtime.kv.feedback import feedback_codes
from zerodram.runtime.kv.format import Fp2TensorSpec, ScaleDtype, ScaleRule
from zerodram.runtime.kv.levels import gaussian_rms_factor, midpoints, nearest_code
from zerodram.runtime.kv.scales import round_scale

# Candidate scales of the MSE search, as fractions of absmax / max|level|.
MSE_FRACTIONS = torch.linspace(0.2, 1.0, 33)
_CHUNK_ELEMS = 1 << 21  # bound the [C, NB, BS] search temporaries
# The stored range: quantize_blocks and the write kernels take stored values within +-STORED_MAX
# (Fp2Writer refuses larger ones on CPU). No real K/V comes within many orders of magnitude: the
# FP2 codes themselves clip near the largest scale times the largest level (448 x 1.75 with E4M3).
# Below it what follows stays finite, and the kernels equal to the reference: every scale format's
# scales and offsets, the rms rule's squares, the read back, a block's squared errors (fp32 in
# attn_fp2_write: 128 x ((1 + sqrt 2) 2^56)^2 < 2^122 with an E8M0 scale rounded up).
STORED_MAX = 2.0**56


@dataclass(frozen=True)
class SideParams:
    """Per-layer constants of one side (K or V); all on the device of the data.

    levels: [4] e5m2-exact, sorted. anchor: [H, D] fp32, > 0. rotation: [D, D] or None.
    weights: [H, D] per-channel error weights for the 'wmse' rule (E[q^2] in the stored space).
    center: [H, D] static per-channel mean subtracted before rotation (original space), or None.
    Subtracting one vector from every key leaves every score row shifted by a constant, so
    softmax ignores it; for values it is added back to the attention output.
    feedback: [H, D, D] factor of the error-feedback rounding (feedback.py), or None (nearest).
    """

    levels: torch.Tensor
    anchor: torch.Tensor
    rotation: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    center: torch.Tensor | None = None
    feedback: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> SideParams:
        """The same constants on `device`."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return SideParams(
            levels=move(self.levels), anchor=move(self.anchor), rotation=move(self.rotation),
            weights=move(self.weights), center=move(self.center), feedback=move(self.feedback),
        )  # fmt: skip


@dataclass(frozen=True)
class Fp2Tokens:
    """Quantized tokens of one side. codes: [T, H, D] uint8 in [0, 3].

    scales / offsets: [T, H, D // BS] ('channel' blocks) or [T // BS, H, D] ('token' blocks),
    fp32 values exactly representable in the scale dtype; offsets None unless asymmetric.
    outlier_mask: [T, H, D] bool or None; outlier_values: [T, H, D] fp32 (bf16-exact) or None.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    outlier_mask: torch.Tensor | None = None
    outlier_values: torch.Tensor | None = None


def check_finite(x: torch.Tensor, *, what: str, layer_idx: int, pos0: int = 0) -> None:
    """Raise KVNonFiniteError naming layer, head and position of the first NaN/Inf in x [T, H, D]."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        t, h, c = (int(i) for i in bad.nonzero()[0])
        raise KVNonFiniteError(
            f"{what} value {float(x[t, h, c])} at layer {layer_idx}, KV head {h}, position {pos0 + t}, channel {c}"
        )


def _block_view(y: torch.Tensor, spec: Fp2TensorSpec) -> torch.Tensor:
    """[T, H, D] -> [..., NB, BS] view with blocks along the chosen axis."""
    T, H, D = y.shape
    bs = spec.block_size
    if spec.block_axis == "channel":
        if D % bs:
            raise KVInputError(f"head dim {D} is not a multiple of the channel block size {bs}")
        return y.reshape(T, H, D // bs, bs)
    if T % bs:
        raise KVInputError(f"{T} tokens are not a multiple of the token block size {bs}")
    return y.reshape(T // bs, bs, H, D).permute(0, 2, 3, 1)  # [T/BS, H, D, BS]


def _unblock(yb: torch.Tensor, spec: Fp2TensorSpec, shape: torch.Size) -> torch.Tensor:
    if spec.block_axis == "channel":
        return yb.reshape(shape)
    return yb.permute(0, 3, 1, 2).reshape(shape)


def _search_scales(
    y: torch.Tensor, w: torch.Tensor, levels: torch.Tensor, s0: torch.Tensor, dtype: ScaleDtype
) -> torch.Tensor:
    """Per block, the candidate scale (rounded to `dtype`) of least weighted squared error.

    y, w: [NB, BS]; s0: [NB] absmax / max|level|. Returns [NB]. Candidates: `s0 * MSE_FRACTIONS`
    rounded to the scale format; ties go to the first (smallest) candidate.

    With y sorted per block, the elements that candidate s maps to level i form one run
    [b_i, b_i+1), b_i = #(y < s * m_i) (midpoints m_i; ties go up, as in `nearest_code`), so
        err(s) = sum w y^2 - 2 s sum_i L_i sum_run(w y) + s^2 sum_i L_i^2 sum_run(w)
    from prefix sums: O(BS log BS + C log BS) per block instead of O(C * BS). The sums are fp64
    so that the subtraction keeps the error's digits.
    """
    fr = constant_on(MSE_FRACTIONS, y.device)
    lv = levels.to(y.device).double()
    mids = midpoints(levels.to(y.device).float())
    out = torch.empty_like(s0)
    step = max(1, _CHUNK_ELEMS // (y.shape[1] + 4 * fr.numel()))
    for i in range(0, y.shape[0], step):
        yc, wc = y[i : i + step].float(), w[i : i + step].float()
        nb, bs = yc.shape
        cand = round_scale(s0[i : i + step, None] * fr, dtype)  # [nb, C]
        ys, order = yc.contiguous().sort(-1)
        ys = ys.contiguous()
        ws = wc.gather(-1, order).double()
        zero = torch.zeros(nb, 1, dtype=torch.float64, device=y.device)
        p_w = torch.cat([zero, ws.cumsum(-1)], -1)  # [nb, BS + 1]
        p_wy = torch.cat([zero, (ws * ys.double()).cumsum(-1)], -1)
        s_wyy = (ws * ys.double().pow(2)).sum(-1, keepdim=True)  # [nb, 1]
        thr = (cand[..., None] * mids).reshape(nb, -1)  # [nb, C * 3]
        b = torch.searchsorted(ys, thr).reshape(nb, -1, 3)  # [nb, C, 3] first index with y >= s m
        edges = torch.cat(
            [torch.zeros_like(b[..., :1]), b, torch.full_like(b[..., :1], bs)], -1
        )  # [nb, C, 5]
        flat = edges.reshape(nb, -1)
        sw = p_w.gather(1, flat).reshape(edges.shape).diff(dim=-1)  # [nb, C, 4] weight per level
        swy = p_wy.gather(1, flat).reshape(edges.shape).diff(dim=-1)
        c = cand.double()
        err = s_wyy - 2 * c * (swy * lv).sum(-1) + c * c * (sw * lv * lv).sum(-1)  # [nb, C]
        out[i : i + step] = cand.gather(1, err.argmin(1, keepdim=True))[:, 0]
    return out


def quantize_blocks(
    yb: torch.Tensor,
    levels: torch.Tensor,
    *,
    rule: ScaleRule,
    scale_dtype: ScaleDtype,
    asymmetric: bool = False,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize blocks of normalised values. yb: [..., BS] fp32 within +-STORED_MAX (past it
    scales, offsets and errors may overflow); weights broadcastable to yb.

    Returns (codes uint8 [..., BS], scales [...], offsets [...] or None). Elements of zero weight
    (sparse outliers) do not influence the scale.
    """
    shape = yb.shape
    y = yb.reshape(-1, shape[-1]).float()
    w = torch.ones_like(y) if weights is None else torch.broadcast_to(weights, shape).reshape(y.shape).float()
    live = w > 0
    offsets = None
    if asymmetric:
        hi = torch.where(live, y, -torch.inf).amax(-1)
        lo = torch.where(live, y, torch.inf).amin(-1)
        mid = torch.where(torch.isfinite(hi), (hi + lo) / 2, 0.0)
        offsets = mid.to(torch.bfloat16).float()  # stored as bf16 (offsets carry sign)
        y = y - offsets[:, None]
    lmax = levels.to(y.device).abs().max()  # a 0-dim tensor: no host sync (CUDA graphs)
    absmax = torch.where(live, y.abs(), 0.0).amax(-1)
    s0 = absmax / lmax
    if rule == "absmax":
        scales = round_scale(s0, scale_dtype)
    elif rule == "rms":
        rms = ((y * y * live).sum(-1) / live.sum(-1).clamp_min(1)).sqrt()
        scales = round_scale(rms * gaussian_rms_factor(levels.cpu()), scale_dtype)
    else:
        scales = _search_scales(y, w, levels, s0, scale_dtype)
    codes = nearest_code(y / scales[:, None], levels)
    codes = codes.reshape(shape)
    scales = scales.reshape(shape[:-1])
    return codes, scales, None if offsets is None else offsets.reshape(shape[:-1])


def dequantize_blocks(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, levels: torch.Tensor
) -> torch.Tensor:
    """codes [..., BS], scales/offsets [...] -> values [..., BS] fp32."""
    y = levels.to(scales.device)[codes.long()] * scales[..., None]
    return y if offsets is None else y + offsets[..., None]


def to_stored_space(x: torch.Tensor, params: SideParams) -> torch.Tensor:
    """x [T, H, D] -> y = ((x - center) @ R) / anchor, fp32 [T, H, D].

    Not saturated. Hazard: a finite x near its dtype's max (~1e36 and up, 30 orders past real K/V)
    can give +-inf or NaN here (the rotation's sums, the division by a small anchor) or past bf16's
    max in the callers' bf16 cast; the engine then fails that request at the next layer's or the
    sampler's non-finite check (docs/fp2-format.md, "Non-finite input"). A clamp here would cost a
    launch or two per side on every decode step's write (this runs on the step's hot path), for
    values no model gives; the write kernel taking x itself would make it free.
    """
    y = x.float()
    if params.center is not None:
        y = y - params.center
    if params.rotation is not None:
        y = y @ params.rotation
    return y / params.anchor


def from_stored_space(y: torch.Tensor, params: SideParams) -> torch.Tensor:
    """Inverse of `to_stored_space`: (y * anchor) @ R^T + center, fp32 [T, H, D]."""
    x = y * params.anchor
    if params.rotation is not None:
        x = x @ params.rotation.T
    if params.center is not None:
        x = x + params.center
    return x


def _outliers(y: torch.Tensor, frac: float) -> torch.Tensor | None:
    """Mask of the top `frac` |y| per head over the whole chunk. y: [T, H, D] -> bool [T, H, D]."""
    T, H, D = y.shape
    k = round(frac * T * D)
    if k == 0:
        return None
    flat = y.abs().permute(1, 0, 2).reshape(H, T * D)
    idx = flat.topk(k, dim=1).indices
    mask = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, idx, True)
    return mask.reshape(H, T, D).permute(1, 0, 2)


def quantize_tokens(
    x: torch.Tensor,
    spec: Fp2TensorSpec,
    params: SideParams,
    *,
    what: str = "K",
    layer_idx: int = 0,
    pos0: int = 0,
    staged: bool = False,
) -> Fp2Tokens:
    """Quantize whole blocks of tokens of one side.

    x: [T, H, D] float (T a multiple of the block size for 'token' blocks). Outliers, if any, are
    chosen per head over these T tokens (the cache calls this once per full tail). `staged`:
    round the stored-space values to bf16 first, as the paged cache does (its tail holds them in
    bf16 until the flush), so that a fake-quantizing harness reads back what the cache would.

    Raises:
        KVInputError: NaN/Inf in x (names layer, head, position), or T / D not divisible.
    """
    check_finite(x, what=what, layer_idx=layer_idx, pos0=pos0)
    y = to_stored_space(x, params)
    if staged:
        y = y.to(torch.bfloat16).float()
    mask = _outliers(y, spec.outlier_frac)
    codes, scales, offsets = quantize_stored(y, spec, params, outliers=mask)
    values = None if mask is None else torch.where(mask, y, 0.0).to(torch.bfloat16).float()
    return Fp2Tokens(codes=codes, scales=scales, offsets=offsets, outlier_mask=mask, outlier_values=values)


def quantize_stored(
    y: torch.Tensor, spec: Fp2TensorSpec, params: SideParams, *, outliers: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Codes, block scales and offsets of stored-space values y [T, H, D] (what a flush writes).

    Scales first, by the side's rule (outliers, a bool [T, H, D] mask, do not influence them), then
    codes: nearest level, or error-feedback rounding when the side asks for it and `params` carries
    its factor. Returns codes uint8 [T, H, D], scales and offsets in `Fp2Tokens`' shapes.
    """
    weights = None
    if spec.scale_rule == "wmse" and params.weights is not None:
        weights = torch.broadcast_to(params.weights, y.shape)
    if outliers is not None:
        base = torch.ones_like(y) if weights is None else weights
        weights = torch.where(outliers, 0.0, base)
    yb = _block_view(y, spec)
    wb = None if weights is None else _block_view(weights.contiguous(), spec)
    rule = "mse" if spec.scale_rule == "wmse" and wb is None else spec.scale_rule
    codes, scales, offsets = quantize_blocks(
        yb, params.levels, rule=rule, scale_dtype=spec.scale_dtype, asymmetric=spec.asymmetric, weights=wb
    )
    codes = _unblock(codes, spec, y.shape)
    if spec.feedback and params.feedback is not None:
        per_elem = lambda t: _unblock(torch.broadcast_to(t[..., None], yb.shape), spec, y.shape)  # noqa: E731
        codes = feedback_codes(
            y,
            per_elem(scales),
            None if offsets is None else per_elem(offsets),
            params.levels,
            params.feedback,
            exact=outliers,
        )
    return codes, scales, offsets


def dequantize_tokens(q: Fp2Tokens, spec: Fp2TensorSpec, params: SideParams) -> torch.Tensor:
    """Inverse of `quantize_tokens` up to quantization error. Returns fp32 [T, H, D]."""
    cb = _block_view(q.codes, spec)
    yb = dequantize_blocks(cb, q.scales, q.offsets, params.levels)
    y = _unblock(yb, spec, q.codes.shape)
    if q.outlier_mask is not None:
        y = torch.where(q.outlier_mask, q.outlier_values, y)
    return from_stored_space(y, params)


def fake_quantize(
    x: torch.Tensor,
    spec: Fp2TensorSpec,
    params: SideParams,
    *,
    what: str = "K",
    layer_idx: int = 0,
    staged: bool = False,
) -> torch.Tensor:
    """dequantize(quantize(x)) for x [T, H, D]; dtype preserved (`staged`: see `quantize_tokens`),
    finite: a value read back past the dtype's max (a scale rounds up) saturates there."""
    q = quantize_tokens(x, spec, params, what=what, layer_idx=layer_idx, staged=staged)
    top = torch.finfo(x.dtype if x.dtype.is_floating_point else torch.float32).max
    return dequantize_tokens(q, spec, params).clamp_(-top, top).to(x.dtype)
