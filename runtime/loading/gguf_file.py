"""GGUF checkpoints through the `gguf` package: config, tensors (dequantized on read), tokenizer.

Architectures: `llama` (dense Llama/SmolLM, and MoE llama-arch files such as Mixtral's, whose
experts are stacked `ffn_*_exps` tensors), `qwen2`, `qwen3` (q/k norms), `qwen2moe` (a gated shared
expert) and `qwen3moe`. Tensors are exposed under Hugging Face names so the one weight builder
(`weights.py`) serves both formats; llama.cpp's interleaved q/k row order for RoPE, which its
converter applies to the llama architecture only, is undone on read. A read of one expert of a stacked tensor slices the quantized bytes before
dequantizing. The engine does not read GGUF per rank: `convert_gguf` dequantizes the whole file
once per node into a cached safetensors dir (`jobs.convert_once_per_node`: local rank 0 converts,
the others wait), from which each rank memory-maps only its own experts.

Tokenizer: GGUF `gpt2` (byte-level BPE) vocabularies are rebuilt as a `tokenizers` BPE with the
same pre-tokenizer and decoder transformers builds for them.

Reading a GGUF header is slow in Python (seconds for a 49k vocab), so `convert_gguf` turns a file
into a cached Hugging Face style dir once and later runs memory-map that.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerodram.runtime.errors import ConfigError

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "attn_q.bias": "self_attn.q_proj.bias",  # qwen2
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",  # qwen2moe
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# GGUF architecture -> Hugging Face model_type (llama with experts is Mixtral)
_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# HF tensors whose GGUF form may drop a leading 1 (the shared expert's [1, D] sigmoid gate)
_ROW_VECTORS = ("mlp.shared_expert_gate.weight",)
_STACKED = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


class GGUFFile:
    """A GGUF file read through `gguf.GGUFReader` (memory-mapped).

    Raises:
        ConfigError: not a GGUF file, or an architecture / tokenizer this runtime does not read.
    """

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except (ValueError, OSError, IndexError) as err:  # IndexError: a header cut short
            raise ConfigError(f"{self.path}: not a readable GGUF file: {err}") from None
        self.arch = _field(self.reader, "general.architecture")
        if self.arch not in _ARCHS:
            raise ConfigError(
                f"{self.path}: GGUF architecture {self.arch!r} not supported (supported: {sorted(_ARCHS)})"
            )
        self._hf = self.hf_config()
        self._tensors: dict[str, Any] = {}
        self._experts: dict[str, tuple[Any, int]] = {}  # HF per-expert name -> (stacked tensor, e)
        for t in self.reader.tensors:
            m = re.match(r"^blk\.(\d+)\.(.+)$", t.name)
            if m is None:
                if t.name in _GLOBAL:
                    self._tensors[_GLOBAL[t.name]] = t
                continue
            layer, rest = m.group(1), m.group(2)
            if rest in _STACKED:
                for e in range(int(t.shape[-1])):
                    self._experts[f"model.layers.{layer}.mlp.experts.{e}.{_STACKED[rest]}.weight"] = (t, e)
            elif rest in _BLOCK:
                self._tensors[f"model.layers.{layer}.{_BLOCK[rest]}"] = t

    def hf_config(self) -> dict[str, Any]:
        """The checkpoint's config in Hugging Face `config.json` spelling."""
        r, a = self.reader, self.arch
        if any(t.name == "rope_freqs.weight" for t in r.tensors):
            raise ConfigError(f"{self.path}: llama3 rope frequency tensors in GGUF are not supported")
        heads = int(self._need(f"{a}.attention.head_count"))
        hidden = int(self._need(f"{a}.embedding_length"))
        tokens = r.fields.get("tokenizer.ggml.tokens")
        cfg: dict[str, Any] = {
            "model_type": _ARCHS[a],
            "hidden_act": "silu",
            "vocab_size": int(_field(r, f"{a}.vocab_size", len(tokens.data) if tokens else 0)),
            "hidden_size": hidden,
            "intermediate_size": int(_field(r, f"{a}.feed_forward_length", 0)),
            "num_hidden_layers": int(self._need(f"{a}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(_field(r, f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(_field(r, f"{a}.attention.key_length", hidden // heads if heads else 0)),
            "rms_norm_eps": float(_field(r, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(_field(r, f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(_field(r, f"{a}.context_length", 4096)),
            "tie_word_embeddings": not any(t.name == "output.weight" for t in r.tensors),
            "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
        }
        scaling = _field(r, f"{a}.rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling not in ("linear", "yarn"):
                raise ConfigError(f"{self.path}: GGUF rope scaling {scaling!r} not supported (linear, yarn)")
            cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(self._need(f"{a}.rope.scaling.factor"))}
            if scaling == "yarn":
                original = _field(r, f"{a}.rope.scaling.original_context_length")
                if original is not None:
                    cfg["rope_scaling"]["original_max_position_embeddings"] = int(original)
        experts = int(_field(r, f"{a}.expert_count", 0) or 0)
        if a == "llama" and experts:
            cfg.update(model_type="mixtral", num_local_experts=experts)
        if experts:
            cfg["num_experts_per_tok"] = int(self._need(f"{a}.expert_used_count"))
        if a in ("qwen2moe", "qwen3moe"):
            cfg.update(
                num_experts=experts,
                moe_intermediate_size=int(self._need(f"{a}.expert_feed_forward_length")),
                # llama.cpp renormalises the top-k of qwen3moe, not of qwen2moe, unless the file says
                norm_topk_prob=bool(_field(r, f"{a}.expert_weights_norm", a == "qwen3moe")),
            )
            if a == "qwen2moe":
                cfg["shared_expert_intermediate_size"] = int(
                    _field(r, f"{a}.expert_shared_feed_forward_length", 0)
                )
        if a.startswith("qwen2"):
            cfg["qkv_bias"] = any(t.name.endswith("attn_q.bias") for t in r.tensors)
        return cfg

    def _need(self, key: str) -> Any:
        value = _field(self.reader, key)
        if value is None:
            raise ConfigError(f"{self.path}: GGUF header has no {key!r} (required)")
        return value

    def config_dict(self) -> dict[str, Any]:
        return dict(self._hf)

    def names(self) -> list[str]:
        """Every tensor name, in Hugging Face spelling (stacked experts listed one by one)."""
        return [*self._tensors, *self._experts]

    def has(self, name: str) -> bool:
        return name in self._tensors or name in self._experts

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._experts:
            t, _ = self._experts[name]
            return tuple(int(s) for s in reversed(t.shape[:-1]))
        shape = tuple(int(s) for s in reversed(self._tensor(name).shape))
        return (1, *shape) if name.endswith(_ROW_VECTORS) and len(shape) == 1 else shape

    def _tensor(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise ConfigError(f"{self.path}: GGUF has no tensor for {name!r}") from None

    def read(
        self, name: str, dim0: slice | list[int] | None = None, dim1: slice | None = None
    ) -> torch.Tensor:
        from gguf.quants import dequantize

        if name in self._experts:
            t, e = self._experts[name]
            full = torch.from_numpy(np.array(dequantize(t.data[e], t.tensor_type), dtype=np.float32))
        else:
            t = self._tensor(name)
            full = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
            full = full.reshape(self.shape(name))
            if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = (
                    self._hf["num_attention_heads"] if "q_proj" in name else self._hf["num_key_value_heads"]
                )
                full = _unpermute_rope_rows(full, heads)
        if isinstance(dim0, list) or dim0 is not None:
            full = full[dim0]
        if dim1 is not None:
            full = full[:, dim1]
        return full.float()

    def tokenizer_json(self) -> str:
        """The vocabulary as a `tokenizers` JSON string (byte-level BPE)."""
        return gguf_tokenizer_json(self.reader, self.path)

    def chat_template(self) -> str | None:
        return _field(self.reader, "tokenizer.chat_template")


def _unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: rows (h, pair, 2) back to (h, 2, pair)."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# Qwen2/3's split pattern (their tokenizer.json), for GGUF files whose `tokenizer.ggml.pre` is
# "qwen2": single digits, letters with one leading non-letter, contractions, newline runs.
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def gguf_tokenizer_json(reader: Any, path: Path) -> str:
    """Rebuild a GGUF `gpt2` vocabulary as a `tokenizers` byte-level BPE (JSON string). The
    pre-tokenizer follows `tokenizer.ggml.pre`: Qwen's split for "qwen2", GPT-2's otherwise."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(f"{path}: GGUF tokenizer model {kind!r} not supported (supported: gpt2)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ConfigError(f"{path}: GGUF has no tokenizer.ggml.tokens (the vocabulary)")
    # no merges: a vocabulary of whole tokens (writers omit an empty array)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    if _field(reader, "tokenizer.ggml.pre") == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # CONTROL (3) tokens are special; USER_DEFINED (4) are added but not special.
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == 3
        ]
    )
    tok.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types, strict=True) if ty == 4])
    return tok.to_str()
