"""`Tokenizer`: text <-> token ids for a checkpoint dir, plus its chat template.

Reads `tokenizer.json` with the `tokenizers` library (no transformers import: it is slow to import
on every rank) and `tokenizer_config.json`'s `chat_template`, rendered with jinja2 the way
transformers renders it (messages, add_generation_prompt, bos/eos tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

from zerodram.runtime.errors import ConfigError


class Tokenizer:
    """Encode / decode / chat-format for one checkpoint.

    Raises:
        ConfigError: the dir has no tokenizer.json.
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ConfigError(f"{path} has no tokenizer.json")
        self._tok = _Tok.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        self.bos_token_id: int | None = cfg.get("bos_token_id")
        eos = cfg.get("eos_token_id")
        self.eos_token_ids: tuple[int, ...] = (
            tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `messages` rendered with the chat template (plain concatenation without one)."""
        if not self.chat_template:
            return self.encode("\n".join(m["content"] for m in messages))
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        bos = self._tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self._tok.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        text = env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
        )
        return self.encode(text)
