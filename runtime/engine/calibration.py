"""KV calibration: the per-layer FP2 constants a format needs, from a full-precision prefill.

Shape legend: T calibration tokens, C tokens of one chunk, Ly layers, Hq query heads, Hkv KV heads,
Dh head dim.

FP2 formats with error feedback, centers, calibrated levels or non-trivial anchors (the default,
`format.DEFAULT_FP2`, uses feedback) need statistics of the model's queries, keys and values
(runtime/kv/params.py). The engine gets them here, once, after the weights load: the model prefills
`tokens` tokens of a fixed text (the tail of CPython's `pydoc_data` help texts, the same source the
quality harness calibrates on; seeded random ids for a model without tokenizer) through plain
full-precision paged attention, whose probe records each layer's q, k, v; `params.layer_params`
turns them into `(k_params, v_params)` per layer, exactly as the harness does.

Several ranks: rank 0 computes and broadcasts (a gloo group), the other ranks run the same number
of empty forwards so that the MoE collectives inside the prefill stay matched. Every rank must hold
identical constants (a request's output must not depend on the rank serving it), and recomputing
on every rank would not guarantee it: expert GEMMs over differently sized batches may round
differently. It is also cheaper: the experts see one copy of the text, not one per rank.

Params can be saved to / loaded from a safetensors file (`save_kv_params`, `load_kv_params`), so a
server can start without the prefill; the file records the format and the model's shapes and is
refused when they differ.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv.format import Fp2Spec, parse_kv_spec
from zerodram.runtime.kv.params import LayerSample, layer_params, needs_calibration
from zerodram.runtime.kv.quantize import SideParams
from zerodram.runtime.model.attention import PagedAttention
from zerodram.runtime.model.batch import ForwardBatch
from zerodram.runtime.model.transformer import Transformer

log = logging.getLogger("zerodram.engine")

# Half the harness's 2048 (runtime/kv_eval/run.py): on SmolLM2 the default's quality is the same
# (teacher-forced through the engine, 768 tokens: +1.48% perplexity with 1024, +1.55% with 2048,
# +2.9% with 512) and its prefill takes ~3 s on 2 CPU cores instead of ~8 s.
CALIB_TOKENS = 1024
_PAGE = 32  # page size of the scratch full-precision cache of the prefill
_CHARS_PER_TOKEN = 8  # generous: text taken from the end of pydoc before tokenizing (~3.5 needed)

LayerParams = tuple[SideParams, SideParams]


@dataclass(frozen=True)
class KVCalibration:
    """What the engine's calibration step did. params: (k, v) per layer, on the CPU;
    source: 'computed' or the file it was loaded from; summary: the one line the engine logs."""

    params: tuple[LayerParams, ...]
    source: str
    num_tokens: int
    seconds: float
    summary: str


def calibration_ids(tokenizer: Any | None, vocab_size: int, num_tokens: int) -> list[int]:
    """The calibration tokens: the last `num_tokens` of the pydoc help texts, or seeded random ids
    in [0, vocab_size) without a tokenizer.

    Raises:
        ConfigError: the text is missing or too short.
    """
    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab_size, (num_tokens,), generator=gen).tolist()
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise ConfigError(
            "KV calibration reads CPython's pydoc_data, which this Python lacks; "
            "pass --kv-calibration PATH (a saved file) or none"
        ) from None
    text = "\n".join(topics.values())[-num_tokens * _CHARS_PER_TOKEN :]
    ids = tokenizer.encode(text)[1:]  # the first token may be a cut word
    if len(ids) < num_tokens:
        raise ConfigError(f"calibration text holds {len(ids)} tokens, {num_tokens} requested")
    return ids[-num_tokens:]


class _Recorder:
    """The probe of the calibration prefill: keeps each layer's q, k, v (the attention's inputs)."""

    def __init__(self) -> None:
        self.chunks: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.chunks.setdefault(layer_idx, []).append((q, k, v))  # [C, Hq, Dh], [C, Hkv, Dh] x2

    def sample(self, layer_idx: int, o_proj: torch.Tensor) -> LayerSample:
        q, k, v = (torch.cat(x) for x in zip(*self.chunks.pop(layer_idx), strict=True))  # [T, ...]
        return LayerSample.from_attention(q, k, v, o_proj=o_proj)


def _prefill(model: Transformer, ids: list[int] | None, num_chunks: int, chunk: int, probe: Any) -> None:
    """`num_chunks` forwards of `ids` in chunks of `chunk` tokens over a full-precision scratch
    cache (ids None: empty forwards, what the ranks that do not compute run)."""
    from zerodram.runtime.engine.kv import TorchPagedKV

    mc, dev = model.config, model.device
    n = len(ids) if ids is not None else 0
    kv = TorchPagedKV(
        mc.num_layers, mc.num_kv_heads, mc.head_dim, max(1, math.ceil(n / _PAGE)), _PAGE, "fp32", model.dtype, dev
    )
    if n:
        kv.reserve(0, n)
    attn = PagedAttention(kv, mc.head_dim**-0.5)
    attn.probe = probe
    for c in range(num_chunks):
        part = ids[c * chunk : (c + 1) * chunk] if ids is not None else []
        batch = ForwardBatch.build([], [(0, c * chunk, part)] if part else [], [False] if part else [], dev)
        model.forward(batch, attn)


@torch.inference_mode()
def calibrate_kv(
    model: Transformer, spec: Fp2Spec, ids: list[int], *, chunk: int = 256, ctx: Any | None = None
) -> tuple[LayerParams, ...]:
    """Per-layer (k_params, v_params) of `spec` from a full-precision prefill of `ids`.

    model: this rank's Transformer; ids: the calibration tokens (rank 0's count the chunks);
    chunk: tokens per forward (at most the engine's max_step_tokens: the EP buffers' bound);
    ctx: the rank context; with several ranks this is collective (see the module docstring).
    Returns params on the CPU, identical on every rank.

    Raises:
        ConfigError: pre-RoPE keys (the paged cache rejects them), or a rank exchange failed.
    """
    if spec.k.pre_rope:
        raise ConfigError("pre-RoPE keys (kprerope=1) are harness-only: the paged cache rejects them")
    rank, world = getattr(ctx, "rank", 0), getattr(ctx, "world_size", 1)
    num_chunks = math.ceil(len(ids) / chunk)
    if world > 1:  # every rank must run as many forwards as rank 0
        num_chunks = _broadcast(ctx, num_chunks)
    params = None
    if rank == 0:
        rec = _Recorder()
        _prefill(model, ids, num_chunks, chunk, rec)
        mc = model.config
        params = tuple(
            layer_params(spec, i, mc.num_kv_heads, mc.head_dim, rec.sample(i, layer.o))
            for i, layer in enumerate(model.layers)
        )
    else:
        _prefill(model, None, num_chunks, chunk, None)
    if world > 1:
        params = _broadcast(ctx, params)
    return params


def _broadcast(ctx: Any, obj: Any) -> Any:
    """Rank 0's `obj` on every rank, over the CPU (gloo) group; bounded by the group's timeout."""
    import torch.distributed as dist

    from zerodram.runtime.errors import RankTimeoutError

    group = getattr(ctx, "cpu_group", None)  # the gloo group beside NCCL; None: the default group
    box = [obj]
    try:
        dist.broadcast_object_list(box, src=0, group=group)
    except RuntimeError as err:
        raise RankTimeoutError(
            f"rank {ctx.rank}/{ctx.world_size}: KV calibration broadcast from rank 0 failed: {err}"
        ) from err
    return box[0]


# --- files --------------------------------------------------------------------------------------

_FIELDS = tuple(f.name for f in fields(SideParams))


def save_kv_params(path: str | Path, params: tuple[LayerParams, ...], kv_format: str, num_tokens: int) -> None:
    """Write `params` as safetensors: tensors `layers.{i}.{k|v}.{field}`, metadata the format."""
    from safetensors.torch import save_file

    tensors = {}
    for i, sides in enumerate(params):
        for name, p in zip("kv", sides, strict=True):
            for f in _FIELDS:
                t = getattr(p, f)
                if t is not None:
                    tensors[f"layers.{i}.{name}.{f}"] = t.detach().cpu().contiguous()
    meta = {"kv_format": kv_format, "num_layers": str(len(params)), "num_tokens": str(num_tokens)}
    save_file(tensors, str(path), metadata=meta)


def load_kv_params(
    path: str | Path, spec: Fp2Spec, num_layers: int, num_kv_heads: int, head_dim: int
) -> tuple[LayerParams, ...]:
    """Read a `save_kv_params` file, checked against the format and the model's shapes.

    Raises:
        ConfigError: missing file, another format, or shapes that differ (both sides named).
    """
    try:
        from safetensors import safe_open
    except ImportError:
        raise ConfigError("loading KV calibration files needs safetensors: pip install safetensors") from None
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"KV calibration file {path} does not exist")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    saved = meta.get("kv_format", "?")
    if saved == "?" or parse_kv_spec(saved).spec != spec:
        raise ConfigError(f"KV calibration file {path} is for format {saved!r}, the engine serves another")
    if int(meta.get("num_layers", -1)) != num_layers:
        raise ConfigError(f"KV calibration file {path} has {meta.get('num_layers')} layers, the model {num_layers}")
    H, D = num_kv_heads, head_dim
    want = {"levels": (4,), "anchor": (H, D), "rotation": (D, D), "weights": (H, D), "center": (H, D)}
    want["feedback"] = (H, D, D)
    out = []
    for i in range(num_layers):
        sides = []
        for name in "kv":
            got = {f: tensors.get(f"layers.{i}.{name}.{f}") for f in _FIELDS}
            for f, t in got.items():
                if t is not None and tuple(t.shape) != want[f]:
                    raise ConfigError(
                        f"KV calibration file {path}: layers.{i}.{name}.{f} is {tuple(t.shape)}, "
                        f"the model needs {want[f]}"
                    )
            if got["levels"] is None or got["anchor"] is None:
                raise ConfigError(f"KV calibration file {path} lacks layer {i}'s {name} levels or anchor")
            sides.append(SideParams(**got))
        out.append(tuple(sides))
    return tuple(out)


# --- the engine's step ---------------------------------------------------------------------------


def engine_calibration(
    model: Transformer,
    kv_format: str,
    mode: str,
    *,
    tokenizer: Any | None = None,
    ctx: Any | None = None,
    num_tokens: int = CALIB_TOKENS,
    chunk: int = 256,
    save_path: str | None = None,
) -> KVCalibration | None:
    """The KV constants the engine passes to its caches, or None (a format that needs none).

    mode: 'auto' (compute when the format needs calibration), 'none' (uncalibrated fallbacks:
    nearest rounding, Lloyd-Max levels, unit anchors), or a path saved by `save_kv_params`.
    save_path: write the params there (rank 0) after computing or loading them.

    Raises:
        ConfigError: a calibration file for another format or model, or mode set for a format
            without FP2 constants.
    """
    spec = parse_kv_spec(kv_format).spec if kv_format.startswith("fp2") else None
    if mode == "none" or (mode == "auto" and (spec is None or not needs_calibration(spec))):
        return None
    if spec is None:
        raise ConfigError(f"--kv-calibration {mode} applies to FP2 formats, not {kv_format!r}")
    t0 = time.perf_counter()
    mc = model.config
    if mode == "auto":
        ids = calibration_ids(tokenizer, mc.vocab_size, num_tokens) if getattr(ctx, "rank", 0) == 0 else []
        params = calibrate_kv(model, spec, ids, chunk=chunk, ctx=ctx)
        source = "computed"
        what = f"computed from {num_tokens} {'pydoc' if tokenizer is not None else 'random'} tokens"
    else:
        params = load_kv_params(mode, spec, mc.num_layers, mc.num_kv_heads, mc.head_dim)
        source, what = mode, f"loaded from {mode}"
    if save_path is not None and getattr(ctx, "rank", 0) == 0:
        save_kv_params(save_path, params, kv_format, num_tokens)
        what += f", saved to {save_path}"
    secs = time.perf_counter() - t0
    summary = f"kv calibration ({kv_format}): {what} in {secs:.1f}s"
    log.info(summary)
    return KVCalibration(params, source, num_tokens, secs, summary)
