"""The dispatch ring: which peer every rank sends to at each step.

A schedule has `world_size` steps. ``steps[s][src]`` is the rank that `src` targets at step `s`;
step 0 is every rank itself (its local experts). Two properties make a schedule usable by the
dispatch kernels, and both are checked for every schedule, derived or listed:

- each step is a permutation of the ranks, so at every step every rank receives from exactly one
  peer (no two senders collide on one receiver's link), and every step after 0 is a derangement
  (no rank is idle talking to itself);
- each rank's visit order ``peers(rank)`` is a permutation of all ranks starting with itself, so
  after the last step every pair has met exactly once.

The derived rule (docs/topology.md, "Ring order"): with ``L = ranks_per_node`` and ``N = num_nodes``,
write rank ``r = n*L + l`` (node n, local rank l) and step ``s = j*L + k``. Then

    steps[s][n*L + l] = ((n + j) % N) * L + (l + k) % L

Steps 1..L-1 (j = 0) stay on the node, NVLink/same-GPU peers, one past itself first; each later
block of L steps moves to the next node (j = 1, 2, ...), starting at the same local rank, i.e.
the same rail when local rank l uses rail l on every node, so the first inter-node step of each
block needs no rail crossing. Each step is the product of a node shift and a local shift, hence
a permutation, and a derangement whenever (j, k) != (0, 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zerodram.runtime.errors import ConfigError

RING_ORDERS = ("derived", "explicit")


@dataclass(frozen=True)
class RingSchedule:
    """A checked ring schedule.

    Attributes:
        order: "derived" (the rule above) or "explicit" (listed in the YAML).
        steps: ``steps[s][src_rank]`` = destination rank at step s; ``len(steps) == world_size``.

    Raises:
        ConfigError: (field ``ring.peers[...]``) a step is not a permutation, step 0 is not the
            identity, or a rank's visit order misses or repeats a peer.
    """

    order: str
    steps: tuple[tuple[int, ...], ...]
    _peers: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.order not in RING_ORDERS:
            raise ConfigError(
                f"expected one of {', '.join(RING_ORDERS)}, got '{self.order}'", field="ring.order"
            )
        world = len(self.steps)
        if world == 0 or any(len(step) != world for step in self.steps):
            raise ConfigError(f"a ring of {world} ranks needs {world} steps of {world} ranks", field="ring")
        peers = tuple(tuple(step[rank] for step in self.steps) for rank in range(world))
        _check_rows(peers)
        _check_steps(peers)
        object.__setattr__(self, "_peers", peers)

    @classmethod
    def from_peers(cls, order: str, peers: tuple[tuple[int, ...], ...]) -> RingSchedule:
        """Build from per-rank visit orders (``peers[rank][s]``), as the YAML lists them."""
        world = len(peers)
        _check_rows(peers)
        return cls(order, tuple(tuple(peers[rank][s] for rank in range(world)) for s in range(world)))

    @property
    def world_size(self) -> int:
        return len(self.steps)

    def peers(self, rank: int) -> tuple[int, ...]:
        """Destination ranks in visit order for `rank`; starts with `rank` itself."""
        return self._peers[rank]


def derive_ring(num_nodes: int, ranks_per_node: int) -> RingSchedule:
    """The default schedule for `num_nodes` nodes of `ranks_per_node` ranks (rule in module doc)."""
    N, L = num_nodes, ranks_per_node
    steps = tuple(
        tuple(((r // L + s // L) % N) * L + (r % L + s % L) % L for r in range(N * L)) for s in range(N * L)
    )
    return RingSchedule("derived", steps)


def is_derangement(step: tuple[int, ...]) -> bool:
    """True when `step` is a permutation of range(len(step)) with no fixed point."""
    return sorted(step) == list(range(len(step))) and all(dst != src for src, dst in enumerate(step))


def _check_rows(peers: tuple[tuple[int, ...], ...]) -> None:
    world = len(peers)
    for rank, row in enumerate(peers):
        where = f"ring.peers[{rank}]"
        if len(row) != world:
            raise ConfigError(
                f"rank {rank} lists {len(row)} peers; expected all {world} ranks, itself first", field=where
            )
        if row[0] != rank:
            raise ConfigError(f"rank {rank}'s visit order must start with itself, got {row[0]}", field=where)
        seen: dict[int, int] = {}
        for s, dst in enumerate(row):
            if not 0 <= dst < world:
                raise ConfigError(
                    f"rank {dst} does not exist (world size {world}: ranks 0..{world - 1})",
                    field=f"{where}[{s}]",
                )
            if dst in seen:
                raise ConfigError(
                    f"rank {rank} visits rank {dst} twice (steps {seen[dst]} and {s}); the visit order "
                    f"must be a permutation of all {world} ranks",
                    field=f"{where}[{s}]",
                )
            seen[dst] = s


def _check_steps(peers: tuple[tuple[int, ...], ...]) -> None:
    world = len(peers)
    for s in range(world):
        sender_of: dict[int, int] = {}
        for rank in range(world):
            dst = peers[rank][s]
            if dst in sender_of:
                raise ConfigError(
                    f"step {s} is not a permutation: ranks {sender_of[dst]} and {rank} both target "
                    f"rank {dst} (at every step every rank must target a different peer)",
                    field=f"ring.peers[{rank}][{s}]",
                )
            sender_of[dst] = rank
