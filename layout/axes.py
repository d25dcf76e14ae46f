"""Every axis of a layout, declared once.

An axis is one choice a plan makes: a degree of parallelism, a schedule, a ZeRO stage, a
policy. Its name, type, default, valid values, whether a user may pin it, and its CLI flag
and help live here and nowhere else. The Plan's fields (`layout.layout`), the search's
choices and the pins' checks (`planner.search.space`) and the CLI's flags
(`parallax_cli.layout_flags`) are all read from this table, so a new axis is one entry
plus the code that prices and runs it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from hardware.limits import MAX_GLOBAL_BATCH, MAX_GPUS, MAX_LAYERS
from hardware.schema import Stack

RECOMPUTE = ("none", "selective", "op", "full")
REBUILT = ("op", "full")  # policies whose backward re-runs a layer's forward ops: one layer's dropped tensors rebuilt at a time
# What each policy keeps, as the cost model prices it (costmodel/memory.py, costmodel/compute.py) and
# the executor runs it (executor/apply/recompute.py); the dry run holds the two together.
RECOMPUTE_MEANS = {
    "none": "every activation the backward needs is kept",
    "selective": "the attention core (its s x s scores, softmax and dropout) is recomputed and everything else "
                 "kept: Megatron's selective recomputation; a fused attention kernel keeps no scores, so there "
                 "it keeps what none keeps",
    "op": "the outputs of the block's matrix products and attention kernels are kept and every other op (norms, "
          "activations, casts, rotary embeddings, TP collectives) recomputed from them: torchtitan's op-level "
          "selective checkpointing",
    "full": "only the block's input is kept and the whole block recomputed in its backward",
}
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zero-bubble", "zbv")
CHUNKED_SCHEDULES = ("interleaved", "zero-bubble", "zbv")  # several model chunks per pipeline rank (vpp)
SPLIT_BACKWARD_SCHEDULES = ("zero-bubble", "zbv")  # each backward run as input gradients, then weight gradients
V_SCHEDULES = ("zbv",)  # two chunks per rank placed in a V: rank r runs stages r and 2*pp-1-r


def stage_rank(schedule: str, pp: int, stage: int) -> int:
    """The pipeline rank that runs virtual stage `stage`: looped (stage i on rank i % pp, so
    each rank's chunks are pp stages apart), or in a V (the second sweep runs back up the
    ranks, so rank 0 runs the first and the last stage), as torch's ZBV schedule places them."""
    if schedule in V_SCHEDULES and (stage // pp) % 2:
        return pp - 1 - stage % pp
    return stage % pp


def hands_over_in_place(schedule: str, pp: int, stage: int, n_stages: int) -> bool:
    """Whether virtual stage `stage` passes its output to the next on its own rank, with no
    send: a V's turn (stages pp-1 and pp on one rank)."""
    return stage < n_stages - 1 and stage_rank(schedule, pp, stage) == stage_rank(schedule, pp, stage + 1)


COMPRESSION = ("none", "fp16", "bf16", "int8", "topk", "powersgd")
STACKS: tuple[str, ...] = get_args(Stack)  # the profiles' efficiencies are keyed by these (hardware.schema)
ZERO_STAGES = (0, 1, 2, 3)
STATE_DTYPES = ("fp32", "bf16")  # master weights and AdamW moments (the planner never lowers them itself)
REDUCE_DTYPES = ("fp32", "bf16", "fp16")
ACCUMULATION = ("reduce_each", "hold_unsharded")
TP_DEGREES = (1, 2, 4, 8, 16, 32, 64)  # powers of two: heads, kv heads and vocabularies divide by them

Recompute = Literal[RECOMPUTE]
Schedule = Literal[SCHEDULES]
Compression = Literal[COMPRESSION]
ZeroStage = Literal[ZERO_STAGES]
StateDtype = Literal[STATE_DTYPES]
ReduceDtype = Literal[REDUCE_DTYPES]
Accumulation = Literal[ACCUMULATION]


@dataclass(frozen=True)
class Axis:
    """One choice of a layout. `choices` is the closed set of values (None: a count in
    [1, `high`]); `searched` the values the planner tries when it is not pinned (None: the
    planner derives them from the cluster and the model)."""

    name: str
    kind: type
    default: object
    help: str
    choices: tuple | None = None
    high: int | None = None
    pinnable: bool = True
    searched: tuple | None = None
    optional: bool = False  # None is a value (dp_shard: shard over all of dp)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value: object) -> str | None:
        """Why `value` is not one of this axis's values, or None."""
        if value is None and self.optional:
            return None
        if self.choices is not None:
            ok = value in self.choices and type(value) is type(self.choices[0])
            return None if ok else f"{value!r} is not valid; use one of {', '.join(map(str, self.choices))}"
        whole = isinstance(value, int) and not isinstance(value, bool)
        if not whole or not 1 <= value <= self.high:
            return f"{value!r} is not a whole number in [1, {self.high:,}]"
        return None


def _count(name: str, help: str, default: object = 1, high: int = MAX_GPUS, **extra) -> Axis:
    return Axis(name, int, default, help, high=high, **extra)


AXES: tuple[Axis, ...] = (
    _count("dp", "data-parallel replicas (ranks holding the same stage and TP shard)"),
    _count("dp_shard", "hybrid sharding (HSDP, zero 2/3): shard over groups of this many dp*cp ranks and replicate "
           "across the groups (default: shard over all of them)", default=None, optional=True),
    _count("cp", "context parallel: each sequence split over cp ranks (2 of its 2*cp chunks each, the causal load "
           "balance), keys and values all-gathered"),
    _count("tp", "tensor parallel: each block's matmuls split over tp ranks (DTensor colwise/rowwise)",
           searched=TP_DEGREES),
    Axis("sp", bool, False, "sequence parallel (needs tp > 1): norms and dropout on sequence shards, all-gathers "
         "and reduce-scatters instead of all-reduces", choices=(False, True)),
    Axis("tp_overlap", bool, False, "SP's all-gathers and reduce-scatters split into chunks that overlap the GEMMs "
         "they feed (Megatron-LM's --tp-comm-overlap on the fused stack, torchtitan's async TP on compile); needs "
         "sp; priced, not run (CUDA symmetric memory), and never chosen by the planner", choices=(False, True),
         searched=(False,)),
    Axis("fp8_param_gather", bool, False, "FP8 weights (Megatron-LM's --fp8-param-gather; dtype fp8 on the fused "
         "stack): each weight's compute copy held and all-gathered in FP8, 1 byte in place of bf16 and its FP8 cast; "
         "priced, not run, and never chosen by the planner", choices=(False, True), searched=(False,)),
    _count("pp", "pipeline stages (torch.distributed.pipelining)"),
    Axis("schedule", str, "1f1b", "pipeline schedule: 1f1b, gpipe, interleaved (vpp chunks per rank), "
         "zero-bubble (ZB1P: the backward split into input and weight gradients, the weights' filling the "
         "bubble; vpp chunks per rank), or zbv (ZB-V: the same split, two chunks per rank placed in a V, the "
         "first and last stages on rank 0; vpp 2)", choices=SCHEDULES),
    _count("vpp", "model chunks per pipeline rank (interleaved, zero-bubble and zbv (2) schedules)", high=MAX_LAYERS,
           searched=(2, 3, 4)),
    _count("ep", "expert parallel: a mixture-of-experts layer's experts split over ep of the data-parallel ranks, "
           "tokens routed to them by all-to-all"),
    Axis("zero", int, 0, "ZeRO stage: 0 replicated, 1 optimizer state sharded, 2 and gradients, 3 and weights "
         "(FSDP2)", choices=ZERO_STAGES),
    Axis("offload", bool, False, "FSDP2's CPUOffloadPolicy (zero 2/3): sharded weights, gradients and AdamW state in "
         "host memory, the optimizer stepping on the host", choices=(False, True)),
    Axis("compression", str, "none", "gradient compression on DDP's all-reduce: none, fp16, bf16, int8, topk or "
         "powersgd (lossy ones are searched only with --allow-compression)", choices=COMPRESSION),
    Axis("stack", str, "eager", "kernel stack: eager (PyTorch's ops as they are), compile (each block torch.compile'd; both "
         "run by `parallax run`) or fused (Megatron-LM / Transformer Engine; priced, not run)", choices=STACKS),
    _count("micro_batch", "sequences per micro-batch and data-parallel replica", high=MAX_GLOBAL_BATCH),
    Axis("master_dtype", str, "fp32", "the weights' own precision, the copy the optimizer updates: fp32 (beside a "
         "16-bit compute copy) or bf16 (the weights are the bf16 copy); kept as given, never lowered by the planner",
         choices=STATE_DTYPES, searched=("fp32",)),
    Axis("optimizer_dtype", str, "fp32", "AdamW's two moments: fp32 or bf16 (the eager and compile stacks run "
         "torch's AdamW, which keeps them in the weights' dtype); kept as given, never lowered by the planner",
         choices=STATE_DTYPES, searched=("fp32",)),
    Axis("reduce_dtype", str, None, "the dtype gradients are reduced in over data parallelism: fp32, bf16 or fp16 "
         "(default: the stack's recipe: FSDP2 units in fp32 as torchtitan, DDP in the weights' dtype, Megatron in 16 bits)", choices=REDUCE_DTYPES,
         optional=True, searched=(None,)),
    Axis("accumulation", str, "reduce_each", "gradient accumulation under FSDP2 (zero 2/3): reduce_each "
         "reduce-scatters after every micro-batch; hold_unsharded holds the unsharded gradients until the step's "
         "last micro-batch and reduces once (more memory, fewer collectives)", choices=ACCUMULATION),
    Axis("ddp_bucket_view", bool, True, "DDP's gradients as views into its all-reduce buckets (torch DDP's "
         "gradient_as_bucket_view, as the executor runs it); false is torch DDP's own default, also Lightning's and "
         "Accelerate's: a bucket copy of every gradient, held from DDP's construction on, and each gradient copied "
         "in and back once a step; applies where DDP reduces (zero 0, tp 1, pp 1, dp > 1); never chosen by the "
         "planner", choices=(True, False), searched=(True,)),
    Axis("recompute", str, "none", "activation recomputation of every block: none, selective, op or full (the solver "
         "picks per layer)", choices=RECOMPUTE),
)
AXIS: dict[str, Axis] = {axis.name: axis for axis in AXES}
PINNABLE: tuple[str, ...] = tuple(axis.name for axis in AXES if axis.pinnable)
LAYOUT_AXES: tuple[str, ...] = tuple(a.name for a in AXES if a.name != "recompute")  # recompute is per layer (StagePlan)


def axis_problem(name: str, value: object) -> str | None:
    """Why `value` is not a value of axis `name`, or None (an unknown axis names the known ones)."""
    if name not in AXIS:
        return f"unknown field {name!r}; pin any of {', '.join(PINNABLE)}"
    return AXIS[name].check(value)
