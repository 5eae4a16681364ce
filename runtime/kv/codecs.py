"""Whole-sequence fake quantization (quantize then dequantize) for every KV scheme.

Used by the quality harness to emulate a cache in teacher-forced prefill: the codec returns the
values each token would be read back as once it left the full-precision tail. Which tokens a query
still sees in full precision is the cache's `TailRule`: token j is in full precision for query i iff
j < num_sinks or j >= num_sinks + rule.num_quantized(i + 1). Dimensions: T tokens, H KV heads,
D head dim.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from zerodram.runtime.kv.format import DenseSpec, Fp2Spec, IntSpec, KVSpec, TailRule, bits_per_elem, tail_rule
from zerodram.runtime.kv.params import LayerSample, layer_params
from zerodram.runtime.kv.quantize import SideParams, fake_quantize


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The RoPE helper of Llama-style models: (x1, x2) -> (-x2, x1) over the last dim halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D] -> RoPE(x)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def invert_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of `apply_rope` (rotation by minus the angle)."""
    return x * cos[:, None] - rotate_half(x) * sin[:, None]


class SequenceCodec(ABC):
    """Fake-quantizes the K and V of one layer over a whole sequence."""

    spec: KVSpec
    rule: TailRule = TailRule()

    @abstractmethod
    def fake_kv(
        self,
        layer_idx: int,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [T, H, D] (k post-RoPE; cos/sin [T, D] needed for pre-RoPE keys) -> (k_hat, v_hat)."""

    @property
    def identity(self) -> bool:
        """True when reading back is exact (no quantization at all)."""
        return False

    def bits_per_elem(self, ctx: int, head_dim: int) -> float:
        return bits_per_elem(self.spec, ctx, head_dim)

    def quantized_span(self, T: int) -> tuple[int, int]:
        """[start, end) of the tokens that are ever read back quantized in a T-token sequence."""
        s = min(self.rule.num_sinks, T)
        return s, s + self.rule.num_quantized(T)


class DenseCodec(SequenceCodec):
    """bf16 / fp32, or FP8 e4m3 with a static scale of 1 (the usual serving default)."""

    def __init__(self, spec: DenseSpec) -> None:
        self.spec = spec

    @property
    def identity(self) -> bool:
        return self.spec.dtype == "fp32"

    def fake_kv(self, layer_idx, k, v, cos=None, sin=None):
        dt = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}[self.spec.dtype]
        if dt is torch.float8_e4m3fn:
            return (k.clamp(-448, 448).to(dt).to(k.dtype), v.clamp(-448, 448).to(dt).to(v.dtype))
        return k.to(dt).to(k.dtype), v.to(dt).to(v.dtype)


def _int_fake(x: torch.Tensor, bits: int, group: int, axis: str) -> torch.Tensor:
    """Asymmetric uniform INT-`bits` fake quantization, fp16 scale and zero per group."""
    T, H, D = x.shape
    if axis == "channel":
        g = x.float().reshape(T, H, D // group, group)
    else:
        g = x.float().reshape(T // group, group, H, D).permute(0, 2, 3, 1)
    lo = g.amin(-1, keepdim=True).half().float()
    hi = g.amax(-1, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-8).half().float()
    y = ((g - lo) / scale).round().clamp(0, 2**bits - 1) * scale + lo
    if axis == "channel":
        return y.reshape(T, H, D).to(x.dtype)
    return y.permute(0, 3, 1, 2).reshape(T, H, D).to(x.dtype)


class IntCodec(SequenceCodec):
    """INT-N per group (and KIVI, which is INT2 with per-channel keys and a recent window)."""

    def __init__(self, spec: IntSpec) -> None:
        self.spec = spec
        self.rule = tail_rule(spec)

    def fake_kv(self, layer_idx, k, v, cos=None, sin=None):
        a, b = self.quantized_span(k.shape[0])
        k_hat, v_hat = k.clone(), v.clone()
        if b > a:
            k_hat[a:b] = _int_fake(k[a:b], self.spec.bits, self.spec.group, self.spec.k_axis)
            v_hat[a:b] = _int_fake(v[a:b], self.spec.bits, self.spec.group, self.spec.v_axis)
        return k_hat, v_hat


class Fp2Codec(SequenceCodec):
    """The FP2 format, with per-layer constants built from calibration samples (or defaults)."""

    def __init__(
        self,
        spec: Fp2Spec,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        samples: dict[int, LayerSample] | None = None,
    ) -> None:
        self.spec = spec
        self.rule = tail_rule(spec)
        self.params: list[tuple[SideParams, SideParams]] = []
        for layer in range(num_layers):
            self.params.append(layer_params(spec, layer, num_kv_heads, head_dim, (samples or {}).get(layer)))

    def _side(self, x, side, params, what, layer_idx):
        # staged: the stored-space values are rounded to bf16 before quantization, as in the paged
        # cache's tail, so that the harness reads back exactly what Fp2KVCache would hold.
        if side.outlier_frac == 0:
            return fake_quantize(x, side, params, what=what, layer_idx=layer_idx, staged=True)
        # Outliers are chosen per flushed tail, as the cache does.
        chunks = [
            fake_quantize(c, side, params, what=what, layer_idx=layer_idx, staged=True)
            for c in x.split(self.rule.flush)
        ]
        return torch.cat(chunks)

    def fake_kv(self, layer_idx, k, v, cos=None, sin=None):
        a, b = self.quantized_span(k.shape[0])
        k_hat, v_hat = k.clone(), v.clone()
        if b <= a:
            return k_hat, v_hat
        kp, vp = self.params[layer_idx]
        dev = k.device
        kp, vp = kp.to(dev), vp.to(dev)
        if self.spec.k.pre_rope:
            if cos is None or sin is None:
                raise ValueError("pre-RoPE keys need the model's cos/sin")
            kpre = invert_rope(k[a:b].float(), cos[a:b], sin[a:b])
            kq = self._side(kpre, self.spec.k, kp, "K", layer_idx)
            k_hat[a:b] = apply_rope(kq, cos[a:b], sin[a:b]).to(k.dtype)
        else:
            k_hat[a:b] = self._side(k[a:b], self.spec.k, kp, "K", layer_idx)
        v_hat[a:b] = self._side(v[a:b], self.spec.v, vp, "V", layer_idx)
        return k_hat, v_hat


def make_codec(
    spec: KVSpec, *, num_layers: int, num_kv_heads: int, head_dim: int, samples: dict[int, LayerSample] | None = None
) -> SequenceCodec:
    """The codec of a parsed spec. FP2 uses `samples` (per layer) for anchors / calibrated levels."""
    if isinstance(spec, DenseSpec):
        return DenseCodec(spec)
    if isinstance(spec, IntSpec):
        return IntCodec(spec)
    return Fp2Codec(spec, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, samples=samples)
