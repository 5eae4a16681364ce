"""KV formats as frozen specs, parsed once from a `--kv` string, and their all-inclusive bit cost.

Spec strings: ``NAME[:key=value,...]``. Names:

- ``bf16``, ``fp32``, ``fp8`` (e4m3, one fp32 scale per (layer, head): counted as 8 bits)
- ``int4`` / ``int3`` / ``int2``: asymmetric uniform INT-N per token, groups of ``g`` channels
  (``g=32``, fp16 scale + zero point), optional ``recent=R`` full-precision tokens flushed R at a
  time, and ``window=W`` more that always stay full precision
- ``kivi2``: KIVI style asymmetric INT2, keys per channel over groups of 32 tokens, values per
  token in groups of 32 channels, 128 recent tokens in fp16
- ``fp2``: the FP2 format of docs/fp2-format.md; keys (prefix ``k``) and values (prefix ``v``)
  are configured separately, e.g. ``fp2:kblk=c64,vblk=c64,rot=1,sinks=4,tail=32``.

FP2 keys (``X`` = ``k`` or ``v`` sets one side, the bare key sets both):
``Xblk=c<n>|t<n>`` block along channels within a token / along tokens within a channel;
``Xscale=e4m3|e8m0|bf16``; ``Xrule=absmax|rms|mse|wmse``; ``Xlevels=sig|lm|cal``;
``Xrot=0|1`` Hadamard with random signs; ``Xanchor=none|rms|score``; ``Xasym=0|1``;
``Xout=<fraction>`` sparse outliers; ``Xcenter=0|1`` subtract a calibrated per-channel mean;
``Xfb=0|1`` error-feedback rounding against the calibrated error weight (feedback.py);
``Xfbblk=<n>`` the feedback kept inside blocks of n consecutive stored channels (0: the whole head);
``kprerope=0|1``; and ``sinks=``, ``tail=``, ``window=``, ``page=``, ``seed=``,
``layerrot=0|1`` (one rotation per layer instead of one shared).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace
from typing import Literal

from zerodram.runtime.errors import ConfigError

BlockAxis = Literal["channel", "token"]
ScaleDtype = Literal["e4m3", "e8m0", "bf16", "fp32"]
ScaleRule = Literal["absmax", "rms", "mse", "wmse"]
LevelsName = Literal["sig", "lm", "cal"]
AnchorMode = Literal["none", "rms", "score"]

SCALE_BITS = {"e4m3": 8, "e8m0": 8, "bf16": 16, "fp32": 32}
# Bits of one sparse outlier: a 16-bit position inside its page and head plus a bf16 value.
OUTLIER_BITS = 32
# Per-(layer, K|V, head, channel) anchor, stored as fp32 (counted; negligible past ~1k tokens).
ANCHOR_BITS = 32
FULL_PRECISION_BITS = 16  # sinks and tail tokens are bf16


@dataclass(frozen=True)
class Fp2TensorSpec:
    """How one side (K or V) is quantized to FP2.

    `block_axis` 'channel': a block is `block_size` consecutive (rotated) channels of one token;
    'token': `block_size` consecutive tokens of one channel.
    """

    block_axis: BlockAxis = "channel"
    block_size: int = 64
    scale_dtype: ScaleDtype = "e4m3"
    scale_rule: ScaleRule = "mse"
    levels: LevelsName = "lm"
    rotate: bool = True
    anchor: AnchorMode = "none"
    asymmetric: bool = False
    outlier_frac: float = 0.0
    pre_rope: bool = False
    center: bool = False
    feedback: bool = False
    feedback_block: int = 0  # channels a rounding error may reach (feedback.py); 0: the whole head

    def __post_init__(self) -> None:
        if self.block_axis not in ("channel", "token"):
            raise ConfigError(f"block axis must be 'channel' or 'token', got {self.block_axis!r}")
        if self.block_size < 2 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block size must be a power of two >= 2, got {self.block_size}")
        if self.scale_dtype not in SCALE_BITS:
            raise ConfigError(f"scale dtype must be one of {sorted(SCALE_BITS)}, got {self.scale_dtype!r}")
        if self.scale_rule not in ("absmax", "rms", "mse", "wmse"):
            raise ConfigError(f"unknown scale rule {self.scale_rule!r}")
        if self.levels not in ("sig", "lm", "cal"):
            raise ConfigError(f"unknown levels {self.levels!r} (sig, lm, cal)")
        if self.anchor not in ("none", "rms", "score"):
            raise ConfigError(f"unknown anchor mode {self.anchor!r} (none, rms, score)")
        if not 0.0 <= self.outlier_frac < 0.5:
            raise ConfigError(f"outlier fraction must be in [0, 0.5), got {self.outlier_frac}")
        if self.feedback_block < 0:
            raise ConfigError(f"feedback block must be >= 0 (0: the whole head), got {self.feedback_block}")
        if self.feedback_block and not self.feedback:
            # an option that would do nothing: refused rather than silently ignored
            raise ConfigError(
                f"feedback blocks of {self.feedback_block} channels on a side without error feedback "
                "(set fb=1 for that side, or drop its fbblk)",
                field="fbblk",
            )


@dataclass(frozen=True)
class Fp2Spec:
    """The whole FP2 cache format: both sides plus the full-precision regions and paging."""

    k: Fp2TensorSpec = field(default_factory=lambda: Fp2TensorSpec())
    v: Fp2TensorSpec = field(default_factory=lambda: Fp2TensorSpec())
    num_sinks: int = 4
    tail_tokens: int = 32
    window: int = 0
    page_size: int = 64
    seed: int = 0
    per_layer_rotation: bool = True

    def __post_init__(self) -> None:
        if self.num_sinks < 0 or self.window < 0:
            raise ConfigError(f"sinks and window must be >= 0, got {self.num_sinks}, {self.window}")
        if self.page_size % 32 or self.page_size <= 0:
            raise ConfigError(f"page size must be a positive multiple of 32, got {self.page_size}")
        if self.tail_tokens < 1 or self.page_size % self.tail_tokens:
            raise ConfigError(
                f"tail ({self.tail_tokens} tokens) must divide the page size ({self.page_size})"
            )
        for name, side in (("k", self.k), ("v", self.v)):
            if side.block_axis == "token" and self.tail_tokens % side.block_size:
                raise ConfigError(
                    f"{name} blocks of {side.block_size} tokens must divide the tail ({self.tail_tokens})"
                )
        if self.v.pre_rope:
            raise ConfigError("pre-RoPE applies to keys only")


@dataclass(frozen=True)
class DenseSpec:
    """Unquantized (bf16/fp32) or FP8 e4m3 storage."""

    dtype: Literal["bf16", "fp32", "fp8"] = "bf16"


@dataclass(frozen=True)
class IntSpec:
    """Asymmetric uniform INT-N with one fp16 scale and one fp16 zero per group.

    `k_axis`/`v_axis` 'channel': groups of `group` channels of one token; 'token': groups of
    `group` tokens of one channel. `recent`: newest tokens kept in fp16 (flushed `recent` at a time).
    `window`: tokens that always stay in fp16 besides the unflushed ones (0: KIVI's own rule, the
    residual fills to `recent` then is quantized whole; `recent=32,window=96` keeps the same 127
    fp16 rows but every query sees at least 96 recent tokens in fp16).
    """

    bits: int = 4
    group: int = 32
    k_axis: BlockAxis = "channel"
    v_axis: BlockAxis = "channel"
    recent: int = 0
    window: int = 0

    def __post_init__(self) -> None:
        if self.bits not in (2, 3, 4, 8):
            raise ConfigError(f"INT bits must be 2, 3, 4 or 8, got {self.bits}")
        if self.k_axis == "token" and (self.recent < self.group or self.recent % self.group):
            raise ConfigError("per-channel INT keys need recent to be a multiple of the group")
        if self.window < 0:
            raise ConfigError(f"window must be >= 0, got {self.window}")


KVSpec = Fp2Spec | DenseSpec | IntSpec


@dataclass(frozen=True)
class ParsedKV:
    """A parsed `--kv` string: its canonical text and the spec."""

    text: str
    spec: KVSpec


def _flag(value: str, key: str) -> bool:
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"'{key}' takes 0 or 1, got {value!r}", field=key)


def _block(value: str, key: str) -> tuple[BlockAxis, int]:
    axis = {"c": "channel", "t": "token"}.get(value[:1])
    if axis is None or not value[1:].isdigit():
        raise ConfigError(f"'{key}' takes c<n> (channels) or t<n> (tokens), got {value!r}", field=key)
    return axis, int(value[1:])  # type: ignore[return-value]


def _parse_options(body: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, body.split(",")):
        if "=" not in item:
            raise ConfigError(f"option {item!r} is not key=value")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def _side_value(base: str, key: str, value: str) -> dict:
    if base == "blk":
        axis, size = _block(value, key)
        return {"block_axis": axis, "block_size": size}
    if base in ("rot", "asym", "prerope", "center", "fb"):
        return {_SIDE_KEYS[base]: _flag(value, key)}
    if base == "out":
        return {"outlier_frac": float(value)}
    if base == "fbblk":
        return {"feedback_block": int(value)}
    return {_SIDE_KEYS[base]: value}


def _side_updates(opts: dict[str, str], prefix: str) -> dict:
    """Options for one side: bare keys apply to both, `k...`/`v...` keys override for one."""
    upd: dict = {}
    for key, value in opts.items():
        if key in _SIDE_KEYS and not (key == "prerope" and prefix == "v"):
            upd.update(_side_value(key, key, value))
    for key, value in opts.items():
        if key[:1] == prefix and key[1:] in _SIDE_KEYS:
            upd.update(_side_value(key[1:], key, value))
    has_feedback = upd.get("feedback", getattr(DEFAULT_SPEC, prefix).feedback)
    if "fbblk" in opts and f"{prefix}fbblk" not in opts and not has_feedback:
        # the bare fbblk reaches only the sides with feedback (`kfb=1,fbblk=32`: keys' blocks);
        # a side's own `Xfbblk` without feedback is refused (Fp2TensorSpec)
        upd.pop("feedback_block")
    return upd


_SIDE_KEYS = {
    "blk": "block",
    "scale": "scale_dtype",
    "rule": "scale_rule",
    "levels": "levels",
    "rot": "rotate",
    "anchor": "anchor",
    "asym": "asymmetric",
    "out": "outlier_frac",
    "prerope": "pre_rope",
    "center": "center",
    "fb": "feedback",
    "fbblk": "feedback_block",
}
_GLOBAL_KEYS = {"sinks", "tail", "window", "page", "seed", "layerrot"}

# The default FP2 configuration, chosen by measurement on the development split (docs/kv-quality.md):
# error-feedback rounding on both sides and a 47-token bf16 window flushed one token at a time,
# 2.49 bits/elem all-in at 2k. It needs calibration constants (the feedback factors); the bare
# "fp2" is the calibration-free configuration the CUDA kernels read and write today.
DEFAULT_FP2 = "fp2:fb=1,tail=1,window=47"

# Tokens per KV page where neither the engine's caller nor the topology says (EngineConfig, KvSpec);
# the served SmolLM2 shape's measured split tables are for pages of this size.
DEFAULT_PAGE_SIZE = 32

# The engine's KV page formats by name (`--kv`, a topology's `kv.format`); FP2 also as fp2:OPTIONS.
ENGINE_KV_FORMATS = ("fp2", "fp8", "bf16", "fp16", "fp32")
# Those the engine keeps in plain torch pages of any size (runtime/engine/kv.py, `make_kv_partition`);
# the others live in this package's paged caches, under `check_paged_kv`.
TORCH_PAGED_FORMATS = ("fp16", "fp32")


def check_engine_kv_format(text: str, page_size: int | None = None) -> str:
    """`text` if the engine serves it: one of ENGINE_KV_FORMATS or an FP2 spec `fp2:key=value,...`;
    with `page_size`, also in pages of that many tokens.

    Raises:
        ConfigError: anything else (the message names the value and what was expected; a page
            size the format cannot take has field "page_size", see `check_paged_kv`).
    """
    if text not in ENGINE_KV_FORMATS and not text.startswith("fp2:"):
        hint = difflib.get_close_matches(text, ENGINE_KV_FORMATS, n=1, cutoff=0.6)
        maybe = f"; did you mean '{hint[0]}'?" if hint else ""
        raise ConfigError(f"{text!r}: expected one of {', '.join(ENGINE_KV_FORMATS)} or fp2:OPTIONS{maybe}")
    if text in TORCH_PAGED_FORMATS:
        return text
    spec = parse_kv_spec(text).spec
    if page_size is not None:
        check_paged_kv(page_size, spec if isinstance(spec, Fp2Spec) else None)
    return text


def check_paged_kv(page_size: int, fp2: Fp2Spec | None = None) -> None:
    """What the paged caches (cache.py: bf16, fp8 and FP2 pages) take beyond a valid spec. The
    caches check it when built, and a topology's `kv` section when loaded, so both refuse alike.

    Args:
        page_size: tokens per page.
        fp2: the format, for an FP2 cache.

    Raises:
        ConfigError: a page size not a positive multiple of 32 (field "page_size"); with `fp2`,
            outliers or pre-RoPE keys (the paged FP2 cache stores neither), or a tail that does
            not divide the page.
    """
    if page_size <= 0 or page_size % 32:
        raise ConfigError(f"page size must be a positive multiple of 32, got {page_size}", field="page_size")
    if fp2 is None:
        return
    for name, side in (("k", fp2.k), ("v", fp2.v)):
        if side.outlier_frac > 0 or side.pre_rope:
            raise ConfigError(f"the paged FP2 cache does not support outliers or pre-RoPE ({name})")
    if page_size % fp2.tail_tokens:
        raise ConfigError(f"tail of {fp2.tail_tokens} tokens must divide the page size {page_size}")


def parse_kv_spec(text: str) -> ParsedKV:
    """Parse a `--kv` string into a spec.

    Raises:
        ConfigError: unknown name or option, or an invalid value (message names it).
    """
    name, _, body = text.strip().partition(":")
    opts = _parse_options(body)
    name = name.lower()
    if name in ("bf16", "fp32", "fp8"):
        if opts:
            raise ConfigError(f"{name} takes no options, got {sorted(opts)}")
        return ParsedKV(text, DenseSpec(dtype=name))  # type: ignore[arg-type]
    if name in ("int2", "int3", "int4", "int8", "kivi2"):
        base = IntSpec(bits=2, group=32, k_axis="token", v_axis="channel", recent=128)
        if name != "kivi2":
            base = IntSpec(bits=int(name[3:]), group=32)
        try:
            upd = {
                "group": int(opts.pop("g", base.group)),
                "recent": int(opts.pop("recent", base.recent)),
                "window": int(opts.pop("window", base.window)),
            }
        except ValueError as err:
            raise ConfigError(f"{text}: {err}") from None
        if opts:
            raise ConfigError(f"unknown options for {name}: {sorted(opts)} (g, recent, window)")
        return ParsedKV(text, replace(base, **upd))
    if name != "fp2":
        raise ConfigError(f"unknown KV format {name!r} (bf16, fp32, fp8, int2/3/4/8, kivi2, fp2)")
    for key in opts:
        core = key[1:] if key[:1] in "kv" and key[1:] in _SIDE_KEYS else key
        if core not in _SIDE_KEYS and key not in _GLOBAL_KEYS:
            raise ConfigError(f"unknown fp2 option {key!r}", field=key)
    try:
        k = replace(DEFAULT_SPEC.k, **_side_updates(opts, "k"))
        v = replace(DEFAULT_SPEC.v, **_side_updates(opts, "v"))
        if "fbblk" in opts and not (k.feedback or v.feedback):
            raise ConfigError(f"{text}: fbblk on a format without error feedback (set fb=1)", field="fbblk")
        spec = replace(
            DEFAULT_SPEC,
            k=k,
            v=v,
            num_sinks=int(opts.get("sinks", DEFAULT_SPEC.num_sinks)),
            tail_tokens=int(opts.get("tail", DEFAULT_SPEC.tail_tokens)),
            window=int(opts.get("window", DEFAULT_SPEC.window)),
            page_size=int(opts.get("page", DEFAULT_SPEC.page_size)),
            seed=int(opts.get("seed", DEFAULT_SPEC.seed)),
            per_layer_rotation=_flag(opts.get("layerrot", "1" if DEFAULT_SPEC.per_layer_rotation else "0"), "layerrot"),
        )
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{text}: {err}") from None
    return ParsedKV(text, spec)


DEFAULT_SPEC = Fp2Spec()


@dataclass(frozen=True)
class TailRule:
    """Which tokens are held in 16-bit precision, for any scheme.

    The first `num_sinks` tokens always; of the rest, tokens are quantized `flush` at a time once
    `window` newer tokens exist. With n tokens present, `num_quantized(n)` of them (those right after
    the sinks) are quantized and the remaining newest ones sit in the tail, at most
    window + flush - 1 of them.
    """

    num_sinks: int = 0
    window: int = 0
    flush: int = 1

    def num_quantized(self, n: int) -> int:
        m = n - self.num_sinks - self.window
        return 0 if m <= 0 else m // self.flush * self.flush

    @property
    def tail_rows(self) -> int:
        return self.window + self.flush - 1

    @property
    def hp_rows(self) -> int:
        """Rows of the 16-bit region: sinks plus the largest tail."""
        return self.num_sinks + self.tail_rows


def tail_rule(spec: KVSpec) -> TailRule:
    """The full-precision rule of a scheme (dense formats: nothing is ever quantized)."""
    if isinstance(spec, Fp2Spec):
        return TailRule(spec.num_sinks, spec.window, spec.tail_tokens)
    if isinstance(spec, IntSpec):
        return TailRule(0, spec.window, max(spec.recent, 1))
    return TailRule()


def bits_per_elem(spec: KVSpec, ctx: int, head_dim: int = 64) -> float:
    """All-inclusive storage bits per cached K or V element at context `ctx` (K and V averaged).

    Counts codes, every scale / zero point / offset, anchors, sparse outliers, and every token held
    in 16-bit precision (sinks plus the largest tail, `TailRule.hp_rows`). Per-layer constants (4 levels per
    side, rotation signs) are counted per (layer, head) as if a model had one KV head: an upper bound.
    """
    if ctx <= 0:
        raise ConfigError(f"context must be positive, got {ctx}")
    if isinstance(spec, DenseSpec):
        per = {"bf16": 16.0, "fp32": 32.0, "fp8": 8.0}[spec.dtype]
        return per + (64.0 / (ctx * head_dim) if spec.dtype == "fp8" else 0.0)
    n_fp = min(ctx, tail_rule(spec).hp_rows)
    n_q = ctx - n_fp
    total = 0.0  # bits for one (layer, head), K and V together
    if isinstance(spec, IntSpec):
        for _axis in (spec.k_axis, spec.v_axis):
            total += n_q * head_dim * (spec.bits + 32.0 / spec.group)
    else:
        for side in (spec.k, spec.v):
            n = n_q * head_dim
            per_block = SCALE_BITS[side.scale_dtype] * (2 if side.asymmetric else 1)
            total += n * (2.0 + per_block / side.block_size + side.outlier_frac * OUTLIER_BITS)
            total += head_dim * ANCHOR_BITS * (2 if side.center else 1) + 4 * 16 + (head_dim if side.rotate else 0)
    total += 2 * n_fp * head_dim * FULL_PRECISION_BITS
    return total / (2 * ctx * head_dim)
