"""Per-layer FP2 constants (levels, anchors, rotation, error weights) from calibration statistics.

Dimensions: T tokens, H KV heads, D head dim.

Anchors are chosen for the error of the query-key *scores*, not of K: quantizing y = k / a with a
common block scale gives an error variance ~ mean_c(k_c^2 / a_c^2) per channel, weighted by
q_c^2 a_c^2 in the score (q is multiplied by a). Minimising sum_c E[q_c^2] a_c^2 * mean_c(E[k_c^2]
/ a_c^2) gives a_c = (rms_k_c / rms_q_c)^(1/2) ('score'). Whitening K (a_c = rms_k_c, 'rms') is
the naive anchor that the calibration note found harmful. 'none' is one scalar per head (rms of
the head), so that block scales sit near 1 where E4M3 is most precise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv.feedback import feedback_factor
from zerodram.runtime.kv.format import Fp2Spec, Fp2TensorSpec
from zerodram.runtime.kv.levels import fit_lloyd_max, named_levels, round_levels_e5m2
from zerodram.runtime.kv.quantize import SideParams, _block_view, quantize_blocks, to_stored_space
from zerodram.runtime.kv.rotation import layer_seed, rotation_matrix


@dataclass(frozen=True)
class LayerSample:
    """Calibration tensors of one layer (fp32, CPU). k_pre is None unless the model has RoPE.

    q: [T, H, G, D] queries grouped by KV head (G = query heads per KV head);
    k, v: [T, H, D] keys (post-RoPE) and values; k_pre: [T, H, D] keys before RoPE.
    o_proj: [hidden, H * G * D] the attention's output projection (value feedback), or None.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_pre: torch.Tensor | None = None
    k_pre: torch.Tensor | None = None
    o_proj: torch.Tensor | None = None

    @classmethod
    def from_attention(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        o_proj: torch.Tensor | None = None,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
    ) -> LayerSample:
        """A sample from one layer's attention inputs, token-major as a KV cache sees them.

        q: [T, Hq, D] post-RoPE queries (Hq a multiple of H); k, v: [T, H, D], k post-RoPE;
        o_proj: [hidden, Hq * D]; cos / sin: [T, D] of the positions, to recover the pre-RoPE keys
        and queries (None: no pre-RoPE tensors). Everything is copied to fp32 on the CPU.

        Raises:
            ConfigError: mismatched shapes (message names them).
        """
        T, H, D = k.shape
        if q.shape[0] != T or q.shape[2] != D or q.shape[1] % H or v.shape != k.shape:
            raise ConfigError(
                f"calibration sample: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                "do not share tokens and head dim, or query heads are not a multiple of KV heads"
            )
        cpu = lambda x: x.detach().to("cpu", torch.float32)  # noqa: E731
        qt, kt = cpu(q).reshape(T, H, -1, D), cpu(k)  # [T, H, G, D], [T, H, D]
        q_pre = k_pre = None
        if cos is not None and sin is not None:
            from zerodram.runtime.kv.codecs import invert_rope  # codecs imports this module

            cos, sin = cpu(cos), cpu(sin)
            k_pre = invert_rope(kt, cos, sin)
            q_pre = invert_rope(qt.reshape(T, -1, D), cos, sin).reshape(qt.shape)
        w = None if o_proj is None else cpu(o_proj).clone()
        return cls(q=qt, k=kt, v=cpu(v), q_pre=q_pre, k_pre=k_pre, o_proj=w)


def _rms(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return x.float().pow(2).mean(dims).sqrt().clamp_min(1e-6)


def side_params(
    side: Fp2TensorSpec,
    *,
    name: str,
    layer_idx: int,
    num_kv_heads: int,
    head_dim: int,
    spec: Fp2Spec,
    sample: LayerSample | None = None,
) -> SideParams:
    """Constants of one side ('k' or 'v') of one layer.

    Without a calibration sample: anchors are 1, 'cal' levels fall back to Lloyd-Max, and there is
    no center and no feedback factor (nearest rounding): these need calibration.
    """
    rot = None
    if side.rotate:
        rot = rotation_matrix(head_dim, layer_seed(spec.seed, layer_idx, name, spec.per_layer_rotation))
    anchor = torch.ones(num_kv_heads, head_dim)
    weights = None
    levels = named_levels("lm" if side.levels == "cal" else side.levels)
    if sample is None:
        return SideParams(levels=levels, anchor=anchor, rotation=rot)
    x = sample.v if name == "v" else (sample.k_pre if side.pre_rope else sample.k)
    q = sample.q_pre if side.pre_rope else sample.q
    if x is None or q is None:
        raise ValueError("pre-RoPE keys requested but the calibration sample has none")
    center = x.float().mean(0) if side.center else None  # [H, D]
    xc = x.float() - center if center is not None else x.float()
    xr = xc @ rot if rot is not None else xc  # [T, H, D]
    qr = q.float() @ rot if rot is not None and name == "k" else q.float()  # [T, H, G, D]
    x_rms = _rms(xr, (0,))  # [H, D]
    q_rms = _rms(qr, (0, 2))  # [H, D]
    if name == "k" and side.anchor == "score":
        a = (x_rms / q_rms).sqrt()
    elif side.anchor == "rms":
        a = x_rms
    else:
        a = torch.ones_like(x_rms)
    # Normalise so that y = x / a has unit RMS per head.
    a = a * _rms(xr / a, (0, 2))[:, None]
    anchor = a
    if name == "k":
        weights = (q_rms * anchor).pow(2)
        weights = weights / weights.mean(-1, keepdim=True)
    params = SideParams(levels=levels, anchor=anchor, rotation=rot, weights=weights, center=center)
    if side.levels == "cal":
        params = replace(params, levels=calibrate_levels(x, side, params))
    if side.feedback:
        weight = _error_weight(name, qr, anchor, rot, sample)
        params = replace(params, feedback=feedback_factor(weight, block=side.feedback_block))
    return params


def layer_params(
    spec: Fp2Spec, layer_idx: int, num_kv_heads: int, head_dim: int, sample: LayerSample | None = None
) -> tuple[SideParams, SideParams]:
    """(k_params, v_params) of one layer: from `sample` when given, else uncalibrated (see
    `side_params`)."""
    kw = {"layer_idx": layer_idx, "num_kv_heads": num_kv_heads, "head_dim": head_dim, "spec": spec}
    return side_params(spec.k, name="k", sample=sample, **kw), side_params(spec.v, name="v", sample=sample, **kw)


def needs_calibration(spec: Fp2Spec) -> bool:
    """True when some constant of `spec` comes from calibration data (anchors other than 'none',
    centers, 'cal' levels, error feedback); without a sample these fall back (`side_params`)."""
    return any(s.anchor != "none" or s.center or s.levels == "cal" or s.feedback for s in (spec.k, spec.v))


def _error_weight(
    name: str, qr: torch.Tensor, anchor: torch.Tensor, rot: torch.Tensor | None, sample: LayerSample
) -> torch.Tensor:
    """W of feedback.py in the stored space, [H, D, D]: E[q' q'^T] for keys (qr: rotated queries
    [T, H, G, D]), the group's o_proj^T o_proj for values.

    Raises:
        ConfigError: value feedback without the output projection in the sample.
    """
    if name == "k":
        qa = qr * anchor[None, :, None, :]  # q' = (q @ R) * anchor
        return torch.einsum("thgd,thge->hde", qa, qa) / (qa.shape[0] * qa.shape[2])
    if sample.o_proj is None:
        raise ConfigError("value feedback (vfb=1) needs the attention's o_proj in the calibration sample")
    H, D = anchor.shape
    w = sample.o_proj.float().reshape(sample.o_proj.shape[0], H, -1, D)  # [hidden, H, G, D]
    wv = torch.einsum("ohgd,ohge->hde", w, w)  # original space
    if rot is not None:
        wv = rot.T @ wv @ rot  # e_v = (e_y * a) @ R^T
    return wv * anchor[:, :, None] * anchor[:, None, :]


def calibrate_levels(x: torch.Tensor, side: Fp2TensorSpec, params: SideParams, rounds: int = 4) -> torch.Tensor:
    """Lloyd-Max levels fitted to x [T, H, D] in units of its block scales, alternating with the
    scale choice; returned e5m2-exact. # [4]"""
    y = to_stored_space(x, params)
    T = y.shape[0] - y.shape[0] % side.block_size
    yb = _block_view(y[:T].contiguous(), side)
    levels = params.levels
    for _ in range(rounds):
        _, scales, _ = quantize_blocks(
            yb, levels, rule="mse" if side.scale_rule == "wmse" else side.scale_rule, scale_dtype="fp32"
        )
        z = yb / scales[..., None]
        levels = fit_lloyd_max(z, levels * 1.0)
        levels = round_levels_e5m2(levels)
    return levels
