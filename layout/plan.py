"""The Plan: one parallel layout, as versioned data.

A plan written by hand and a plan returned by the solver are the same JSON and
pass the same validation; the estimator, the simulator and the executor all
take a `Plan`. A Plan is a `Layout` (the axes, declared in `layout.axes`) with
its model, hardware, batch and stage partition. Stage boundaries index the
workload's expanded layer list (embedding, blocks..., head). With a chunked
schedule there are `pp * vpp` virtual stages, placed on the pipeline ranks as the
schedule places them (`Layout.stage_rank`: looped, or in a V for zbv).

Gradient compression's options (Top-K's fraction, PowerSGD's rank, int8's
rounding) are part of the layout: the cost model prices them and the executor
runs them from these fields, nothing else.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hardware.errors import PlanError
from hardware.schema import Cluster
from hardware.limits import MAX_GLOBAL_BATCH, MAX_SEQ_LEN
from hardware.untrusted import SafeName, parse_json

from .axes import Recompute
from .groups import GroupShare, check_groups, split_of
from .layout import Layout
from .results import CheckpointAdvice, Estimate, SolverReport
from .rules import ModelFacts, layout_problem, precision_problem, structural_problem

SCHEMA_VERSION = 10  # 2: hardware_profile (a plan made on a profile file carries it); 3: dp_shard (HSDP), cp; 4: stack;
# 5: offload, dp_micro_batches; 6: groups (mixed-GPU clusters), Estimate.groups; 7: master_dtype, optimizer_dtype,
# reduce_dtype, accumulation; 8: tp_overlap; 9: fp8_param_gather; 10: ddp_bucket_view

DTYPES = ("bf16", "fp16", "fp32", "fp8")  # the training precisions: fp8 runs its GEMMs in FP8
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


class Plan(Layout):
    model_config = ConfigDict(frozen=False, extra="forbid")

    schema_version: Literal[1, 2, 3, 4, 5, 6, 7, 8, 9, 10] = SCHEMA_VERSION
    model: SafeName
    hardware: SafeName
    hardware_profile: Cluster | None = Field(None, description="the cluster itself, when `hardware` is not a "
                                             "catalog spec (a calibrated or edited profile)")
    global_batch: int = Field(gt=0, le=MAX_GLOBAL_BATCH)
    seq_len: int = Field(gt=0, le=MAX_SEQ_LEN)
    dtype: Literal[DTYPES] = Field("bf16", description="the compute dtype; fp8: GEMMs in FP8 (the GPU's FP8 "
                                   "peak), the rest in bf16 (the states' dtypes: master_dtype, optimizer_dtype)")
    dp_micro_batches: list[int] | None = Field(
        None, description="micro-batches each data-parallel replica runs per step, when the shares are uneven (a "
        "mixed cluster's faster GPUs take more); their sum times micro_batch is the global batch, and the "
        "gradient average is weighted by tokens. None: global_batch / (dp * micro_batch) each")
    groups: list[GroupShare] | None = Field(
        None, description="a mixed-GPU cluster: which stages and replicas each GPU group holds (`hardware` is then "
        "the mixed spec, e.g. 16xa100-80g+8xh100-sxm); None: one GPU type")
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

    def _check_uneven_shares(self) -> None:
        shares = self.dp_micro_batches
        if len(shares) != self.dp or min(shares) < 1:
            raise ValueError(f"dp_micro_batches needs one positive count per replica (dp={self.dp}), got {shares}")
        if sum(shares) * self.micro_batch != self.global_batch:
            raise ValueError(f"dp_micro_batches {shares} x micro_batch {self.micro_batch} = "
                             f"{sum(shares) * self.micro_batch} sequences, not the global batch {self.global_batch}")

    @model_validator(mode="after")
    def _consistent_layout(self):
        """The rulebook's model-free rules (`layout.rules.structural_problem`), then the plan's own:
        batch shares, mixed-cluster groups and the stage partition."""
        problem = structural_problem(self, self.seq_len) or precision_problem(self, self.dtype)
        if problem is not None:
            raise ValueError(str(problem))
        if self.dp_micro_batches is not None:
            self._check_uneven_shares()
        if self.groups is not None:
            check_groups(self.groups, self.pp, self.dp, self.cp)
        elif self.global_batch % (self.dp * self.micro_batch):
            raise ValueError(
                f"global_batch {self.global_batch} is not divisible by dp*micro_batch "
                f"= {self.dp}*{self.micro_batch}"
            )
        self._check_stages()
        return self

    def _check_stages(self) -> None:
        if len(self.stages) != self.n_virtual_stages:
            raise ValueError(f"{len(self.stages)} stages given, pp*vpp = {self.n_virtual_stages} expected")
        for before, after in zip(self.stages, self.stages[1:]):
            if after.start != before.end:
                raise ValueError(f"stages must be contiguous: one ends at {before.end}, next starts at {after.start}")
        if self.stages[0].start != 0:
            raise ValueError("the first stage must start at layer 0")

    @property
    def layout_tag(self) -> str:
        """The layout in one short line, e.g. "dp8 cp2 tp4+sp pp2 interleaved v2 z3 (hsdp 2x8) mb1 fp8"."""
        return " ".join(self._tag_parts() + (["fp8"] if self.dtype == "fp8" else []) + self._stack_tag())

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


def every_kth_block(stages: list[StagePlan], kinds: list[str], k: int) -> list[StagePlan]:
    """`stages` with full recomputation on every k-th block (the first, the (k+1)-th, ...) and
    none on the rest: layer-level checkpointing at a frequency, as trainers offer it."""
    blocks = [i for i, kind in enumerate(kinds) if kind == "block"]
    full = set(blocks[::k])
    return [s.model_copy(update={"recompute": ["full" if i in full else "none" for i in range(s.start, s.end)]})
            for s in stages]


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


def plan_problem(plan: Plan, facts: ModelFacts) -> PlanError | None:
    """`layout_problem` for a whole plan: its sequence, its micro-batch count, and uneven
    data-parallel shares, which run on DDP's path alone (each replica runs its own count and
    the gradients reduce once per step; FSDP2 reduces per micro-batch, and a pipeline
    schedule runs one count on every stage)."""
    if plan.splits_backward and any(p != "none" for stage in plan.stages for p in stage.recompute):
        return PlanError("recompute", f"the {plan.schedule} schedule runs without activation recomputation (torch's "
                         "composable checkpoint fails under its split backward)", "use recompute none, or 1f1b")
    if plan.stack == "fused" and any(p == "op" for stage in plan.stages for p in stage.recompute):
        return PlanError("recompute", "op is torch's op-level checkpointing; the fused stack prices Megatron-LM, "
                         "which recomputes the attention core or whole blocks", "use selective or full, or stack eager")
    if plan.dp_micro_batches and not plan.replicates_one_plain_module:
        return PlanError("dp_micro_batches", "uneven data-parallel shares run without TP or pipelines: dp > 1 with zero 0 "
                         "or 1, tp 1, pp 1", "use even shares with this layout, or such a layout")
    return layout_problem(plan, facts, plan.seq_len, plan.num_micro_batches)


def check_plan_runs(plan: Plan, facts: ModelFacts) -> None:
    problem = plan_problem(plan, facts)
    if problem is not None:
        raise problem
