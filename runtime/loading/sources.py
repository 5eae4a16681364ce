"""Tensor sources: where checkpoint tensors come from, read lazily and in slices.

A source answers, by Hugging Face tensor name: is it there, what shape, and "read rows a:b (or
experts [e...]) of it". `SafetensorsDir` memory-maps the shards (`safe_open`) and slices before
copying, so a rank touches only the bytes of its own experts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch

from zerodram.runtime.errors import ConfigError


class TensorSource(Protocol):
    def has(self, name: str) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(
        self, name: str, dim0: slice | list[int] | None = None, dim1: slice | None = None
    ) -> torch.Tensor:
        """The tensor, optionally restricted along dim 0 (rows / experts) and dim 1."""
        ...


class SafetensorsDir:
    """A Hugging Face checkpoint directory: `config.json` plus `*.safetensors` shards.

    Raises:
        ConfigError: no config.json or no safetensors shard in `path`.
    """

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise ConfigError(f"{self.path} has no config.json (expected a Hugging Face checkpoint dir)")
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise ConfigError(f"{self.path} has no *.safetensors shards (only safetensors are supported)")
        self._handles = {s.name: safe_open(str(s), framework="pt") for s in shards}
        self._where: dict[str, str] = {}
        for shard, handle in self._handles.items():
            for key in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                self._where[key] = shard

    def config_dict(self) -> dict:
        return json.loads((self.path / "config.json").read_text())

    def has(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def _slice(self, name: str):
        try:
            return self._handles[self._where[name]].get_slice(name)
        except KeyError:
            raise ConfigError(f"{self.path}: checkpoint has no tensor {name!r}") from None

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
