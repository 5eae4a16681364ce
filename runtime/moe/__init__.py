"""Mixture-of-experts: router, SwiGLU experts, the single-process reference, the EP layer.

`EpMoELayer` is imported lazily: the layer depends on `runtime.comm`, which depends on the router.
"""

from typing import Any

from zerodram.runtime.moe.experts import ExpertShard, SharedExpertWeights, grouped_swiglu, has_grouped_mm
from zerodram.runtime.moe.reference import MoEWeights, reference_experts, reference_moe
from zerodram.runtime.moe.router import RouterConfig, gate_logits, route

__all__ = [
    "EpMoELayer",
    "ExpertShard",
    "MoEWeights",
    "RouterConfig",
    "SharedExpertWeights",
    "gate_logits",
    "grouped_swiglu",
    "has_grouped_mm",
    "reference_experts",
    "reference_moe",
    "route",
]


def __getattr__(name: str) -> Any:
    if name == "EpMoELayer":
        from zerodram.runtime.moe.layer import EpMoELayer

        return EpMoELayer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
