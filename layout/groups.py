"""Where a mixed-GPU plan puts each GPU type: one `GroupShare` per group of the cluster.

A mixed cluster (`hardware.mixed.MixedCluster`) is several groups of one GPU type each.
Its plan is an ordinary `Plan` whose `groups` say which part of the (pp, dp, tp) mesh
each group holds. Two shapes run and are priced:

* data split: every group holds every pipeline stage and its own data-parallel replicas
  (`Plan.dp_micro_batches` gives the faster group's replicas more micro-batches);
* pipeline split: every group holds every replica and its own consecutive pipeline
  stages (the faster group's stages hold more blocks).

A group's ranks follow the executor's mesh order (pp outermost, tp innermost), so
`ranks_of` is what `torchrun` places on that group's nodes.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from hardware.schema import Cluster
from hardware.untrusted import SafeName


class GroupShare(BaseModel):
    """One GPU group's part of a mixed-cluster plan."""

    model_config = ConfigDict(extra="forbid")

    hardware: SafeName = Field(description="the group's spec, e.g. 16xa100-80g")
    hardware_profile: Cluster | None = Field(None, description="the group itself, when not a catalog spec")
    stages: list[int] = Field(min_length=1, description="pipeline ranks this group holds (consecutive)")
    replicas: list[int] = Field(min_length=1, description="data-parallel replicas this group holds (consecutive)")

    def cluster(self) -> Cluster:
        if self.hardware_profile is not None:
            return self.hardware_profile
        import hardware

        return hardware.load(self.hardware)


def _consecutive(values: list[int]) -> bool:
    return values == list(range(values[0], values[0] + len(values)))


def check_groups(groups: list[GroupShare], pp: int, dp: int, cp: int) -> None:
    """Raise ValueError unless the groups tile the pp x dp grid as a data or a pipeline split."""
    if cp != 1:
        raise ValueError("a mixed-cluster plan runs without context parallelism (cp=1)")
    if len(groups) < 2:
        raise ValueError("groups: a mixed-cluster plan has two or more GPU groups")
    for g in groups:
        if not (_consecutive(g.stages) and _consecutive(g.replicas)):
            raise ValueError(f"group {g.hardware}: stages {g.stages} and replicas {g.replicas} must be consecutive")
    data = all(g.stages == list(range(pp)) for g in groups)
    pipe = all(g.replicas == list(range(dp)) for g in groups)
    if not (data or pipe):
        raise ValueError("groups must hold every stage each (a data split) or every replica each (a pipeline split)")
    cells = sorted((s, r) for g in groups for s in g.stages for r in g.replicas)
    if cells != [(s, r) for s in range(pp) for r in range(dp)]:
        raise ValueError(f"groups must hold each of the {pp} stages x {dp} replicas exactly once")


def split_of(groups: list[GroupShare], pp: int) -> str:
    """"data" when every group holds every stage, else "pipeline"."""
    return "data" if all(len(g.stages) == pp for g in groups) else "pipeline"


def ranks_of(group: GroupShare, dp: int, tp: int) -> list[int]:
    """The global ranks of `group` in the executor's (pp, dp, tp) mesh."""
    return [(s * dp + r) * tp + t for s in group.stages for r in group.replicas for t in range(tp)]


def rank_ranges(ranks: list[int]) -> str:
    """"0-7,16-23": the ranks as runs."""
    runs, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ",".join(runs)


class HeldMemory:
    """What an estimate's memory capacity is held to: the caching allocator's reservation where it
    is priced (`peak_reserved_bytes`), else the tensors' peak (`peak_memory_bytes`); both are
    the model's own fields."""

    @property
    def held_bytes(self) -> float:
        return self.peak_reserved_bytes if self.peak_reserved_bytes is not None else self.peak_memory_bytes


class GroupEstimate(HeldMemory, BaseModel):
    """What one GPU group does in a mixed plan's step, as the cost model prices it."""

    model_config = ConfigDict(extra="forbid")

    group: str
    gpus: int
    ranks: str = Field(description="its global ranks, as runs")
    stages: list[int]
    replicas: int
    micro_batches: int = Field(description="micro-batches per replica per step")
    blocks_per_stage: list[int]
    per_micro_batch_s: float = Field(description="its slowest stage, one micro-batch forward and backward")
    busy_s: float = Field(description="its busiest rank's compute and communication in a step")
    idle_fraction: float
    peak_memory_bytes: float = Field(description="the tensors' peak on its worst rank")
    peak_reserved_bytes: float | None = Field(None, description="what torch's caching allocator reserves at most on its "
                                              "worst rank (costmodel.reserved): what its capacity is held to")
    memory_capacity_bytes: float

    @property
    def fits(self) -> bool:
        return self.held_bytes <= self.memory_capacity_bytes
