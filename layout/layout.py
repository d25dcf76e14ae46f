"""A layout: every axis of a plan except the stage partition and the batch.

The search's candidate is a `Layout`, and a `Plan` is a `Layout` with its model, hardware,
batch and stages, so the facts derived from the degrees (GPU count, shard group, which
data-parallel path runs) are written once and read by the cost model, the search and the
executor alike. Each field's default, range and description come from `layout.axes`.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .axes import (AXIS, SPLIT_BACKWARD_SCHEDULES, Accumulation, Compression, ReduceDtype, Schedule, StateDtype, ZeroStage,
                   hands_over_in_place, stage_rank)
from hardware.schema import Stack


def axis_field(name: str):
    """The pydantic Field of axis `name`: its default, range and help, from the declaration."""
    axis = AXIS[name]
    bounds = dict(ge=1, le=axis.high) if axis.high else {}
    return Field(axis.default, description=axis.help, **bounds)


class Layout(BaseModel):
    """The degrees and policies of a layout (frozen: the search keys its candidates by them)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp: int = axis_field("dp")
    tp: int = axis_field("tp")
    pp: int = axis_field("pp")
    sp: bool = axis_field("sp")
    tp_overlap: bool = axis_field("tp_overlap")
    fp8_param_gather: bool = axis_field("fp8_param_gather")
    zero: ZeroStage = axis_field("zero")
    schedule: Schedule = axis_field("schedule")
    vpp: int = axis_field("vpp")
    compression: Compression = axis_field("compression")
    dp_shard: int | None = axis_field("dp_shard")
    cp: int = axis_field("cp")
    ep: int = axis_field("ep")
    stack: Stack = axis_field("stack")
    offload: bool = axis_field("offload")
    micro_batch: int = axis_field("micro_batch")
    master_dtype: StateDtype = axis_field("master_dtype")
    optimizer_dtype: StateDtype = axis_field("optimizer_dtype")
    reduce_dtype: ReduceDtype | None = axis_field("reduce_dtype")
    accumulation: Accumulation = axis_field("accumulation")
    ddp_bucket_view: bool = axis_field("ddp_bucket_view")

    @property
    def n_gpus(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def data_parallel(self) -> int:
        """Ranks holding the same weights, over which gradients reduce and ZeRO shards: dp x cp."""
        return self.dp * self.cp

    @property
    def micro_batch_per_rank(self) -> float:
        """Sequences' worth of tokens one rank computes per micro-batch (micro_batch / cp)."""
        return self.micro_batch / self.cp

    @property
    def shard_degree(self) -> int:
        """The ranks that share one copy of the sharded states (1 without ZeRO)."""
        if self.zero == 0:
            return 1
        return self.dp_shard if self.dp_shard is not None and self.zero >= 2 else self.data_parallel

    @property
    def gathers_weights(self) -> bool:
        """Whether FSDP2 units gather their weights before use (ZeRO-2/3): sharded over more than
        one rank, or offloaded (copied from the host even when one rank holds them whole)."""
        return self.zero >= 2 and (self.shard_degree > 1 or self.offload)

    @property
    def dp_replicate(self) -> int:
        """Copies of the sharded states: dp x cp / shard_degree (HSDP's replicate groups)."""
        return self.data_parallel // self.shard_degree if self.zero else self.data_parallel

    @property
    def n_virtual_stages(self) -> int:
        return self.pp * self.vpp

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank that runs virtual stage `stage` (the schedule's placement, `layout.axes.stage_rank`)."""
        return stage_rank(self.schedule, self.pp, stage)

    def hands_over_in_place(self, stage: int) -> bool:
        """Whether virtual stage `stage` passes its output on without a send (`layout.axes.hands_over_in_place`)."""
        return hands_over_in_place(self.schedule, self.pp, stage, self.n_virtual_stages)

    def rank_stages(self, rank: int) -> list[int]:
        """The virtual stages pipeline rank `rank` runs, in model order."""
        return [s for s in range(self.n_virtual_stages) if self.stage_rank(s) == rank]

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs each backward as input gradients, then weight gradients."""
        return self.schedule in SPLIT_BACKWARD_SCHEDULES

    @property
    def reduces_through_ddp(self) -> bool:
        """Whether the executor replicates through DDP (ZeRO-0, one plain-tensor module run once
        per micro-batch). DTensor parameters (tp > 1) and pipeline stages, whose per-micro-batch
        backward DDP's reducer does not follow, and ZeRO-1, which reduce-scatters, reduce through
        the executor's per-weight reduction (executor/apply/gradient_reduce.py); ZeRO-2/3 through
        FSDP2."""
        return self.replicates_one_plain_module and self.zero == 0

    @property
    def copies_into_buckets(self) -> bool:
        """Whether DDP keeps its buckets beside the gradients (`ddp_bucket_view` false where DDP
        reduces): a gradient-sized buffer for the whole run, and two copies a step."""
        return self.reduces_through_ddp and not self.ddp_bucket_view

    @property
    def replicates_one_plain_module(self) -> bool:
        """Whether each data-parallel rank holds one plain-tensor module, run once per
        micro-batch (dp > 1, zero 0/1, no TP, no pipeline): DDP's path, and ZeRO-1's without
        TP or stages, where replicas may run uneven shares of the batch."""
        return self.data_parallel > 1 and self.zero <= 1 and self.tp == 1 and self.pp == 1

    @property
    def holds_unsharded_gradients(self) -> bool:
        """Whether FSDP2's units hold their unsharded gradients from micro-batch to micro-batch
        and reduce-scatter once, in the step's last (`accumulation` hold_unsharded, zero 2/3,
        no pipeline: torch.distributed.pipelining's schedules decide that themselves)."""
        return self.accumulation == "hold_unsharded" and self.zero >= 2 and self.pp == 1

    @property
    def hsdp_label(self) -> str:
        """"hsdp 2x8" (replicas x shard group) for a hybrid-sharded layout, else ""."""
        return f"hsdp {self.dp_replicate}x{self.shard_degree}" if self.zero >= 2 and self.dp_replicate > 1 else ""

    @property
    def layout_tag(self) -> str:
        """The layout in one short line, e.g. "dp8 cp2 tp4+sp pp2 interleaved v2 z3 (hsdp 2x8) mb1 fused"."""
        return " ".join(self._tag_parts() + self._stack_tag())

    def _stack_tag(self) -> list[str]:
        return [self.stack] if self.stack != "eager" else []

    def _tag_parts(self) -> list[str]:
        parts = [f"dp{self.dp}", *([f"ep{self.ep}"] if self.ep > 1 else []), *([f"cp{self.cp}"] if self.cp > 1 else []),
                 f"tp{self.tp}{'+sp' if self.sp else ''}{'+overlap' if self.tp_overlap else ''}", f"pp{self.pp}"]
        if self.pp > 1:
            parts.append(self.schedule + (f" v{self.vpp}" if self.vpp > 1 else ""))
        parts.append(f"z{self.zero}" + ("+offload" if self.offload else ""))
        if self.hsdp_label:
            parts.append(f"({self.hsdp_label})")
        parts.append(f"mb{self.micro_batch}")
        if self.compression != "none":
            parts.append(self.compression)
        recipe = self.recipe_changes()
        if "accumulation" in recipe:
            parts.append("hold-grads")
        if "master_dtype" in recipe or "optimizer_dtype" in recipe:
            parts.append(f"states {self.master_dtype}/{self.optimizer_dtype}")
        if "reduce_dtype" in recipe:
            parts.append(f"reduce {self.reduce_dtype}")
        if "fp8_param_gather" in recipe:
            parts.append("fp8-params")
        if "ddp_bucket_view" in recipe:
            parts.append("bucket-copies")
        return parts

    def recipe_changes(self) -> dict[str, object]:
        """The precision and accumulation axes off their defaults (accumulation and DDP's bucket
        copies where they apply)."""
        changed = {name: getattr(self, name) for name in ("master_dtype", "optimizer_dtype", "reduce_dtype",
                                                          "fp8_param_gather")
                   if getattr(self, name) != AXIS[name].default}
        return {**changed, **({"accumulation": self.accumulation} if self.holds_unsharded_gradients else {}),
                **({"ddp_bucket_view": False} if self.copies_into_buckets else {})}

    def axes(self) -> dict:
        """The layout's axis values alone (a Plan's too), e.g. to build another Plan from them."""
        return {name: getattr(self, name) for name in Layout.model_fields}
