"""The Plan: one parallel layout, as versioned data.

A plan written by hand and a plan returned by the solver are the same JSON and
pass the same validation; the estimator, the simulator and the executor all
take a `Plan`. Stage boundaries index the workload's expanded layer list
(embedding, blocks..., head). With an interleaved schedule there are
`pp * vpp` virtual stages, and virtual stage `i` runs on pipeline rank `i % pp`.

Gradient compression's options (Top-K's fraction, PowerSGD's rank, int8's
rounding) are part of the layout: the cost model prices them and the executor
runs them from these fields, nothing else.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hardware.schema import Cluster, Stack
from hardware.limits import MAX_GLOBAL_BATCH, MAX_GPUS, MAX_LAYERS, MAX_SEQ_LEN
from hardware.untrusted import SafeName, parse_json

from .goodput import CheckpointAdvice
from .plan_groups import GroupEstimate, GroupShare, check_groups, split_of

SCHEMA_VERSION = 6  # 2: hardware_profile (a plan made on a profile file carries it); 3: dp_shard (HSDP), cp; 4: stack;
# 5: offload, dp_micro_batches; 6: groups (mixed-GPU clusters), Estimate.groups

Recompute = Literal["none", "selective", "full"]
Schedule = Literal["gpipe", "1f1b", "interleaved"]
Compression = Literal["none", "fp16", "bf16", "int8", "topk", "powersgd"]

DEFAULT_TOPK_FRACTION = 0.01  # k: the fraction of gradient entries Top-K sends
DEFAULT_POWERSGD_RANK = 4


class StagePlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    start: int = Field(ge=0, description="first layer index (inclusive)")
    end: int = Field(gt=0, description="last layer index (exclusive)")
    recompute: list[Recompute] = Field(description="one checkpointing policy per layer of the stage")

    @model_validator(mode="after")
    def _one_policy_per_layer(self):
        if self.end <= self.start:
            raise ValueError(f"stage end ({self.end}) must be greater than start ({self.start})")
        if len(self.recompute) != self.end - self.start:
            raise ValueError(
                f"stage [{self.start}, {self.end}) has {self.end - self.start} layers "
                f"but {len(self.recompute)} recompute entries"
            )
        return self


class StageEstimate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: int
    start: int
    end: int
    forward_s: float = Field(description="forward time of one micro-batch")
    backward_s: float = Field(description="backward (with recomputation) of one micro-batch")
    memory_bytes: dict[str, float] = Field(description="peak memory by category on this stage's ranks")

    @property
    def peak_bytes(self) -> float:
        return sum(self.memory_bytes.values())


class Estimate(BaseModel):
    """Predicted step: time by category, throughput and per-rank memory."""

    model_config = ConfigDict(extra="forbid")

    step_time_s: float = Field(gt=0)
    breakdown_s: dict[str, float]
    tokens_per_s: float = Field(ge=0)
    tflops_per_gpu_model: float
    tflops_per_gpu_hw: float = Field(description="includes recomputed forwards")
    mfu: float = Field(ge=0)
    peak_memory_bytes: float = Field(ge=0)
    memory_capacity_bytes: float = Field(ge=0)
    host_memory_bytes: float = Field(0.0, description="offloaded states in one node's host memory")
    host_memory_capacity_bytes: float | None = Field(None, description="the node's host memory (offload only)")
    host_copy_s: float = Field(0.0, description="host<->device shard copies per step before overlap (offload)")
    stages: list[StageEstimate]
    groups: list[GroupEstimate] = Field(default_factory=list, description="a mixed-cluster plan: each GPU group's share")
    usd_per_hour: float | None = None
    usd_per_million_tokens: float | None = None

    @property
    def fits(self) -> bool:
        host = self.host_memory_capacity_bytes
        return (self.peak_memory_bytes <= self.memory_capacity_bytes and (host is None or self.host_memory_bytes <= host)
                and all(g.fits for g in self.groups))


class SolverReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status: str
    wall_s: float
    layouts_considered: int
    layouts_solved: int
    gap: float | None = Field(description="relative gap between the plan and the solver's proven bound (None: "
                              "no bound was proven, as for a mixed cluster's search)")
    notes: list[str] = Field(default_factory=list)


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1, 2, 3, 4, 5, 6] = SCHEMA_VERSION
    model: SafeName
    hardware: SafeName
    hardware_profile: Cluster | None = Field(None, description="the cluster itself, when `hardware` is not a "
                                             "catalog spec (a calibrated or edited profile)")
    global_batch: int = Field(gt=0, le=MAX_GLOBAL_BATCH)
    seq_len: int = Field(gt=0, le=MAX_SEQ_LEN)
    dtype: Literal["fp32", "bf16", "fp16", "fp8"] = Field("bf16", description="fp8: GEMMs in FP8 (the GPU's FP8 "
                                                          "peak), the rest in bf16, fp32 master weights")
    dp: int = Field(ge=1, le=MAX_GPUS)
    tp: int = Field(ge=1, le=MAX_GPUS)
    pp: int = Field(ge=1, le=MAX_GPUS)
    ep: int = Field(1, ge=1, le=MAX_GPUS, description="expert parallel: a mixture-of-experts layer's experts split over ep of "
                                         "the data-parallel ranks, tokens routed to them by all-to-all")
    cp: int = Field(1, ge=1, le=MAX_GPUS, description="context parallel: each sequence split over cp ranks (2 of its 2*cp "
                                         "chunks each, the causal load balance), keys and values all-gathered")
    sp: bool = False
    stack: Stack = Field("eager", description="the kernel stack priced: eager (PyTorch ops under autocast over fp32 "
                         "weights, what `parallax run` executes), compile (torch.compile), fused (Megatron-LM / "
                         "Transformer Engine: bf16 weights, fp32 masters in the optimizer)")
    zero: int = Field(0, ge=0, le=3)
    dp_micro_batches: list[int] | None = Field(
        None, description="micro-batches each data-parallel replica runs per step, when the shares are uneven (a "
        "mixed cluster's faster GPUs take more); their sum times micro_batch is the global batch, and the "
        "gradient average is weighted by tokens. None: global_batch / (dp * micro_batch) each")
    groups: list[GroupShare] | None = Field(
        None, description="a mixed-GPU cluster: which stages and replicas each GPU group holds (`hardware` is then "
        "the mixed spec, e.g. 16xa100-80g+8xh100-sxm); None: one GPU type")
    offload: bool = Field(False, description="FSDP2's CPUOffloadPolicy (zero 2/3): the sharded fp32 weights, their "
                          "gradients and AdamW's state live in host memory and the optimizer steps on the host's "
                          "cores; each gather copies a shard to the device and each reduce-scatter one back")
    dp_shard: int | None = Field(None, ge=1, le=MAX_GPUS, description="hybrid sharding (HSDP, zero 2/3): shard over groups of "
                                 "this many dp ranks, replicate across the dp/dp_shard groups (None: shard over all dp)")
    micro_batch: int = Field(ge=1, le=MAX_GLOBAL_BATCH)
    schedule: Schedule = "1f1b"
    vpp: int = Field(1, ge=1, le=MAX_LAYERS, description="model chunks per pipeline rank (interleaved schedule)")
    compression: Compression = "none"
    topk_fraction: float = Field(DEFAULT_TOPK_FRACTION, gt=0, le=1,
                                 description="compression 'topk': fraction k of gradient entries each rank sends")
    powersgd_rank: int = Field(DEFAULT_POWERSGD_RANK, ge=1, description="compression 'powersgd': rank of the factors")
    stochastic_rounding: bool = Field(False, description="compression 'int8': round stochastically instead of to nearest")
    stages: list[StagePlan]
    objective: Literal["time", "cost"] = "time"
    estimate: Estimate | None = None
    alternatives: list["Plan"] = Field(default_factory=list)
    solver: SolverReport | None = None
    checkpointing: CheckpointAdvice | None = Field(None, description="Young/Daly checkpoint interval and goodput "
                                                   "(`parallax run` and `launch` use it without --checkpoint-every)")
    notes: list[str] = Field(default_factory=list)

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
    def num_micro_batches(self) -> int:
        """Micro-batches per step of the busiest replica (every replica's, when the shares are even)."""
        if self.dp_micro_batches:
            return max(self.dp_micro_batches)
        return self.global_batch // (self.dp * self.micro_batch)

    def micro_batches_of(self, replica: int) -> int:
        """The micro-batches data-parallel replica `replica` runs per step."""
        return self.dp_micro_batches[replica] if self.dp_micro_batches else self.num_micro_batches

    def first_sequence_of(self, replica: int) -> int:
        """Where replica `replica`'s contiguous share of the global batch starts."""
        return self.micro_batch * sum(self.micro_batches_of(r) for r in range(replica))

    @property
    def n_virtual_stages(self) -> int:
        return self.pp * self.vpp

    @property
    def reduces_through_ddp(self) -> bool:
        """Whether the executor replicates through DDP (one plain-tensor module run once per
        micro-batch) rather than FSDP2's replicate / fully_shard: DTensor parameters (tp > 1)
        and pipeline stages, whose per-micro-batch backward DDP's reducer does not follow,
        go through FSDP2, as ZeRO-2/3 do."""
        return self.data_parallel > 1 and self.zero <= 1 and self.tp == 1 and self.pp == 1

    def _check_uneven_shares(self) -> None:
        shares = self.dp_micro_batches
        if len(shares) != self.dp or min(shares) < 1:
            raise ValueError(f"dp_micro_batches needs one positive count per replica (dp={self.dp}), got {shares}")
        if sum(shares) * self.micro_batch != self.global_batch:
            raise ValueError(f"dp_micro_batches {shares} x micro_batch {self.micro_batch} = "
                             f"{sum(shares) * self.micro_batch} sequences, not the global batch {self.global_batch}")

    @model_validator(mode="after")
    def _consistent_layout(self):
        if self.dp_micro_batches is not None:
            self._check_uneven_shares()
        if self.groups is not None:
            check_groups(self.groups, self.pp, self.dp, self.cp)
        elif self.global_batch % (self.dp * self.micro_batch):
            raise ValueError(
                f"global_batch {self.global_batch} is not divisible by dp*micro_batch "
                f"= {self.dp}*{self.micro_batch}"
            )
        if self.schedule != "interleaved" and self.vpp != 1:
            raise ValueError(f"vpp={self.vpp} needs schedule 'interleaved'")
        if self.schedule == "interleaved" and self.pp < 2:
            raise ValueError("schedule 'interleaved' needs pp >= 2")
        if len(self.stages) != self.n_virtual_stages:
            raise ValueError(f"{len(self.stages)} stages given, pp*vpp = {self.n_virtual_stages} expected")
        for before, after in zip(self.stages, self.stages[1:]):
            if after.start != before.end:
                raise ValueError(f"stages must be contiguous: one ends at {before.end}, next starts at {after.start}")
        if self.stages[0].start != 0:
            raise ValueError("the first stage must start at layer 0")
        if self.dp_shard is not None:
            if self.zero < 2:
                raise ValueError(f"dp_shard={self.dp_shard} (hybrid sharding) needs zero 2 or 3, not {self.zero}")
            if self.data_parallel % self.dp_shard:
                raise ValueError(f"dp_shard={self.dp_shard} must divide dp*cp={self.data_parallel}")
        if self.data_parallel % self.ep:
            raise ValueError(f"ep={self.ep} must divide the data-parallel ranks dp*cp = {self.data_parallel}")
        if self.cp > 1 and self.seq_len % (2 * self.cp):
            raise ValueError(f"seq_len {self.seq_len} must be a multiple of 2*cp = {2 * self.cp} (two chunks per cp rank)")
        if self.sp and self.tp == 1:
            raise ValueError("sp (sequence parallel) needs tp > 1")
        return self

    @property
    def hsdp_label(self) -> str:
        """"hsdp 2x8" (replicas x shard group) for a hybrid-sharded plan, else ""."""
        return f"hsdp {self.dp_replicate}x{self.shard_degree}" if self.zero >= 2 and self.dp_replicate > 1 else ""

    @property
    def layout_tag(self) -> str:
        """The layout in one short line, e.g. "dp8 cp2 tp4+sp pp2 interleaved v2 z3 (hsdp 2x8) mb1 fp8"."""
        parts = [f"dp{self.dp}", *([f"ep{self.ep}"] if self.ep > 1 else []), *([f"cp{self.cp}"] if self.cp > 1 else []), f"tp{self.tp}{'+sp' if self.sp else ''}",
                 f"pp{self.pp}"]
        if self.pp > 1:
            parts.append(self.schedule + (f" v{self.vpp}" if self.vpp > 1 else ""))
        parts.append(f"z{self.zero}" + ("+offload" if self.offload else ""))
        if self.hsdp_label:
            parts.append(f"({self.hsdp_label})")
        parts.append(f"mb{self.micro_batch}")
        if self.compression != "none":
            parts.append(self.compression)
        if self.dtype == "fp8":
            parts.append("fp8")
        if self.stack != "eager":
            parts.append(self.stack)
        return " ".join(parts)

    @property
    def split(self) -> str:
        """How a mixed-cluster plan shares the work: "data" or "pipeline" ("" on one GPU type)."""
        return split_of(self.groups, self.pp) if self.groups else ""

    def cluster(self):
        """The hardware the plan was made for: its embedded profile, else its catalog spec; a
        `hardware.mixed.MixedCluster` of its groups for a mixed-cluster plan."""
        if self.groups:
            from hardware.mixed import load_mixed

            return load_mixed([g.cluster() for g in self.groups])
        if self.hardware_profile is not None:
            return self.hardware_profile
        import hardware

        return hardware.load(self.hardware)

    def with_overrides(self, **values) -> "Plan":
        """A copy with `values` replaced, validated like a plan read from JSON (model_copy is not)."""
        return type(self).model_validate({**self.model_dump(), **values})

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """A plan from JSON text: nesting bounded, no NaN or Infinity (`hardware.untrusted`)."""
        return cls.model_validate(parse_json(text, "plan", "the plan"))


def uniform_stages(kinds: list[str], n_stages: int, policy: Recompute = "none") -> list[StagePlan]:
    """Megatron-style partition: blocks split as evenly as possible, the
    embedding joins the first stage and the head the last; `policy` is the
    checkpointing of every block.

    `kinds` is the workload's layer kinds in order. A remainder of blocks goes
    to the middle stages, which carry neither embedding nor head.
    """
    first = next((i for i, k in enumerate(kinds) if k == "block"), 0)
    last = max((i for i, k in enumerate(kinds) if k == "block"), default=len(kinds) - 1) + 1
    n_blocks = last - first
    if n_stages > n_blocks:
        raise ValueError(f"{n_stages} stages but only {n_blocks} blocks")
    base, extra = divmod(n_blocks, n_stages)
    order = sorted(range(n_stages), key=lambda s: (s in (0, n_stages - 1), s))
    counts = [base] * n_stages
    for s in order[:extra]:
        counts[s] += 1
    bounds = [0]
    position = first
    for count in counts:
        position += count
        bounds.append(position)
    bounds[0], bounds[-1] = 0, len(kinds)
    # Checkpointing applies to the blocks; the embedding and head keep their activations.
    return [
        StagePlan(start=a, end=b, recompute=[policy if kinds[i] == "block" else "none" for i in range(a, b)])
        for a, b in zip(bounds, bounds[1:])
    ]
