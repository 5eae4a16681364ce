"""Tensor sources: where checkpoint tensors come from, read lazily and in slices.

A source answers, by Hugging Face tensor name: is it there, what shape, and "read rows a:b (or
experts [e...]) of it". `SafetensorsDir` memory-maps the shards (`safe_open`) and slices before
copying, so a rank touches only the bytes of its own experts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import torch

from zerodram.runtime.errors import ConfigError

# Safetensors dtypes read as they are; anything else (float8, integers) is quantized data whose
# scales this loader does not apply.
_FLOAT_DTYPES = ("F32", "F16", "BF16")


class TensorSource(Protocol):
    path: Path  # the checkpoint, for error messages

    def has(self, name: str) -> bool: ...

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(
        self, name: str, dim0: slice | list[int] | None = None, dim1: slice | None = None
    ) -> torch.Tensor:
        """The tensor, optionally restricted along dim 0 (rows / experts) and dim 1."""
        ...


class SafetensorsDir:
    """A Hugging Face checkpoint directory: `config.json` plus `*.safetensors` shards.

    Raises:
        ConfigError: no config.json or no safetensors shard in `path`, a shard that is not a
            readable safetensors file, or one tensor in two shards.
    """

    def __init__(self, path: str | Path) -> None:
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise ConfigError(f"{self.path} has no config.json (expected a Hugging Face checkpoint dir)")
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise ConfigError(f"{self.path} has no *.safetensors shards (only safetensors are supported)")
        self._handles = {}
        self._where: dict[str, str] = {}
        for shard in shards:
            try:
                handle = self._handles[shard.name] = safe_open(str(shard), framework="pt")
            except (SafetensorError, OSError) as err:
                raise ConfigError(f"{shard}: not a readable safetensors file: {err}") from None
            for key in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                if key in self._where:  # which copy is right is unknowable; refuse rather than guess
                    raise ConfigError(
                        f"{self.path}: tensor {key!r} is in two shards: {self._where[key]} and {shard.name}"
                    )
                self._where[key] = shard.name

    def config_dict(self) -> Any:
        """config.json as parsed JSON (any JSON value: `ModelConfig.from_hf_dict` checks it)."""
        path = self.path / "config.json"
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"not valid JSON: {err.msg}", path=str(path), line=err.lineno, column=err.colno
            ) from None

    def has(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def _slice(self, name: str):
        try:
            sl = self._handles[self._where[name]].get_slice(name)
        except KeyError:
            raise ConfigError(f"{self.path}: checkpoint has no tensor {name!r}") from None
        if sl.get_dtype() not in _FLOAT_DTYPES:
            raise ConfigError(
                f"{self.path / self._where[name]}: tensor {name!r} is {sl.get_dtype()}; only "
                f"{', '.join(_FLOAT_DTYPES)} tensors are supported (quantized checkpoints are not)"
            )
        return sl

    def read(
        self, name: str, dim0: slice | list[int] | None = None, dim1: slice | None = None
    ) -> torch.Tensor:
        sl = self._slice(name)
        if isinstance(dim0, list):
            return (
                torch.stack([self.read(name, slice(i, i + 1), dim1)[0] for i in dim0])
                if dim0
                else (torch.empty(0, *self.shape(name)[1:]))
            )
        d0 = dim0 if dim0 is not None else slice(None)
        if dim1 is not None:
            return sl[d0, dim1]
        return sl[d0]

    def close(self) -> None:
        self._handles.clear()
