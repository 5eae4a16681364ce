"""GGUF -> a cached Hugging Face style checkpoint dir, made once and memory-mapped afterwards.

    dir = convert_gguf(path)   # <cache>/models/<stem>-<key>/{config.json, model.safetensors,
                               #   tokenizer.json, tokenizer_config.json}

The key hashes the file's resolved path, size and mtime (and a format version), so a changed file
converts again. The dir is written under a temporary name and renamed into place: concurrent
converters (several ranks, several jobs) never see a half-written dir; the loser discards its copy.
Tensors are stored dequantized in fp32, under Hugging Face names, q/k already in HF row order.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from zerodram.runtime.envs import ENVS

_FORMAT_VERSION = 1


def converted_dir(gguf_path: str | Path) -> Path:
    """Where `convert_gguf` puts (or has put) the converted checkpoint for this file."""
    p = Path(gguf_path).resolve()
    st = p.stat()
    key = hashlib.sha256(f"{p}|{st.st_size}|{st.st_mtime_ns}|{_FORMAT_VERSION}".encode()).hexdigest()[:16]
    return Path(ENVS.CACHE_DIR.get()) / "models" / f"{p.stem}-{key}"


def convert_gguf(gguf_path: str | Path) -> Path:
    """Convert (once) and return the HF-style dir for a GGUF file.

    Raises:
        ConfigError: the GGUF file is unreadable or unsupported (see `GGUFFile`).
    """
    out = converted_dir(gguf_path)
    if (out / "model.safetensors").is_file():
        return out
    from safetensors.torch import save_file

    from zerodram.runtime.loading.gguf_file import GGUFFile

    g = GGUFFile(gguf_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        tensors = {name: g.read(name).contiguous() for name in g.names()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(g.config_dict(), indent=2))
        (tmp / "tokenizer.json").write_text(g.tokenizer_json())
        cfg = g.config_dict()
        tok_cfg = {
            "chat_template": g.chat_template(),
            "bos_token_id": cfg.get("bos_token_id"),
            "eos_token_id": cfg.get("eos_token_id"),
            "source": str(Path(gguf_path).name),
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
        tmp.chmod(0o755)
        try:
            os.rename(tmp, out)
        except OSError:  # another process won the race; its dir is complete
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
