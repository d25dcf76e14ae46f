"""The one rulebook: which layouts are legal, and which of those the executor runs.

Two tiers, one function each, every caller asking the same one:
- `structural_problem(layout, seq_len)`: what holds for any model (sp needs tp > 1, the
  interleaved schedule needs pp >= 2, dp_shard and ep divide dp*cp, cp's chunks divide the
  sequence). A Plan read from a file is refused by these (`layout.plan.Plan`'s validator).
- `layout_problem(layout, facts, seq_len, m)`: the structural rules, then what the executor
  runs on this model (heads TP divides, pipeline stages the blocks fill, the data-parallel
  path compression hooks into). The planner offers a layout only when it finds nothing, and
  the executor refuses a plan (before any process starts) only through it, so a plan the
  planner chose is never refused. A whole plan's extra rules (its stages' recomputation under
  the zero-bubble schedule, uneven data-parallel shares) sit beside the Plan
  (`layout.plan.plan_problem`), which calls this one: the rulebook never imports the Plan.

Model facts come from the planner's workload when planning and from the nn.Module when
running (`ModelFacts`); both describe the same model.
"""
from __future__ import annotations

from dataclasses import dataclass

from hardware.errors import PlanError

from .axes import CHUNKED_SCHEDULES, COMPRESSION, RECOMPUTE, SCHEDULES, TP_DEGREES, V_SCHEDULES
from .layout import Layout

EXECUTED_STACKS = ("eager", "compile")  # PyTorch's ops as they are, or each block torch.compile'd; not Megatron's kernels
TP_SPLIT_MODULES = ("Linear", "Embedding")  # nn classes DTensor's colwise/rowwise styles split (GPT-2's Conv1D is not)


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


def structural_problem(layout: Layout, seq_len: int | None = None) -> PlanError | None:
    """The first rule `layout` breaks whatever the model, or None (`seq_len`: checked when given)."""
    for check in (_sp_structure, _schedule_structure, _shard_structure, _ep_structure, _accumulation_structure,
                  _bucket_structure, _state_structure):
        if (problem := check(layout)) is not None:
            return problem
    if seq_len is not None and layout.cp > 1 and seq_len % (2 * layout.cp):
        return PlanError("cp", f"seq_len {seq_len} is not a multiple of 2*cp = {2 * layout.cp} (two chunks per cp rank)",
                         f"use a cp whose 2*cp divides {seq_len}")
    return None


def layout_problem(layout: Layout, facts: ModelFacts, seq_len: int, micro_batches: int | None = None) -> PlanError | None:
    """The first reason the executor cannot run `layout` on the model, or None.
    `micro_batches` (per step and pipeline) is checked against the schedule when given."""
    problem = structural_problem(layout, seq_len)
    checks = (_stack_problem, _tp_problem, _sp_problem, _pp_problem, _zero_bubble_problem, _cp_problem, _ep_problem,
              _offload_problem, _compression_problem, _seq_problem)
    for check in checks:
        if problem is not None:
            return problem
        problem = check(layout, facts, seq_len)
    if problem is None and micro_batches is not None:
        problem = _micro_batch_problem(layout, micro_batches)
    return problem


def check_world(layout: Layout, world: int, what: str, hint: str) -> None:
    """The degrees multiply to the GPUs or processes there are: `what` names them ("GPUs on
    the hardware", "processes run"), `hint` the way out."""
    if layout.n_gpus != world:
        raise PlanError("dp*cp*tp*pp", f"{layout.dp}*{layout.cp}*{layout.tp}*{layout.pp} = {layout.n_gpus}, but "
                        f"{world} {what}", hint)


def valid_tp(facts: ModelFacts) -> list[int]:
    """The TP degrees that divide the model's heads and key/value heads."""
    return [t for t in TP_DEGREES if all(c is None or c % t == 0 for c in (facts.heads, facts.kv_heads))]


# --- any model -------------------------------------------------------------------

def _sp_structure(f: Layout) -> PlanError | None:
    if f.tp_overlap and not (f.sp and f.tp > 1):
        return PlanError("tp_overlap", "TP overlap chunks SP's all-gathers and reduce-scatters; the layout has "
                         + ("tp=1" if f.tp == 1 else "no sp"), "use tp > 1 with sp, or tp_overlap off")
    if f.sp and f.tp == 1:
        return PlanError("sp", "sequence parallelism needs tp > 1", "turn sp off")
    if f.tp_overlap and f.stack == "eager":
        return PlanError("tp_overlap", "TP overlap runs on Megatron-LM's kernels (fused) or torchtitan's compiled "
                         "async TP (compile), not on the eager stack", "use stack fused or compile, or tp_overlap off")
    return None


def _schedule_structure(f: Layout) -> PlanError | None:
    if f.schedule not in CHUNKED_SCHEDULES and f.vpp != 1:
        return PlanError("vpp", f"vpp={f.vpp} needs a schedule of model chunks ({' or '.join(CHUNKED_SCHEDULES)})",
                         "use vpp 1, or the interleaved schedule")
    if f.schedule in CHUNKED_SCHEDULES and f.pp < 2:
        return PlanError("schedule", f"the {f.schedule} schedule needs pp >= 2", "use 1f1b")
    if f.schedule in V_SCHEDULES and f.vpp != 2:
        return PlanError("vpp", f"the {f.schedule} schedule runs exactly two chunks per rank (a V), the layout has "
                         f"vpp={f.vpp}", "use vpp 2 with zbv, or the zero-bubble schedule")
    return None


def _shard_structure(f: Layout) -> PlanError | None:
    shard, ranks = f.dp_shard, f.data_parallel
    if shard is not None and (f.zero < 2 or ranks % shard):
        valid = [d for d in range(1, min(ranks, 4096) + 1) if ranks % d == 0]
        return PlanError("dp_shard", f"dp_shard={shard} (hybrid sharding) needs zero 2 or 3 and a divisor of "
                         f"dp*cp={ranks}", f"use zero 3 with dp_shard in {valid}")
    return None


def _ep_structure(f: Layout) -> PlanError | None:
    if f.data_parallel % f.ep:
        return PlanError("ep", f"ep={f.ep} must divide the data-parallel ranks dp*cp = {f.data_parallel}",
                         "use a divisor of dp*cp")
    return None


def _accumulation_structure(f: Layout) -> PlanError | None:
    if f.accumulation != "hold_unsharded":
        return None
    if f.zero < 2:
        return PlanError("accumulation", f"hold_unsharded is FSDP2's (zero 2/3); zero={f.zero} already holds whole "
                         "gradients until the step's last micro-batch", "use reduce_each, or zero 2 or 3")
    if f.pp > 1:
        return PlanError("accumulation", "a pipeline schedule holds FSDP2's gradients until the step's end itself",
                         "use reduce_each with pp > 1")
    return None


def _bucket_structure(f: Layout) -> PlanError | None:
    if f.ddp_bucket_view or f.reduces_through_ddp:
        return None
    off = [f"{name} {value}" for name, value, ddp in (("zero", f.zero, f.zero == 0), ("tp", f.tp, f.tp == 1),
                                                       ("pp", f.pp, f.pp == 1)) if not ddp]
    return PlanError("ddp_bucket_view", "false (bucket copies) needs DDP, which reduces only with zero 0, tp 1 and "
                     f"pp 1 over more than one data-parallel rank ({', '.join(off) or 'one rank'} here)",
                     "leave ddp_bucket_view true, or pin zero 0, tp 1 and pp 1")


def _state_structure(f: Layout) -> PlanError | None:
    """torch's AdamW keeps its moments in each weight's dtype, and DDP (or the executor's per-weight
    all-reduce) reduces gradients in the dtype autograd made them in, the weights'."""
    if f.stack != "fused" and f.optimizer_dtype != f.master_dtype:
        return PlanError("optimizer_dtype", f"{f.optimizer_dtype} moments beside {f.master_dtype} weights: torch's "
                         f"AdamW (the {f.stack} stack's) keeps its moments in the weights' dtype",
                         f"use optimizer_dtype {f.master_dtype}, or stack fused")
    if f.stack != "fused" and f.zero < 2 and f.reduce_dtype not in (None, f.master_dtype):
        return PlanError("reduce_dtype", f"zero={f.zero} reduces through DDP or a per-weight all-reduce, in the weights' "
                         f"dtype ({f.master_dtype})", "leave reduce_dtype unset and use compression bf16 or fp16 for "
                         "16-bit traffic, or zero 2/3")
    return None


def precision_problem(f: Layout, dtype: str) -> PlanError | None:
    """The precision policy against the compute dtype: fp32 training keeps every state in
    fp32; bf16 weights need bf16 compute (fp16 weights would need loss scaling); a 16-bit
    reduction is the compute's own 16-bit type; FP8 weights are Transformer Engine's."""
    if f.fp8_param_gather and (dtype != "fp8" or f.stack != "fused"):
        return PlanError("fp8_param_gather", f"FP8 weights under {dtype} compute on the {f.stack} stack: they are "
                         "Transformer Engine's (Megatron-LM's --fp8-param-gather)", "use dtype fp8 with stack fused, "
                         "or fp8_param_gather off")
    if dtype == "fp32":
        for name in ("master_dtype", "optimizer_dtype", "reduce_dtype"):
            if getattr(f, name) not in (None, "fp32"):
                return PlanError(name, f"{getattr(f, name)} with fp32 compute", f"use {name} fp32, or dtype bf16")
        return None
    if f.master_dtype == "bf16" and dtype == "fp16":
        return PlanError("master_dtype", "bf16 weights under fp16 compute", "use dtype bf16, or master_dtype fp32")
    half = "fp16" if dtype == "fp16" else "bf16"
    if f.reduce_dtype not in (None, "fp32", half):
        return PlanError("reduce_dtype", f"{f.reduce_dtype} reduction of {dtype} compute", f"use fp32 or {half}")
    return None


# --- what the executor runs on this model ------------------------------------------

def _stack_problem(f: Layout, facts: ModelFacts, seq_len: int) -> PlanError | None:
    """Other stacks, and TP overlap, are priced (a pinned what-if, a published run), not run."""
    if f.stack not in EXECUTED_STACKS:
        return PlanError("stack", f"the executor runs the eager and compile stacks; {f.stack!r} is priced, not run",
                         "use stack 'eager' or 'compile' to run the plan")
    if f.tp_overlap:
        return PlanError("tp_overlap", "TP overlap needs CUDA symmetric memory (async TP) or Transformer Engine's "
                         "userbuffers; it is priced, not run", "use tp_overlap off to run the plan")
    return None


def _micro_batch_problem(f: Layout, m: int) -> PlanError | None:
    """torch.distributed.pipelining's own conditions on the micro-batch count."""
    if f.pp > 1 and f.schedule == "1f1b" and m < f.pp:
        return PlanError("micro_batch", f"1F1B over pp={f.pp} stages needs at least {f.pp} micro-batches, "
                         f"the plan has {m}", "use a smaller micro_batch, the gpipe schedule, or a smaller pp")
    rounds = max(1, m // f.pp)
    if f.pp > 1 and f.schedule in CHUNKED_SCHEDULES and m % rounds:
        return PlanError("micro_batch", f"the {f.schedule} schedule needs a micro-batch count that is a multiple of "
                         f"{rounds} rounds, the plan has {m}", f"use a multiple of pp={f.pp} micro-batches")
    return None


def _tp_problem(f: Layout, facts: ModelFacts, seq_len: int) -> PlanError | None:
    if f.tp == 1:
        return None
    if not facts.tp_splittable:
        return PlanError("tp", f"{facts.name}'s blocks have no projection the executor can tensor-split "
                         f"(it splits {' and '.join('nn.' + m for m in TP_SPLIT_MODULES)} modules only)", "use tp=1")
    for count, what in ((facts.heads, "attention heads"), (facts.kv_heads, "key/value heads")):
        if count is not None and count % f.tp:
            return PlanError("tp", f"tp={f.tp} does not divide the {count} {what}", f"use one of {valid_tp(facts)}")
    return None


def _sp_problem(f: Layout, facts: ModelFacts, seq_len: int) -> PlanError | None:
    if not f.sp:
        return None
    if seq_len % f.tp:
        return PlanError("sp", f"seq_len {seq_len} is not divisible by tp={f.tp}", "turn sp off or change tp")
    if facts.n_experts:
        return moe_sp_problem(facts)
    if facts.vocab is not None and facts.vocab % f.tp:
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


def _pp_problem(f: Layout, facts: ModelFacts, seq_len: int) -> PlanError | None:
    if f.schedule not in SCHEDULES:  # unreachable through a validated Layout; kept for a model_construct'ed one
        return PlanError("schedule", f"unknown schedule {f.schedule!r}", f"use one of {', '.join(SCHEDULES)}")
    if f.pp * f.vpp > facts.n_blocks:
        return PlanError("pp", f"pp*vpp = {f.pp * f.vpp} stages for {facts.n_blocks} blocks",
                         f"use pp*vpp <= {facts.n_blocks}")
    return None


def allowed_recompute(layout: Layout) -> tuple[str, ...]:
    """The recompute policies the executor runs with `layout` (see `layout.plan.plan_problem`);
    on the fused stack those Megatron-LM runs: it has no op-level checkpointing (torch's)."""
    if layout.splits_backward:
        return ("none",)
    return tuple(p for p in RECOMPUTE if p != "op") if layout.stack == "fused" else RECOMPUTE


def _zero_bubble_problem(f: Layout, facts: ModelFacts, seq_len: int) -> PlanError | None:
    """torch's zero-bubble schedules (ZB1P and ZBV) split each backward into input and weight gradients; run
    on CPU against the single-process reference, that matches over DDP-style replication
    (zero 0/1) and TP, but FSDP2's sharded gradients (zero 2/3) come out wrong and SP's
    DTensor backward fails to split, so those are refused rather than offered. A compiled block's
    backward is one autograd node computing both: split, it would run twice (and its donated
    buffers refuse the retained graph)."""
    if not f.splits_backward:
        return None
    name = f.schedule
    if f.stack == "compile":
        return PlanError("schedule", f"the {name} schedule on the compile stack: a compiled block's backward "
                         "does not split into input and weight gradients", "use the 1f1b or interleaved schedule, "
                         "or the eager stack")
    if f.zero >= 2:
        return PlanError("zero", f"zero={f.zero} with the {name} schedule: FSDP2's sharded gradients miss "
                         "the split weight gradients", f"use zero 0 or 1 with {name}, or another schedule")
    if f.sp:
        return PlanError("sp", f"sequence parallelism with the {name} schedule: its backward does not split",
                         f"turn sp off with {name}, or use another schedule")
    if f.ep > 1:
        return PlanError("ep", f"expert parallelism with the {name} schedule is not run", "use ep 1 or another schedule")
    return None


def _cp_problem(f: Layout, facts: ModelFacts, seq_len: int) -> PlanError | None:
    """Context parallelism runs on its own data path (sequence chunks, gathered keys and
    values; executor/apply/context_parallel.py): without pipeline stages or compression hooks."""
    if f.cp == 1:
        return None
    if not facts.cp_routable:
        return PlanError("cp", f"{facts.name}'s attention cannot be routed through the gathered keys and values "
                         "(an HF attention registry or an `attend` hook is needed)", "use cp=1")
    if f.pp > 1:
        return PlanError("cp", f"cp={f.cp} with pp={f.pp}: the executor runs context parallelism without pipeline "
                         "stages", "use pp=1 with cp, or cp=1")
    if f.compression != "none":
        return PlanError("compression", "gradient compression is not offered with context parallelism", "use 'none'")
    return None


def _ep_problem(f: Layout, facts: ModelFacts, seq_len: int) -> PlanError | None:
    """Expert parallelism (executor/apply/expert_parallel.py) over the data-parallel ranks (dp*cp):
    with TP (experts whole on every TP rank), pipeline stages and CP. Its expert weights
    reduce over their own replicas (beside DDP, or as their own FSDP2 units), which hybrid
    sharding's 2-D mesh and DDP's compression hooks do not cover."""
    if f.ep == 1:
        return None
    if not facts.n_experts or facts.n_experts % f.ep:
        valid = [e for e in range(1, facts.n_experts + 1) if facts.n_experts % e == 0] or [1]
        return PlanError("ep", f"ep={f.ep} needs a mixture-of-experts model whose experts it divides "
                         f"({facts.name} has {facts.n_experts or 'no'} experts per layer)", f"use ep in {valid}")
    if f.dp_shard is not None or f.compression != "none":
        return PlanError("ep", f"ep={f.ep} runs without hybrid sharding (dp_shard) and gradient compression",
                         "drop dp_shard and compression with ep, or use ep=1")
    return None


def _offload_problem(f: Layout, facts: ModelFacts, seq_len: int) -> PlanError | None:
    """Offload is FSDP2's CPUOffloadPolicy: sharded states, so ZeRO-2/3; expert units
    (their own FSDP2 meshes) are not offloaded."""
    if not f.offload:
        return None
    if f.zero < 2:
        return PlanError("offload", f"offload moves FSDP2's sharded states to the host; zero={f.zero} has none",
                         "use zero 2 or 3 with offload")
    if f.ep > 1:
        return PlanError("offload", "expert-parallel units are not offloaded", "use ep=1 with offload")
    return None


def _compression_problem(f: Layout, facts: ModelFacts, seq_len: int) -> PlanError | None:
    if f.compression not in COMPRESSION:  # as _pp_problem: for a model_construct'ed layout
        return PlanError("compression", f"unknown method {f.compression!r}", f"use one of {', '.join(COMPRESSION)}")
    if f.compression != "none" and not f.reduces_through_ddp:
        return PlanError("compression", "gradient compression runs as DDP communication hooks: it needs dp > 1, "
                         "zero 0, tp=1 and pp=1", "use compression none, or dp > 1 with zero 0, tp 1 and pp 1")
    if f.compression != "none" and f.zero != 0:
        return PlanError("compression", f"zero={f.zero} shards the optimizer step outside DDP's hooks",
                         "use zero 0 with compression")
    return None


def _seq_problem(f: Layout, facts: ModelFacts, seq_len: int) -> PlanError | None:
    if facts.max_seq_len is not None and seq_len > facts.max_seq_len:
        return PlanError("seq_len", f"{seq_len} exceeds {facts.name}'s {facts.max_seq_len} positions",
                         f"use at most {facts.max_seq_len}")
    return None
