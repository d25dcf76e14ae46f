"""What the executor runs: the one declaration that the layout space and the
executor's validation both read.

The planner offers a layout only if `layout_problem` finds nothing wrong with
it, and the executor refuses a plan (before any process starts) only through
the same function, so a plan the planner chose is never refused. Model facts
come from the planner's workload when planning and from the nn.Module when
running; both describe the same model.

The executor composes what torch provides, applied in this order:
pipeline (torch.distributed.pipelining: GPipe, 1F1B, interleaved 1F1B over any
number of chunks that the blocks fill) -> tensor parallel (DTensor colwise /
rowwise on nn.Linear and nn.Embedding, sequence parallel on the norms, across
pipeline stages too) -> expert parallel (MoE experts split over ep data-parallel
ranks, all-to-all; whole on every TP rank, so no SP) -> context parallel (sequence
chunks, keys and values all-gathered; pp=1) -> activation checkpointing (per
layer) -> data parallel
(DDP, or FSDP2's replicate where parameters are DTensors or the rank is a
pipeline stage; ZeRO-1 shards the optimizer state over dp; FSDP2 for ZeRO-2/3,
on the 2-D (dp_replicate, dp_shard) mesh for hybrid sharding).
Gradient compression runs as DDP communication hooks, so it needs the DDP path.
"""
from __future__ import annotations

from dataclasses import dataclass

from costmodel.plan import Plan
from hardware.errors import PlanError

# Module classes whose weights DTensor's ColwiseParallel / RowwiseParallel split.
# Anything else holding a GEMM weight (GPT-2's fused Conv1D) stays replicated, so a
# block built from it is not tensor-parallel at all.
TP_SPLIT_MODULES = ("Linear", "Embedding")
SCHEDULES = ("1f1b", "gpipe", "interleaved")


def block_container(model) -> str | None:
    """Where the executor finds a model's repeated blocks: the largest ModuleList/ModuleDict
    of same-typed children (its name), or None when there is none to map layers from."""
    from torch import nn

    best, size = None, 0
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > size:
            if len({type(child) for child in module.children()}) == 1:
                best, size = name, len(module)
    return best


def tp_split_classes() -> tuple[type, ...]:
    """The classes of TP_SPLIT_MODULES (torch imported only when asked)."""
    from torch import nn

    return tuple(getattr(nn, name) for name in TP_SPLIT_MODULES)
COMPRESSION = ("none", "fp16", "bf16", "int8", "topk", "powersgd")


@dataclass(frozen=True)
class ModelFacts:
    """The few facts about a model that decide what the executor can run on it."""

    n_blocks: int
    heads: int | None = None
    kv_heads: int | None = None
    tp_splittable: bool = True
    max_seq_len: int | None = None
    vocab: int | None = None
    name: str = "the model"
    cp_routable: bool = True  # its attention is reachable: HF's attention registry or the reference GPT's `attend`
    n_experts: int = 0  # experts per mixture-of-experts layer (0: a dense model)


@dataclass(frozen=True)
class LayoutFields:
    dp: int
    tp: int
    pp: int
    sp: bool = False
    zero: int = 0
    schedule: str = "1f1b"
    vpp: int = 1
    compression: str = "none"
    dp_shard: int | None = None
    cp: int = 1
    ep: int = 1
    stack: str = "eager"
    offload: bool = False

    @property
    def data_parallel(self) -> int:
        return self.dp * self.cp


def facts_of_workload(workload) -> ModelFacts:
    """The planner's view: a traced or analytic `costmodel.workload.Workload`."""
    return ModelFacts(n_blocks=workload.n_blocks, heads=workload.heads, kv_heads=workload.kv_heads,
                      tp_splittable=workload.max_tp() != 1, max_seq_len=workload.max_seq_len, vocab=workload.vocab,
                      name=workload.name, n_experts=workload.n_experts)


def uses_ddp(fields) -> bool:
    """`costmodel.plan.Plan.reduces_through_ddp` for any layout-like object: the cost model
    prices the reduction path the executor takes from the same rule."""
    return Plan.reduces_through_ddp.fget(fields)


def layout_problem(fields, facts: ModelFacts, seq_len: int, micro_batches: int | None = None) -> PlanError | None:
    """The first reason the executor cannot run `fields` on the model, or None.
    `micro_batches` (per step and pipeline) is checked against the schedule when given."""
    checks = (_stack_problem, _tp_problem, _sp_problem, _pp_problem, _cp_problem, _ep_problem, _zero_problem,
              _offload_problem, _shares_problem, _compression_problem, _seq_problem)
    for check in checks:
        problem = check(fields, facts, seq_len)
        if problem is not None:
            return problem
    return _micro_batch_problem(fields, micro_batches) if micro_batches is not None else None


def check_layout(fields, facts: ModelFacts, seq_len: int, micro_batches: int | None = None) -> None:
    problem = layout_problem(fields, facts, seq_len, micro_batches)
    if problem is not None:
        raise problem


EXECUTED_STACKS = ("eager",)  # the executor runs PyTorch ops as they are: no torch.compile, no fused kernels


def _stack_problem(f, facts: ModelFacts, seq_len: int) -> PlanError | None:
    """Other stacks are priced (a pinned what-if, a published run), not run."""
    stack = getattr(f, "stack", "eager")
    if stack not in EXECUTED_STACKS:
        return PlanError("stack", f"the executor runs the eager stack; {stack!r} is priced, not run",
                         "use stack 'eager' to run the plan")
    return None


def _micro_batch_problem(f, m: int) -> PlanError | None:
    """torch.distributed.pipelining's own conditions on the micro-batch count."""
    if f.pp > 1 and f.schedule == "1f1b" and m < f.pp:
        return PlanError("micro_batch", f"1F1B over pp={f.pp} stages needs at least {f.pp} micro-batches, "
                         f"the plan has {m}", "use a smaller micro_batch, the gpipe schedule, or a smaller pp")
    rounds = max(1, m // f.pp)
    if f.pp > 1 and f.schedule == "interleaved" and m % rounds:
        return PlanError("micro_batch", f"interleaved 1F1B needs a micro-batch count that is a multiple of "
                         f"{rounds} rounds, the plan has {m}", f"use a multiple of pp={f.pp} micro-batches")
    return None


def _tp_problem(f, facts: ModelFacts, seq_len: int) -> PlanError | None:
    if f.tp == 1:
        return None
    if not facts.tp_splittable:
        return PlanError("tp", f"{facts.name}'s blocks have no projection the executor can tensor-split "
                         f"(it splits {' and '.join('nn.' + m for m in TP_SPLIT_MODULES)} modules only)", "use tp=1")
    for count, what in ((facts.heads, "attention heads"), (facts.kv_heads, "key/value heads")):
        if count is not None and count % f.tp:
            valid = [t for t in (1, 2, 4, 8, 16, 32, 64) if all(c is None or c % t == 0 for c in (facts.heads, facts.kv_heads))]
            return PlanError("tp", f"tp={f.tp} does not divide the {count} {what}", f"use one of {valid}")
    return None


def _sp_problem(f, facts: ModelFacts, seq_len: int) -> PlanError | None:
    if f.sp and f.tp == 1:
        return PlanError("sp", "sequence parallelism needs tp > 1", "turn sp off")
    if f.sp and seq_len % f.tp:
        return PlanError("sp", f"seq_len {seq_len} is not divisible by tp={f.tp}", "turn sp off or change tp")
    if f.sp and facts.n_experts:
        return moe_sp_problem(facts)
    if f.sp and facts.vocab is not None and facts.vocab % f.tp:
        # the embedding and head then stay replicated, and a replicated module cannot take
        # the sequence-sharded stream
        return PlanError("sp", f"tp={f.tp} does not divide {facts.name}'s {facts.vocab} vocabulary entries, "
                         "which sequence parallelism needs split", "turn sp off or use a tp dividing the vocabulary")
    return None


def moe_sp_problem(facts: ModelFacts) -> PlanError:
    """The router and the 3-D expert weights stay whole on every TP rank (no DTensor style
    splits them), and a replicated module cannot take the sequence-sharded stream."""
    return PlanError("sp", f"{facts.name}'s mixture-of-experts layers stay whole on every TP rank, "
                     "so its residual stream cannot be sequence-sharded", "turn sp off")


def _pp_problem(f, facts: ModelFacts, seq_len: int) -> PlanError | None:
    if f.schedule not in SCHEDULES:
        return PlanError("schedule", f"unknown schedule {f.schedule!r}", f"use one of {', '.join(SCHEDULES)}")
    if f.schedule == "interleaved" and f.pp < 2:
        return PlanError("schedule", "the interleaved schedule needs pp >= 2", "use 1f1b")
    if f.pp * f.vpp > facts.n_blocks:
        return PlanError("pp", f"pp*vpp = {f.pp * f.vpp} stages for {facts.n_blocks} blocks",
                         f"use pp*vpp <= {facts.n_blocks}")
    return None


def _cp_problem(f, facts: ModelFacts, seq_len: int) -> PlanError | None:
    """Context parallelism runs on its own data path (sequence chunks, gathered keys and
    values; executor/context_parallel.py): without pipeline stages or compression hooks."""
    cp = getattr(f, "cp", 1)
    if cp == 1:
        return None
    if not facts.cp_routable:
        return PlanError("cp", f"{facts.name}'s attention cannot be routed through the gathered keys and values "
                         "(an HF attention registry or an `attend` hook is needed)", "use cp=1")
    if f.pp > 1:
        return PlanError("cp", f"cp={cp} with pp={f.pp}: the executor runs context parallelism without pipeline "
                         "stages", "use pp=1 with cp, or cp=1")
    if seq_len % (2 * cp):
        return PlanError("cp", f"seq_len {seq_len} is not a multiple of 2*cp = {2 * cp}",
                         f"use a cp whose 2*cp divides {seq_len}")
    if getattr(f, "compression", "none") != "none":
        return PlanError("compression", "gradient compression is not offered with context parallelism", "use 'none'")
    return None


def _ep_problem(f, facts: ModelFacts, seq_len: int) -> PlanError | None:
    """Expert parallelism (executor/expert_parallel.py) over the data-parallel ranks (dp*cp):
    with TP (experts whole on every TP rank), pipeline stages and CP. Its expert weights
    reduce over their own replicas (beside DDP, or as their own FSDP2 units), which hybrid
    sharding's 2-D mesh and DDP's compression hooks do not cover."""
    ep = getattr(f, "ep", 1)
    if ep == 1:
        return None
    if not facts.n_experts or facts.n_experts % ep:
        return PlanError("ep", f"ep={ep} needs a mixture-of-experts model whose experts it divides "
                         f"({facts.name} has {facts.n_experts or 'no'} experts per layer)", "use ep=1")
    if getattr(f, "dp_shard", None) is not None or getattr(f, "compression", "none") != "none":
        return PlanError("ep", f"ep={ep} runs without hybrid sharding (dp_shard) and gradient compression",
                         "drop dp_shard and compression with ep, or use ep=1")
    ranks = f.dp * getattr(f, "cp", 1)
    if ranks % ep:
        return PlanError("ep", f"ep={ep} must divide dp*cp={ranks}", "use a divisor of dp*cp")
    return None


def _zero_problem(f, facts: ModelFacts, seq_len: int) -> PlanError | None:
    if f.zero not in (0, 1, 2, 3):
        return PlanError("zero", f"{f.zero!r} is not a ZeRO stage", "use 0, 1, 2 or 3")
    shard = getattr(f, "dp_shard", None)
    ranks = f.dp * getattr(f, "cp", 1)
    if shard is not None and (f.zero < 2 or shard < 1 or ranks % shard):
        valid = [d for d in range(1, ranks + 1) if ranks % d == 0]
        return PlanError("dp_shard", f"dp_shard={shard} (hybrid sharding) needs zero 2 or 3 and a divisor of dp*cp={ranks}",
                         f"use zero 3 with dp_shard in {valid}")
    return None


def _offload_problem(f, facts: ModelFacts, seq_len: int) -> PlanError | None:
    """Offload is FSDP2's CPUOffloadPolicy: sharded states, so ZeRO-2/3; expert units
    (their own FSDP2 meshes) are not offloaded."""
    if not getattr(f, "offload", False):
        return None
    if f.zero < 2:
        return PlanError("offload", f"offload moves FSDP2's sharded states to the host; zero={f.zero} has none",
                         "use zero 2 or 3 with offload")
    if getattr(f, "ep", 1) > 1:
        return PlanError("offload", "expert-parallel units are not offloaded", "use ep=1 with offload")
    return None


def _shares_problem(f, facts: ModelFacts, seq_len: int) -> PlanError | None:
    """Uneven data-parallel shares: each replica runs its own micro-batch count and the gradients
    reduce once per step, which DDP's one bucketed all-reduce allows; FSDP2 reduces per
    micro-batch, and pipeline schedules run one count on every stage."""
    if getattr(f, "dp_micro_batches", None) and not uses_ddp(f):
        return PlanError("dp_micro_batches", "uneven data-parallel shares run on DDP's path: dp > 1 with zero 0 "
                         "or 1, tp 1, pp 1", "use even shares with this layout, or such a layout")
    return None


def _compression_problem(f, facts: ModelFacts, seq_len: int) -> PlanError | None:
    if f.compression not in COMPRESSION:
        return PlanError("compression", f"unknown method {f.compression!r}", f"use one of {', '.join(COMPRESSION)}")
    if f.compression != "none" and not uses_ddp(f):
        return PlanError("compression", "gradient compression runs as DDP communication hooks: it needs dp > 1, "
                         "zero 0, tp=1 and pp=1",
                         "use compression none, or dp > 1 with zero 0, tp 1 and pp 1")
    if f.compression != "none" and f.zero != 0:
        return PlanError("compression", f"zero={f.zero} shards the optimizer step outside DDP's hooks",
                         "use zero 0 with compression")
    return None


def _seq_problem(f, facts: ModelFacts, seq_len: int) -> PlanError | None:
    if facts.max_seq_len is not None and seq_len > facts.max_seq_len:
        return PlanError("seq_len", f"{seq_len} exceeds {facts.name}'s {facts.max_seq_len} positions",
                         f"use at most {facts.max_seq_len}")
    return None
