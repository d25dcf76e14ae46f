"""What pricing a plan yields, as data a Plan carries: the estimate of its step, the
solver's report, and the checkpoint advice.

They sit on the layout floor because a Plan holds them and round-trips them through JSON;
the cost model fills them in (`costmodel.estimate`, `costmodel.goodput`).
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .groups import GroupEstimate, HeldMemory


class StageEstimate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: int
    start: int
    end: int
    forward_s: float = Field(description="forward time of one micro-batch")
    backward_s: float = Field(description="backward (with recomputation) of one micro-batch")
    memory_bytes: dict[str, float] = Field(description="peak memory by category on this stage's ranks")
    reserved_bytes: float | None = Field(None, description="what torch's caching allocator reserves at its largest on "
                                         "this stage's ranks (costmodel.reserved), beside the tensors' peak")

    @property
    def peak_bytes(self) -> float:
        return sum(self.memory_bytes.values())


class Estimate(HeldMemory, BaseModel):
    """Predicted step: time by category, throughput and per-rank memory."""

    model_config = ConfigDict(extra="forbid")

    step_time_s: float = Field(gt=0)
    breakdown_s: dict[str, float]
    tokens_per_s: float = Field(ge=0)
    tflops_per_gpu_model: float
    tflops_per_gpu_hw: float = Field(description="includes recomputed forwards")
    mfu: float = Field(ge=0)
    peak_memory_bytes: float = Field(ge=0, description="the tensors' peak on the worst rank: max_memory_allocated()")
    peak_reserved_bytes: float | None = Field(None, description="what torch's caching allocator reserves at its largest "
                                              "on the worst rank, with expandable segments: max_memory_reserved()")
    memory_capacity_bytes: float = Field(description="what the plan's reservation (peak_reserved_bytes) may take: the "
                                         "GPU's memory less the runtime's (runtime_memory_bytes) and the user's reserve")
    runtime_memory_bytes: dict[str, float] = Field(
        default_factory=dict, description="per rank, outside the tensors: the CUDA context, cuBLAS workspaces, the "
        "collective library's buffers")
    host_memory_bytes: float = Field(0.0, description="offloaded states in one node's host memory")
    host_memory_capacity_bytes: float | None = Field(None, description="the node's host memory (offload only)")
    host_copy_s: float = Field(0.0, description="host<->device shard copies per step before overlap (offload)")
    stages: list[StageEstimate]
    groups: list[GroupEstimate] = Field(default_factory=list, description="a mixed-cluster plan: each GPU group's share")
    usd_per_hour: float | None = None
    usd_per_million_tokens: float | None = None

    @property
    def fits_with_retries(self) -> bool:
        """Whether the tensors fit once torch's caching allocator gives its cache back: a plan that
        does not `fit` but does this runs, its allocator releasing and retrying (a device
        synchronisation) each step."""
        return self.peak_memory_bytes <= self.memory_capacity_bytes and self._host_fits and not self.groups

    @property
    def fits(self) -> bool:
        return (self.held_bytes <= self.memory_capacity_bytes and self._host_fits
                and all(g.fits for g in self.groups))

    @property
    def _host_fits(self) -> bool:
        """The offloaded states within the node's host memory (always, without offload)."""
        host = self.host_memory_capacity_bytes
        return host is None or self.host_memory_bytes <= host


class SolverReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status: str
    wall_s: float
    layouts_considered: int
    layouts_solved: int
    gap: float | None = Field(description="relative gap between the plan and the solver's proven bound (None: "
                              "no bound was proven, as for a mixed cluster's search)")
    notes: list[str] = Field(default_factory=list)


class CheckpointAdvice(BaseModel):
    """How often a plan should checkpoint, and the goodput it then keeps (Young/Daly)."""

    every_steps: int = Field(ge=1, description="optimizer steps between checkpoints (Young's interval)")
    interval_s: float = Field(gt=0, description="compute seconds between checkpoints")
    goodput: float = Field(description="expected useful fraction of wall time under failures")
    write_s: float = Field(ge=0, description="one checkpoint's write time")
    job_mtbf_s: float = Field(gt=0, description="the job's mean time between failures")
    gpu_mtbf_hours: float = Field(gt=0)
    sources: dict[str, str] = Field(default_factory=dict)

    def line(self) -> str:
        return (f"checkpoint every {self.every_steps:,} steps ({_duration(self.interval_s)}): expected goodput "
                f"{self.goodput:.1%} (a save takes {_duration(self.write_s)}, the job fails every "
                f"{_duration(self.job_mtbf_s)} at {self.gpu_mtbf_hours:,.0f} h MTBF per GPU)")



def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"
