"""Which ranks host which routed expert, as the weights are loaded: an `ExpertLayout` (the
topology's type, runtime/topology/placement.py).

The topology's layout when it places as many experts as the model has, its replicas included (a
replica's rank loads that expert's weights too, and the dispatch spreads the expert's tokens over
its owners: runtime/comm/layout.py); otherwise contiguous blocks, the first E % W ranks one expert
more. With more ranks than experts (W > E) the first E ranks host one each and the last W - E none
(on several nodes, the last nodes then host no expert: a topology's `experts` section places them
otherwise); a rank without experts still joins every MoE step.
"""

from __future__ import annotations

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.topology.placement import ExpertLayout, build_layout


def expert_layout(num_experts: int, world_size: int, topology: object | None = None) -> ExpertLayout:
    """The topology's placement when it has `num_experts` experts, else contiguous blocks.

    Raises:
        ConfigError: the topology places the experts over another number of ranks.
    """
    experts = getattr(topology, "experts", None)
    if experts is not None and experts.num_experts == num_experts:
        if experts.world_size != world_size:
            raise ConfigError(
                f"the topology places {num_experts} experts over {experts.world_size} ranks, the job has {world_size}"
            )
        return experts
    return build_layout(num_experts, world_size, "contiguous", allow_uneven=True)
