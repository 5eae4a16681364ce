"""Replace a Hugging Face model's attention with one that reads K/V back through a KV codec.

Protocol (teacher-forced, batch 1, one unpadded sequence starting at position 0): every query
attends over the *quantized* cache, except the tokens the scheme keeps in full precision at that
query's decode step (attention sinks and the not-yet-flushed tail; see `codecs.py`). So prefill
attends over quantized KV exactly as decode would.

Hooking: transformers >= 4.48 has `AttentionInterface`: we register one function and switch the
model's `attn_implementation` to it. Older versions (4.45 - 4.47) call
`torch.nn.functional.scaled_dot_product_attention` from each attention module in layer order:
there we patch that function for the duration of a forward and count calls to find the layer.

Dimensions: T tokens, Hq query heads, H KV heads, G = Hq / H, D head dim, R query rows of a chunk.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from zerodram.runtime.kv.codecs import SequenceCodec
from zerodram.runtime.kv.format import TailRule
from zerodram.runtime.kv.params import LayerSample

_QUERY_CHUNK = 1024
_ids = itertools.count()


def _tail_start(i: torch.Tensor, rule: TailRule, T: int) -> torch.Tensor:
    """First full-precision tail position for queries at positions i (any shape)."""
    s = min(rule.num_sinks, T)
    m = (i + 1 - s - rule.window).clamp_min(0)
    return s + torch.div(m, rule.flush, rounding_mode="floor") * rule.flush


def full_precision_mask(T: int, rule: TailRule, rows: slice, device) -> torch.Tensor:
    """[R, T] bool: key j is read in full precision by query i (see `codecs.py`)."""
    i = torch.arange(T, device=device)[rows][:, None]
    j = torch.arange(T, device=device)[None, :]
    return (j < min(rule.num_sinks, T)) | (j >= _tail_start(i, rule, T))


@dataclass
class AttnStats:
    """Attention-output error of the quantized cache vs full precision on the same inputs."""

    err_sq: list[float] = field(default_factory=list)  # per layer, summed over calls
    ref_sq: list[float] = field(default_factory=list)

    def add(self, layer: int, err: float, ref: float) -> None:
        while len(self.err_sq) <= layer:
            self.err_sq.append(0.0)
            self.ref_sq.append(0.0)
        self.err_sq[layer] += err
        self.ref_sq[layer] += ref

    def rel_error(self) -> float:
        """Mean over layers of ||o - o_ref|| / ||o_ref||."""
        vals = [(e / r) ** 0.5 for e, r in zip(self.err_sq, self.ref_sq, strict=True) if r > 0]
        return sum(vals) / len(vals) if vals else 0.0


def _flash_with_lse(q, k, v, scaling):
    """Causal attention returning (out [Hq, Tq, D], lse [Hq, Tq]); None where unsupported."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or q.device.type != "cpu":
        return None
    out, lse = op(q[None], k[None], v[None], 0.0, True, scale=scaling)[:2]
    return out[0], lse[0]


def _banded_part(q, k, v, k_hat, v_hat, scaling, rule):
    """Each query over its sinks and its band (its last window + flush keys), mixing full-precision
    (sinks, own tail) and quantized keys. q, k...: [Hq, T, D]. Returns (out [Hq, T, D], lse [Hq, T]).

    Queries are taken in blocks of B >= F aligned at 0; a block's bands lie inside keys
    [b0 - F, b0 + B), so scores are [Hq, NB, B, B + F] batched matmuls, no gather.
    """
    Hq, T, D = q.shape
    F_ = rule.window + rule.flush  # band width
    B = max(F_, 64)  # query block; its bands lie in keys [b0 - F, b0 + B)
    nb = -(-T // B)
    Tp = nb * B
    pad = lambda x: torch.nn.functional.pad(x, (0, 0, F_, Tp - T))  # noqa: E731  [Hq, F + Tp, D]
    win = lambda x: pad(x).unfold(1, B + F_, B).transpose(-1, -2)  # noqa: E731  [Hq, NB, B + F, D]
    qb = torch.nn.functional.pad(q, (0, 0, 0, Tp - T)).reshape(Hq, nb, B, D)
    i = torch.arange(Tp).reshape(nb, B, 1)  # query positions
    j = (torch.arange(nb) * B - F_).reshape(nb, 1, 1) + torch.arange(B + F_).reshape(1, 1, -1)
    s = min(rule.num_sinks, T)
    start = _tail_start(i, rule, T)
    band = (j <= i) & (j > i - F_) & (j >= s)  # [NB, B, B + F]
    use_fp = j >= start
    sf = (qb @ win(k).transpose(-1, -2)) * scaling  # [Hq, NB, B, B + F]
    sq = (qb @ win(k_hat).transpose(-1, -2)) * scaling
    sc = torch.where(use_fp, sf, sq).masked_fill(~band, float("-inf"))
    if s > 0:
        ss = (qb @ k[:, None, :s].transpose(-1, -2)) * scaling  # [Hq, NB, B, S]
        ss = ss.masked_fill(~(torch.arange(s) <= i), float("-inf"))
        sc = torch.cat([sc, ss], -1)
    lse = torch.logsumexp(sc, -1)
    p = torch.exp(sc - lse[..., None]).nan_to_num(0.0)
    pb = p[..., : B + F_]
    out = (pb * use_fp) @ win(v) + (pb * ~use_fp) @ win(v_hat)
    if s > 0:
        out = out + p[..., B + F_ :] @ v[:, None, :s]
    return out.reshape(Hq, Tp, D)[:, :T], lse.reshape(Hq, Tp)[:, :T]


def codec_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_hat: torch.Tensor,
    v_hat: torch.Tensor,
    *,
    scaling: float,
    rule: TailRule,
    exact: bool,
    stats: tuple[AttnStats, int] | None = None,
) -> torch.Tensor:
    """Causal attention with per-query mixing of quantized and full-precision keys / values.

    q: [Hq, T, D]; k, v, k_hat, v_hat: [H, T, D]. Returns [T, Hq, D] in q's dtype.

    Query i sees full-precision sinks and its own tail, quantized keys elsewhere. Computed as a
    fused causal attention over the quantized keys older than i's band of `flush` keys, plus an
    explicit part over the band and the sinks, merged by their log-sum-exps (exact, no
    cancellation). Without the fused kernel's LSE (non-CPU) one masked SDPA over 2T keys is used.
    """
    import torch.nn.functional as F

    Hq, T, _ = q.shape
    G = Hq // k.shape[0]
    qf = q.float()
    kf, vf, kq, vq = (x.float().repeat_interleave(G, 0) for x in (k, v, k_hat, v_hat))  # [Hq, T, D]
    ref = None
    if exact or stats is not None:
        ref = F.scaled_dot_product_attention(qf[None], kf[None], vf[None], is_causal=True, scale=scaling)[0]
        if exact:
            return ref.transpose(0, 1).to(q.dtype)
    s = min(rule.num_sinks, T)
    band = rule.window + rule.flush
    a0 = s + band  # first query with keys older than its band
    fused = _flash_with_lse(qf[:, a0:], kq[:, s : T - band], vq[:, s : T - band], scaling) if a0 < T else None
    if fused is None and a0 < T:
        return _masked_attention(qf, kf, vf, kq, vq, scaling, rule, stats, ref)
    out, lb = _banded_part(qf, kf, vf, kq, vq, scaling, rule)
    if fused is not None:
        oa, la = fused
        m = torch.maximum(la, lb[:, a0:])
        wa, wb = torch.exp(la - m), torch.exp(lb[:, a0:] - m)
        out[:, a0:] = (oa * wa[..., None] + out[:, a0:] * wb[..., None]) / (wa + wb)[..., None]
    if stats is not None and ref is not None:
        stats[0].add(stats[1], float((out - ref).pow(2).sum()), float(ref.pow(2).sum()))
    return out.transpose(0, 1).to(q.dtype)


def _masked_attention(qf, kf, vf, kq, vq, scaling, rule, stats, ref):
    """Fallback: one SDPA over 2T keys [k_hat; k] with a mask choosing each key's copy."""
    import torch.nn.functional as F

    Hq, T, D = qf.shape
    k_cat, v_cat = torch.cat([kq, kf], 1)[None], torch.cat([vq, vf], 1)[None]  # [1, Hq, 2T, D]
    out = torch.empty(Hq, T, D, device=qf.device)
    for r0 in range(0, T, _QUERY_CHUNK):
        rows = slice(r0, min(T, r0 + _QUERY_CHUNK))
        causal = torch.ones(rows.stop - r0, T, dtype=torch.bool, device=qf.device).tril(r0)
        fp = full_precision_mask(T, rule, rows, qf.device)  # [R, T]
        mask = torch.cat([causal & ~fp, causal & fp], 1)  # [R, 2T]
        out[:, rows] = F.scaled_dot_product_attention(qf[None, :, rows], k_cat, v_cat, attn_mask=mask, scale=scaling)[0]
    if stats is not None and ref is not None:
        stats[0].add(stats[1], float((out - ref).pow(2).sum()), float(ref.pow(2).sum()))
    return out.transpose(0, 1)


class CodecSession:
    """Runs a model with its attention reading K/V through `codec` (or capturing them).

    Use as a context manager around forwards; `capture=True` records calibration samples
    (`LayerSample` per layer) instead of quantizing.
    """

    def __init__(self, model, codec: SequenceCodec | None, *, capture: bool = False, track_error: bool = True):
        self.model = model
        self.codec = codec
        self.capture = capture
        self.track_error = track_error
        self.samples: dict[int, LayerSample] = {}
        self.stats = AttnStats()
        self.num_layers = model.config.num_hidden_layers
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self._calls = 0

    # -- the attention body shared by both hooking paths --
    def _attend(self, layer: int, q, k, v, scaling: float, o_proj: torch.Tensor | None = None) -> torch.Tensor:
        """q: [1, Hq, T, D], k/v: [1, H, T, D] -> [1, T, Hq, D]. o_proj: the layer's output
        projection weight, recorded with calibration samples when known."""
        if q.shape[0] != 1:
            raise ValueError("the KV quality hook runs batch 1")
        q0, k0, v0 = q[0], k[0], v[0]
        cos, sin = self._cos_sin if self._cos_sin is not None else (None, None)
        if self.capture:
            self._record(layer, q0, k0, v0, cos, sin, o_proj)
        codec = self.codec
        if codec is None or codec.identity or self.capture:
            o = codec_attention(q0, k0, v0, k0, v0, scaling=scaling, rule=TailRule(), exact=True)
            return o[None]
        kt, vt = k0.transpose(0, 1), v0.transpose(0, 1)  # [T, H, D]
        k_hat, v_hat = codec.fake_kv(layer, kt, vt, cos, sin)
        o = codec_attention(
            q0,
            k0,
            v0,
            k_hat.transpose(0, 1),
            v_hat.transpose(0, 1),
            scaling=scaling,
            rule=codec.rule,
            exact=False,
            stats=(self.stats, layer) if self.track_error else None,
        )
        return o[None]

    def _record(self, layer, q0, k0, v0, cos, sin, o_proj) -> None:
        t = lambda x: x.transpose(0, 1)  # noqa: E731  [heads, T, D] -> [T, heads, D]
        self.samples[layer] = LayerSample.from_attention(t(q0), t(k0), t(v0), o_proj=o_proj, cos=cos, sin=sin)

    def _set_rope(self, T: int) -> None:
        rotary = getattr(getattr(self.model, "model", None), "rotary_emb", None)
        if rotary is None:
            self._cos_sin = None
            return
        pos = torch.arange(T)[None]
        dummy = torch.zeros(1, T, 1, dtype=torch.float32)
        cos, sin = rotary(dummy, pos)
        self._cos_sin = (cos[0].float(), sin[0].float())

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor):
        """Teacher-forced forward of input_ids [1, T]; returns the model output (logits)."""
        self._set_rope(input_ids.shape[1])
        with self._hooked():
            return self.model(input_ids=input_ids, use_cache=False)

    @contextmanager
    def _hooked(self) -> Iterator[None]:
        try:
            from transformers import AttentionInterface
        except ImportError:
            AttentionInterface = None
        if AttentionInterface is not None:
            with self._via_interface(AttentionInterface):
                yield
        else:
            with self._via_sdpa_patch():
                yield

    @contextmanager
    def _via_interface(self, interface) -> Iterator[None]:
        name = f"zerodram_kv_{next(_ids)}"

        def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            o_proj = getattr(getattr(module, "o_proj", None), "weight", None)
            return self._attend(module.layer_idx, query, key, value, scale, o_proj), None

        interface.register(name, attention)
        configs = _all_configs(self.model)
        saved = [c._attn_implementation for c in configs]
        for c in configs:
            c._attn_implementation = name
        try:
            yield
        finally:
            for c, s in zip(configs, saved, strict=True):
                c._attn_implementation = s

    @contextmanager
    def _via_sdpa_patch(self) -> Iterator[None]:
        import torch.nn.functional as F

        original: Callable = F.scaled_dot_product_attention
        self._calls = 0
        H = self.model.config.num_key_value_heads

        def patched(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
            layer = self._calls % self.num_layers
            self._calls += 1
            G = key.shape[1] // H  # old models pass repeat_kv'd keys: keep one per group
            s = scale if scale is not None else query.shape[-1] ** -0.5
            o = self._attend(layer, query, key[:, ::G], value[:, ::G], s)
            return o.transpose(1, 2)

        F.scaled_dot_product_attention = patched
        try:
            yield
        finally:
            F.scaled_dot_product_attention = original


def _all_configs(model) -> list:
    seen, out = set(), []
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and id(c) not in seen and hasattr(c, "_attn_implementation"):
            seen.add(id(c))
            out.append(c)
    return out
