"""`ExpertPlacement`: which ranks host which routed expert.

Taken from the topology when it describes as many experts as the model has, its replicas included
(a replica's rank loads that expert's weights too, and the dispatch spreads the expert's tokens over
its owners: runtime/comm/layout.py); otherwise experts are split into contiguous, balanced blocks
(rank r gets experts [r*E/W, (r+1)*E/W)). A rank may host zero experts when W > E: it still joins
every MoE step.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerodram.runtime.errors import ConfigError


@dataclass(frozen=True)
class ExpertPlacement:
    """expert_to_rank[e] is the primary rank hosting expert e; replicas[e] the other ranks that
    host it (() for none: every expert then has one owner)."""

    num_experts: int
    world_size: int
    expert_to_rank: tuple[int, ...]
    replicas: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if len(self.expert_to_rank) != self.num_experts:
            raise ConfigError(
                f"placement names {len(self.expert_to_rank)} experts, the model has {self.num_experts}"
            )
        if self.replicas and len(self.replicas) != self.num_experts:
            raise ConfigError(f"placement lists replicas of {len(self.replicas)} experts, the model has {self.num_experts}")
        bad = [r for r in (*self.expert_to_rank, *(r for rs in self.replicas for r in rs)) if not 0 <= r < self.world_size]
        if bad:
            raise ConfigError(f"placement puts experts on rank {bad[0]}, world size is {self.world_size}")

    def owners(self, expert: int) -> tuple[int, ...]:
        """Ranks hosting `expert`, primary first."""
        return (self.expert_to_rank[expert], *(self.replicas[expert] if self.replicas else ()))

    def local_experts(self, rank: int) -> tuple[int, ...]:
        """Experts whose weights `rank` holds (primaries and replicas), ascending: the local index
        order of the dispatch (runtime/comm/layout.py)."""
        return tuple(e for e in range(self.num_experts) if rank in self.owners(e))

    @classmethod
    def contiguous(cls, num_experts: int, world_size: int) -> ExpertPlacement:
        owner = tuple(min(e * world_size // max(num_experts, 1), world_size - 1) for e in range(num_experts))
        return cls(num_experts, world_size, owner)

    @classmethod
    def for_world(cls, num_experts: int, world_size: int, topology: object | None = None) -> ExpertPlacement:
        """The topology's placement when it has `num_experts` experts, else contiguous blocks."""
        experts = getattr(topology, "experts", None)
        if experts is not None and getattr(experts, "num_experts", None) == num_experts:
            replicas = tuple(tuple(experts.owners(e))[1:] for e in range(num_experts))
            return cls(num_experts, world_size, tuple(int(r) for r in experts.expert_to_rank), replicas)
        return cls.contiguous(num_experts, world_size)
