"""Megatron-LM: the argument list of `pretrain_gpt.py`.

Megatron-LM does not install on these machines; the flag names follow its argument parser,
megatron/training/arguments.py (NVIDIA/Megatron-LM, read at the commit named in
`SOURCE`), and `tests/test_formats.py` holds every flag written here to that list.

What maps: tensor, pipeline, virtual-pipeline, context and expert degrees, sequence
parallelism, ZeRO-1 as the distributed optimizer and ZeRO-2/3 as Megatron FSDP's sharding
strategies, the micro and global batch, bf16/fp16/FP8, bf16 gradient reduction, the
recompute granularity and method (full on the first N blocks of every stage is
`--recompute-method block`), an uneven pipeline split (first and last stage's blocks), and
the model's dimensions. Megatron runs its fused kernels (Transformer Engine), so only a plan
priced on the `fused` stack maps whole.
"""
from __future__ import annotations

from typing import Any

from hardware.errors import FormatError
from layout.plan import Plan

from . import argv
from .common import Exported, Losses, Stated, block_recompute, blocks_of_stages, is_even_split, n_nodes, recipe_losses, uniform

NAME = "megatron"
PINS = {"stack": "fused", "offload": False}  # what a search for a Megatron-LM run may not change
SOURCE = ("NVIDIA/Megatron-LM megatron/training/arguments.py at d98e8a64ddf3 (2026-08-22): its add_argument calls, and "
          "the TransformerConfig/ModelParallelConfig fields it turns into --field-name flags (argument_utils.py)")
SHARDING = {2: "optim_grads", 3: "optim_grads_params"}  # --data-parallel-sharding-strategy of Megatron FSDP
FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
         "--context-parallel-size", "--expert-model-parallel-size", "--sequence-parallel", "--tp-comm-overlap",
         "--use-distributed-optimizer",
         "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--micro-batch-size", "--global-batch-size",
         "--seq-length", "--max-position-embeddings", "--bf16", "--fp16", "--fp8-format", "--grad-reduce-in-bf16",
         "--fp8-param-gather", "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
         "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--num-layers", "--hidden-size",
         "--num-attention-heads", "--group-query-attention", "--num-query-groups", "--ffn-hidden-size", "--swiglu",
         "--vocab-size", "--untie-embeddings-and-output-weights", "--num-experts", "--moe-router-topk")


def export(plan: Plan, lossy: bool) -> Exported:
    losses = Losses("Megatron-LM")
    _unsayable(plan, losses)
    options: list[tuple[str, Any]] = [
        ("--tensor-model-parallel-size", plan.tp), ("--pipeline-model-parallel-size", plan.pp),
        ("--context-parallel-size", plan.cp), ("--expert-model-parallel-size", plan.ep),
        ("--sequence-parallel", plan.sp), ("--tp-comm-overlap", plan.tp_overlap), *_sharding(plan),
        *_pipeline(plan, losses),
        ("--micro-batch-size", plan.micro_batch), ("--global-batch-size", plan.global_batch),
        ("--seq-length", plan.seq_len), *_precision(plan), *_recompute(plan, losses), *_model(plan, losses)]
    nodes, per_node = n_nodes(plan)
    header = f"Megatron-LM arguments for {plan.model} on {plan.hardware}: {plan.layout_tag}\n(written by parallax export)"
    return Exported(format=NAME, text=argv.write(options, header), lost=losses.settle(lossy),
                    launch=f"torchrun --nnodes {nodes} --nproc-per-node {per_node} pretrain_gpt.py $(grep -v '^#' FILE)")


def _unsayable(plan: Plan, losses: Losses) -> None:
    recipe_losses(plan, losses, {"tp_overlap": (True,), "fp8_param_gather": (True,),
                                 "reduce_dtype": ("fp32",) if _bf16_path(plan) else ()})
    if plan.stack != "fused":
        losses.add("stack", f"the {plan.stack} stack: Megatron runs its fused kernels (plan with --stack fused)")
    if plan.offload:
        losses.add("offload", "FSDP2's offload of weights and gradients (Megatron's --optimizer-cpu-offload moves "
                   "the optimizer only)")
    if plan.zero >= 2 and plan.dp_replicate > 1:
        losses.add("dp_shard", "hybrid sharding (Megatron FSDP shards over the whole data-parallel group)")
    if plan.compression != "none":
        losses.add("compression", f"{plan.compression} gradient compression (Megatron reduces the gradients in the "
                   "buffer they accumulate in: 16-bit with --grad-reduce-in-bf16, else fp32 under bf16)")
    if plan.schedule in ("gpipe", "zero-bubble", "zbv") and plan.pp > 1:
        losses.add("schedule", f"the {plan.schedule} schedule (Megatron runs 1F1B and interleaved 1F1B)")


def _sharding(plan: Plan) -> list[tuple[str, Any]]:
    if plan.zero == 1:
        return [("--use-distributed-optimizer", True)]
    if plan.zero >= 2:
        return [("--use-megatron-fsdp", True), ("--data-parallel-sharding-strategy", SHARDING[plan.zero])]
    return []


def _pipeline(plan: Plan, losses: Losses) -> list[tuple[str, Any]]:
    blocks = blocks_of_stages(plan)
    options: list[tuple[str, Any]] = []
    if plan.vpp > 1:
        options.append(("--num-layers-per-virtual-pipeline-stage", blocks[0]))
        if len(set(blocks)) > 1:
            losses.add("stages", f"uneven virtual stages ({blocks}): Megatron's chunks hold equal blocks")
        return options
    if plan.pp == 1 or (is_even_split(blocks) and len(set(blocks)) == 1):
        return options
    first, last, middle = blocks[0], blocks[-1], blocks[1:-1]
    if len(set(middle)) > 1:
        losses.add("stages", f"the split {blocks}: Megatron sets the first and last stage's blocks, the rest even")
    return options + [("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)]


def _bf16_path(plan: Plan) -> bool:
    """Whether Megatron runs the plan with --bf16 (FP8 too), where its arguments accumulate and
    reduce the gradients in fp32 unless --grad-reduce-in-bf16 (megatron/training/arguments.py)."""
    return plan.dtype in ("bf16", "fp8")


def _precision(plan: Plan) -> list[tuple[str, Any]]:
    """The precision flags: the plan's 16-bit gradients (the fused stack's default, as NeMo's and
    Megatron-Bridge's performance recipes run) need --grad-reduce-in-bf16 on the bf16 path; a
    plan pinning reduce_dtype fp32 runs Megatron-LM's own default."""
    if plan.dtype == "fp8":
        options = [("--bf16", True), ("--fp8-format", "hybrid"), ("--fp8-param-gather", plan.fp8_param_gather)]
    else:
        options = [(f"--{plan.dtype}", True)] if plan.dtype in ("bf16", "fp16") else []
    return options + ([("--grad-reduce-in-bf16", True)] if _bf16_path(plan) and plan.reduce_dtype != "fp32" else [])


def _recompute(plan: Plan, losses: Losses) -> list[tuple[str, Any]]:
    policies = block_recompute(plan)
    policy = uniform(policies)
    if policy == "none":
        return []
    if policy == "selective":
        return [("--recompute-granularity", "selective")]
    if policy in ("full", "op"):  # lossy for op: Megatron has no op-level policy; never less recomputation
        if policy == "op":
            losses.add("recompute", "the op policy (Megatron checkpoints the attention core or whole blocks; "
                       "exported as full)")
        return [("--recompute-granularity", "full"), ("--recompute-method", "uniform"), ("--recompute-num-layers", 1)]
    first_n = _first_n_full(plan)
    if first_n is None:
        losses.add("recompute", "per-block policies other than full on the first N blocks of every stage")
        return []
    return [("--recompute-granularity", "full"), ("--recompute-method", "block"), ("--recompute-num-layers", first_n)]


def _first_n_full(plan: Plan) -> int | None:
    """N when every virtual stage recomputes fully its first N blocks and keeps the rest."""
    counts = set()
    last = plan.stages[-1].end
    for stage in plan.stages:
        policies = [p for i, p in enumerate(stage.recompute, stage.start) if 0 < i < last - 1]
        n = policies.count("full")
        if policies != ["full"] * n + ["none"] * (len(policies) - n):
            return None
        counts.add(n)
    return counts.pop() if len(counts) == 1 else None


def _model(plan: Plan, losses: Losses) -> list[tuple[str, Any]]:
    from planner.trace.models.catalog import model_config
    from hardware.errors import ModelError

    try:
        config = model_config(plan.model)
    except ModelError:
        losses.add("model", f"{plan.model}'s dimensions (not a catalog model or config file)")
        return []
    get = lambda *keys: next((config[k] for k in keys if config.get(k) is not None), None)
    heads, kv_heads = get("num_attention_heads", "n_head"), get("num_key_value_heads")
    gated = config.get("model_type") in ("llama", "mistral", "mixtral", "qwen2")
    options = [("--num-layers", get("num_hidden_layers", "n_layer")), ("--hidden-size", get("hidden_size", "n_embd")),
               ("--num-attention-heads", heads), ("--ffn-hidden-size", get("intermediate_size", "n_inner")),
               ("--vocab-size", get("vocab_size")), ("--max-position-embeddings", get("max_position_embeddings"))]
    if kv_heads and kv_heads != heads:
        options += [("--group-query-attention", True), ("--num-query-groups", kv_heads)]
    if gated:
        options.append(("--swiglu", True))
    if not config.get("tie_word_embeddings", True):
        options.append(("--untie-embeddings-and-output-weights", True))
    if get("num_local_experts"):
        options += [("--num-experts", get("num_local_experts")), ("--moe-router-topk", get("num_experts_per_tok"))]
    return options


def read(text: str) -> Stated:
    """A Megatron argument list (a file of lines, or the whole command) as a layout."""
    found = argv.read(text, "Megatron-LM")
    unknown = sorted(flag for flag in found if flag not in FLAGS)
    number = lambda flag, low=1: argv.whole(found, flag, "Megatron-LM", low)
    axes = {name: number(flag) for name, flag in (("tp", "--tensor-model-parallel-size"),
            ("pp", "--pipeline-model-parallel-size"), ("cp", "--context-parallel-size"),
            ("ep", "--expert-model-parallel-size"), ("micro_batch", "--micro-batch-size")) if flag in found}
    # Megatron turns sequence parallelism off itself at tp 1 (validate_args)
    axes.update(_read_sharding(found), sp=argv.truth(found, "--sequence-parallel") and axes.get("tp", 1) > 1,
                stack="fused")
    axes["tp_overlap"] = axes["sp"] and argv.truth(found, "--tp-comm-overlap")
    dtype = _read_dtype(found)
    axes["fp8_param_gather"] = dtype == "fp8" and argv.truth(found, "--fp8-param-gather")
    if dtype in ("bf16", "fp8") and not argv.truth(found, "--grad-reduce-in-bf16"):
        axes["reduce_dtype"] = "fp32"  # Megatron's arguments turn fp32 accumulation on for bf16
    stated = Stated(format=NAME, axes=axes, global_batch=number("--global-batch-size"),
                    seq_len=number("--seq-length"), dtype=dtype,
                    unpriced=[f"{len(unknown)} flags ({', '.join(unknown[:6])}{', ...' if len(unknown) > 6 else ''}): "
                              "not layout flags; optimizer, data and kernel options are priced as Megatron's "
                              "defaults"] if unknown else [])
    return _read_stages(stated, found, number)


def _read_sharding(found: dict) -> dict[str, Any]:
    if argv.truth(found, "--use-megatron-fsdp"):
        strategy = found.get("--data-parallel-sharding-strategy", "optim_grads_params")
        stage = {v: k for k, v in SHARDING.items()} | {"optim": 1, "no_shard": 0}
        if strategy not in stage:
            raise FormatError("--data-parallel-sharding-strategy", f"{strategy!r} is not one of Megatron FSDP's",
                              f"use one of {', '.join(stage)}")
        return {"zero": stage[strategy]}
    return {"zero": 1 if argv.truth(found, "--use-distributed-optimizer") else 0}


def _read_dtype(found: dict) -> str:
    if "--fp8-format" in found:
        return "fp8"
    return "bf16" if argv.truth(found, "--bf16") else "fp16" if argv.truth(found, "--fp16") else "fp32"


def _read_stages(stated: Stated, found: dict, number) -> Stated:
    """The virtual chunks, the uneven split and the recompute policy need the model's block count,
    read from --num-layers (or left to the model the user names)."""
    pp = stated.axes.get("pp", 1)
    n_layers, per_chunk = number("--num-layers"), number("--num-layers-per-virtual-pipeline-stage")
    axes, blocks = dict(stated.axes), None
    if per_chunk:
        if not n_layers:
            raise FormatError("--num-layers", "is needed with --num-layers-per-virtual-pipeline-stage",
                              "Megatron needs it too")
        axes.update(vpp=n_layers // (pp * per_chunk), schedule="interleaved")
        blocks = [per_chunk] * (pp * axes["vpp"])
    first, last = number("--decoder-first-pipeline-num-layers"), number("--decoder-last-pipeline-num-layers")
    if first or last:
        if not n_layers:
            raise FormatError("--num-layers", "is needed with an uneven pipeline split", "Megatron needs it too")
        blocks = _uneven(n_layers, pp, first, last)
    recompute = _read_recompute(found, number, blocks, n_layers, pp)
    return stated.model_copy(update={"axes": axes, "stage_blocks": blocks, "block_recompute": recompute})


def _uneven(n_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    ends = [first or 0, last or 0]
    middle_stages = pp - (first is not None) - (last is not None)
    rest = n_layers - sum(ends)
    if middle_stages <= 0 or rest % middle_stages or rest < middle_stages:
        raise FormatError("--decoder-first-pipeline-num-layers", f"{n_layers} layers over {pp} stages leave "
                          f"{rest} for {middle_stages} middle stages", "Megatron needs an even middle")
    middle = [rest // middle_stages] * middle_stages
    return ([first] if first is not None else []) + middle + ([last] if last is not None else [])


def _read_recompute(found: dict, number, blocks: list[int] | None, n_layers: int | None, pp: int):
    granularity = found.get("--recompute-granularity")
    if granularity in (None, False):
        return "none"
    if granularity == "selective":
        return "selective"
    if granularity != "full":
        raise FormatError("--recompute-granularity", f"{granularity!r}", "use full or selective")
    if found.get("--recompute-method", "uniform") == "uniform":
        return "full"
    n = number("--recompute-num-layers") or 1
    if not n_layers:
        raise FormatError("--num-layers", "is needed with --recompute-method block", "Megatron needs it too")
    stages = blocks or [n_layers // pp] * pp
    return [policy for count in stages for policy in ["full"] * min(n, count) + ["none"] * max(0, count - n)]
