"""Expert placement: which rank hosts each expert (its primary owner) and which hold replicas.

Policies (``experts.placement``), for E = num_experts over W = world_size ranks:

    contiguous   rank r hosts the r-th block of experts: [r*E/W, (r+1)*E/W) where W divides E;
                 otherwise (allow_uneven) the first E % W ranks one expert more
    round_robin  expert e lives on rank e % W
    explicit     ``experts.map`` lists rank -> experts; every expert exactly once

contiguous and round_robin need E % W == 0 (equal expert counts keep the per-rank receive buffers
and the compute equal); ``allow_uneven: true`` accepts a remainder: the first E % W ranks then host
one extra expert (contiguous) or the low experts wrap (round_robin). Replicas
(``experts.replicas``: expert -> extra ranks) are redundant copies for hot experts; the primary
comes first in `owners`. ``experts.wire`` is how a token's row travels to them: the engine's
``--ep-wire`` default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from zerodram.runtime.errors import ConfigError

PLACEMENTS = ("contiguous", "round_robin", "explicit")
# Placement tables are O(num_experts) tuples built on every rank; 65536 is 128x the largest MoE
# layers today (256 to 512 routed experts) and keeps a typo (4000000000) from eating the memory.
MAX_EXPERTS = 65536
EP_WIRES = ("bf16", "fp8")  # the dispatch's row formats (runtime/comm's WIRE_FORMATS is this list)


@dataclass(frozen=True)
class ExpertLayout:
    """Where every expert lives. Build with `build_layout`.

    Attributes:
        num_experts: E.
        world_size: W, the ranks the experts are spread over.
        placement: the policy name it was built from.
        expert_to_rank: primary owner per expert, ``[E]``.
        replicas: extra hosting ranks per expert, ``[E][*]`` (mostly empty).
        wire: the dispatch's row format, one of EP_WIRES (`EpLayout`; the engine's `--ep-wire`
            default).
    """

    num_experts: int
    world_size: int
    placement: str
    expert_to_rank: tuple[int, ...]
    replicas: tuple[tuple[int, ...], ...]
    wire: str = "bf16"
    _local: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.expert_to_rank) != self.num_experts or len(self.replicas) != self.num_experts:
            raise ConfigError(
                f"placement covers {len(self.expert_to_rank)} of {self.num_experts} experts", field="experts"
            )
        local: list[list[int]] = [[] for _ in range(self.world_size)]
        for e, owners in enumerate(self.owners_all()):
            for rank in owners:
                if not 0 <= rank < self.world_size:
                    raise ConfigError(_no_such_rank(rank, self.world_size), field=f"experts.replicas[{e}]")
                local[rank].append(e)
        object.__setattr__(self, "_local", tuple(tuple(sorted(es)) for es in local))

    def owners(self, expert_idx: int) -> tuple[int, ...]:
        """Ranks hosting `expert_idx`, primary first, replicas after."""
        return (self.expert_to_rank[expert_idx], *self.replicas[expert_idx])

    def owners_all(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.owners(e) for e in range(self.num_experts))

    def local_experts(self, rank: int) -> tuple[int, ...]:
        """Experts hosted on `rank` (primaries and replicas), ascending."""
        return self._local[rank]

    def primary_experts(self, rank: int) -> tuple[int, ...]:
        """Experts whose primary owner is `rank`, ascending."""
        return tuple(e for e in self._local[rank] if self.expert_to_rank[e] == rank)

    @property
    def num_replicas(self) -> int:
        return sum(len(r) for r in self.replicas)


def build_layout(
    num_experts: int,
    world_size: int,
    placement: str,
    *,
    allow_uneven: bool = False,
    explicit_map: Mapping[int, Sequence[int]] | None = None,
    replicas: Mapping[int, Sequence[int]] | None = None,
    wire: str = "bf16",
) -> ExpertLayout:
    """Place `num_experts` experts on `world_size` ranks.

    Args:
        placement: one of PLACEMENTS.
        allow_uneven: accept num_experts % world_size != 0 for contiguous / round_robin.
        explicit_map: rank -> its experts; required for (and only read by) "explicit".
        replicas: expert -> extra ranks holding a copy.
        wire: the dispatch's row format (EP_WIRES).

    Raises:
        ConfigError: with `field` set (``experts.map[3][1]`` ...) for a count outside
            1..MAX_EXPERTS, a rank or expert that does not exist, an expert placed twice or not at
            all, an indivisible count, a bad replica.
    """
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ConfigError(
            f"expected 1 to {MAX_EXPERTS} experts, got {num_experts}", field="experts.num_experts"
        )
    if wire not in EP_WIRES:
        raise ConfigError(f"expected one of {', '.join(EP_WIRES)}, got '{wire}'", field="experts.wire")
    if placement not in PLACEMENTS:
        raise ConfigError(
            f"expected one of {', '.join(PLACEMENTS)}, got '{placement}'", field="experts.placement"
        )
    if placement == "explicit":
        if explicit_map is None:
            raise ConfigError("placement 'explicit' needs 'map' (rank -> experts)", field="experts.map")
        primary = _explicit(num_experts, world_size, explicit_map)
    else:
        if explicit_map is not None:
            raise ConfigError(
                f"'map' is only read with placement 'explicit', not '{placement}'", field="experts.map"
            )
        if num_experts % world_size and not allow_uneven:
            raise ConfigError(
                f"{num_experts} experts do not divide evenly over {world_size} ranks "
                f"({num_experts} % {world_size} = {num_experts % world_size}); use a multiple of "
                f"{world_size}, set 'allow_uneven: true', or give an explicit map",
                field="experts.num_experts",
            )
        if placement == "contiguous":
            primary = _contiguous(num_experts, world_size)
        else:
            primary = tuple(e % world_size for e in range(num_experts))
    extra = _replicas(num_experts, world_size, primary, replicas or {})
    return ExpertLayout(num_experts, world_size, placement, primary, extra, wire)


def _contiguous(num_experts: int, world_size: int) -> tuple[int, ...]:
    # Like numpy.array_split: the first (E % W) ranks take one extra expert.
    base, extra = divmod(num_experts, world_size)
    out: list[int] = []
    for rank in range(world_size):
        out.extend([rank] * (base + (1 if rank < extra else 0)))
    return tuple(out)


def _explicit(
    num_experts: int, world_size: int, explicit_map: Mapping[int, Sequence[int]]
) -> tuple[int, ...]:
    owner: dict[int, int] = {}
    for rank, experts in explicit_map.items():
        if not 0 <= rank < world_size:
            raise ConfigError(_no_such_rank(rank, world_size), field=f"experts.map[{rank}]")
        for i, e in enumerate(experts):
            where = f"experts.map[{rank}][{i}]"
            if not 0 <= e < num_experts:
                raise ConfigError(_no_such_expert(e, num_experts), field=where)
            if e in owner:
                raise ConfigError(
                    f"expert {e} is placed on rank {owner[e]} and again on rank {rank}; list each "
                    f"expert once (use 'replicas' for redundant copies)",
                    field=where,
                )
            owner[e] = rank
    missing = [e for e in range(num_experts) if e not in owner]
    if missing:
        raise ConfigError(
            f"{len(missing)} of {num_experts} experts are not placed on any rank: {format_ranges(missing)}",
            field="experts.map",
        )
    return tuple(owner[e] for e in range(num_experts))


def _replicas(
    num_experts: int, world_size: int, primary: tuple[int, ...], replicas: Mapping[int, Sequence[int]]
) -> tuple[tuple[int, ...], ...]:
    out: list[tuple[int, ...]] = [() for _ in range(num_experts)]
    for e, ranks in replicas.items():
        if not 0 <= e < num_experts:
            raise ConfigError(_no_such_expert(e, num_experts), field=f"experts.replicas[{e}]")
        for i, rank in enumerate(ranks):
            where = f"experts.replicas[{e}][{i}]"
            if not 0 <= rank < world_size:
                raise ConfigError(_no_such_rank(rank, world_size), field=where)
            if rank == primary[e]:
                raise ConfigError(f"rank {rank} is already expert {e}'s primary owner", field=where)
            if rank in ranks[:i]:
                raise ConfigError(f"rank {rank} holds a replica of expert {e} twice", field=where)
        out[e] = tuple(ranks)
    return tuple(out)


def _no_such_rank(rank: int, world_size: int) -> str:
    return f"rank {rank} does not exist (world size {world_size}: ranks 0..{world_size - 1})"


def _no_such_expert(e: int, num_experts: int) -> str:
    return f"expert {e} does not exist (num_experts {num_experts}: experts 0..{num_experts - 1})"


def format_ranges(values: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8" (how placement tables and errors print expert sets)."""
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ", ".join(parts)
