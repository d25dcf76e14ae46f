"""The result of heterogeneity-aware planning: per-group balance and the comparison."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Mode = Literal["pipeline-split", "data-split", "subset"]


class GroupBalance(BaseModel):
    """What one GPU group does in a step: the balance the planner struck."""

    model_config = ConfigDict(extra="forbid")

    group: str
    gpus: int
    stages: str = Field(description="pipeline stages this group hosts")
    blocks_per_stage: list[int]
    replicas: int = Field(description="data-parallel replicas in this group")
    micro_batches: int = Field(description="micro-batches per replica per step")
    per_micro_batch_s: float = Field(description="slowest stage of the group, one micro-batch fwd+bwd")
    busy_s: float = Field(description="compute+comm time of the group's busiest rank in a step")
    idle_fraction: float
    peak_memory_gib: float
    capacity_gib: float


class HeteroPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    hardware: str
    global_batch: int
    seq_len: int
    dtype: str
    mode: Mode
    tp: int
    pp: int
    dp: int = Field(description="data-parallel replicas over the whole cluster")
    micro_batch: int
    zero: int
    recompute: str
    step_time_s: float
    tokens_per_s: float
    balance: list[GroupBalance]
    stages: list[dict[str, Any]] = Field(default_factory=list, description="pipeline split: layer range and group per stage")
    uniform_step_time_s: float | None = Field(None, description="best uniform plan ignoring the difference (slowest pace)")
    uniform_layout: str = ""
    subset_step_time_s: dict[str, float] = Field(default_factory=dict)
    layouts_priced: int = 0
    notes: list[str] = Field(default_factory=list)

    @property
    def speedup_vs_uniform(self) -> float | None:
        return self.uniform_step_time_s / self.step_time_s if self.uniform_step_time_s else None

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)
