"""One evaluation: perplexity and passkey retrieval of a KV format against full precision.

Calibration (anchors, calibrated levels, centers) uses one window of `calib_tokens` (2048) taken
from the *end* of the token stream, disjoint from the evaluation windows, which start at token 0.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv.codecs import SequenceCodec, make_codec
from zerodram.runtime.kv.format import Fp2Spec, parse_kv_spec
from zerodram.runtime.kv.params import LayerSample
from zerodram.runtime.kv_eval.hook import CodecSession
from zerodram.runtime.kv_eval.model import LoadedModel, load_model
from zerodram.runtime.kv_eval.needle import make_trials, pass_rate
from zerodram.runtime.kv_eval.ppl import perplexity, windows
from zerodram.runtime.kv_eval.text import load_text

CALIB_TOKENS = 2048


@dataclass(frozen=True)
class EvalResult:
    """One JSON line of `zerodram eval-kv --json`."""

    model: str
    text: str
    ctx: int
    kv: str
    bits_per_elem: float
    ppl: float
    ppl_ref: float
    delta_ppl: float
    rel_delta_ppl: float
    attn_rel_err: float
    num_windows: int
    first_window: int
    num_scored: int
    needle_ctx: int
    needle_trials: int
    needle_pass_rate: float | None
    needle_pass_rate_ref: float | None
    prefill_attends_quantized: bool
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


class Evaluator:
    """Holds a loaded model, the tokenized text, calibration samples and reference results."""

    def __init__(self, model: str | LoadedModel, text: str = "pydoc", *, calib_tokens: int = CALIB_TOKENS) -> None:
        self.lm = load_model(model) if isinstance(model, str) else model
        self.text_name = text
        self.calib_tokens = min(calib_tokens, self.lm.max_ctx)
        if self.calib_tokens < 1:
            raise ConfigError(f"calibration needs at least one token, got {calib_tokens}")
        self.ids = self.lm.tokenizer(load_text(text), return_tensors="pt").input_ids[0]
        self._samples: dict[int, LayerSample] | None = None
        self._ref: dict[tuple, float] = {}
        torch.manual_seed(0)

    def samples(self) -> dict[int, LayerSample]:
        """Per-layer q/k/v of the calibration window (captured once)."""
        if self._samples is None:
            n = self.calib_tokens
            if self.ids.numel() < 2 * n:
                raise ConfigError(f"text too short to hold a {n}-token calibration window")
            session = CodecSession(self.lm.model, None, capture=True)
            session.forward(self.ids[-n:][None])
            self._samples = session.samples
        return self._samples

    def codec(self, kv: str) -> SequenceCodec:
        spec = parse_kv_spec(kv).spec
        samples = self.samples() if isinstance(spec, Fp2Spec) else None
        lm = self.lm
        return make_codec(
            spec, num_layers=lm.num_layers, num_kv_heads=lm.num_kv_heads, head_dim=lm.head_dim, samples=samples
        )

    def _reference(self, key: tuple, fn) -> float:
        if key not in self._ref:
            self._ref[key] = fn()
        return self._ref[key]

    def run(
        self,
        kv: str,
        *,
        ctx: int,
        num_windows: int = 4,
        first_window: int = 0,
        needle_ctx: int | None = None,
        needle_trials: int = 3,
    ) -> EvalResult:
        """Evaluate `kv` at context `ctx`; needle at `needle_ctx` (default: the model's limit, 0: skip).

        Windows `first_window .. first_window + num_windows - 1` of `ctx` tokens are scored. The
        protocol of record is `first_window=0`; a later start gives a development split on which
        configurations can be chosen without looking at the reported windows.

        Raises:
            ConfigError: bad spec, context beyond the model's limit, or text too short.
        """
        t0 = time.time()
        lm = self.lm
        if first_window < 0 or num_windows < 1:
            raise ConfigError(f"need first_window >= 0 and num_windows >= 1, got {first_window}, {num_windows}")
        if ctx > lm.max_ctx:
            raise ConfigError(f"context {ctx} exceeds the model's limit of {lm.max_ctx} positions")
        codec = self.codec(kv)
        stream = self.ids[: self.ids.numel() - self.calib_tokens]  # disjoint from the calibration window
        wins = windows(stream, ctx, first_window + num_windows)[first_window:]
        ref_session = CodecSession(lm.model, None)
        ref_nll = self._reference(
            ("ppl", ctx, first_window, num_windows), lambda: perplexity(ref_session, wins).nll
        )
        session = CodecSession(lm.model, codec)
        res = perplexity(session, wins)
        ppl_ref = float(torch.tensor(ref_nll / res.num_scored).exp())
        n_ctx = lm.max_ctx if needle_ctx is None else needle_ctx
        rate = rate_ref = None
        if n_ctx > 0 and needle_trials > 0:
            encode = lambda s: lm.tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
            trials = make_trials(encode, min(n_ctx, lm.max_ctx), needle_trials)
            rate_ref = self._reference(
                ("needle", n_ctx, needle_trials), lambda: pass_rate(CodecSession(lm.model, None), trials)
            )
            rate = pass_rate(CodecSession(lm.model, codec, track_error=False), trials)
        return EvalResult(
            model=lm.name,
            text=self.text_name,
            ctx=ctx,
            kv=kv,
            bits_per_elem=round(codec.bits_per_elem(ctx, lm.head_dim), 4),
            ppl=round(res.ppl, 4),
            ppl_ref=round(ppl_ref, 4),
            delta_ppl=round(res.ppl - ppl_ref, 4),
            rel_delta_ppl=round(res.ppl / ppl_ref - 1, 5),
            attn_rel_err=round(session.stats.rel_error(), 5),
            num_windows=num_windows,
            first_window=first_window,
            num_scored=res.num_scored,
            needle_ctx=n_ctx if rate is not None else 0,
            needle_trials=needle_trials if rate is not None else 0,
            needle_pass_rate=rate,
            needle_pass_rate_ref=rate_ref,
            prefill_attends_quantized=True,
            seconds=round(time.time() - t0, 1),
        )
