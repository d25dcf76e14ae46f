"""torchtitan: the model choice and the `--section.field` overrides its config manager parses.

Field names follow torchtitan's JobConfig (torchtitan/config/job_config.py, release 0.3.0);
`tests/test_formats_tools.py` parses every export with torchtitan's own `ConfigManager` where
torchtitan installs.

What maps: the data-parallel replicate and shard degrees (DDP, FSDP2 with ZeRO-3 or
ZeRO-2 as `fsdp_reshard_after_forward`, HSDP), tensor parallelism (its TP always shards the
norms by sequence: Megatron's SP), the pipeline's degree, schedule, micro-batch and exact
partition (`module_fqns_per_model_part`), context and expert degrees, the batch and
accumulation, the precision of weights and reduction, FSDP2's CPU offload, full
recomputation of every block or of every k-th (`selective_ac_option` k), and the compile
stack. torchtitan has no ZeRO-1, no tensor parallelism without SP, no gradient
compression, and its selective policy is op-level, not Megatron's attention core.
"""
from __future__ import annotations

import tomllib
from typing import Any

from hardware.errors import FormatError
from layout.plan import Plan

from . import argv
from .common import Exported, Losses, Stated, block_recompute, blocks_of_stages, n_nodes, uniform

NAME = "torchtitan"
PINS = {"compression": "none"}  # what a search for a torchtitan run may not change
SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B", "zero-bubble": "InterleavedZeroBubble"}
FLAVORS = {"llama-3-8b": ("llama3", "8B"), "llama-3-70b": ("llama3", "70B"), "llama-3-405b": ("llama3", "405B")}
REDUCE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
P, T = "--parallelism.", "--training."


def export(plan: Plan, lossy: bool) -> Exported:
    losses = Losses("torchtitan")
    _unsayable(plan, losses)
    options: list[tuple[str, Any]] = [*_model(plan, losses), *_data_parallel(plan),
                                      (P + "tensor_parallel_degree", plan.tp), (P + "context_parallel_degree", plan.cp),
                                      (P + "expert_parallel_degree", plan.ep), *_pipeline(plan),
                                      *_batch(plan), *_precision(plan), *_recompute(plan, losses)]
    if plan.stack == "compile":
        options += [("--compile.enable", True), ("--compile.components", "model,loss")]
    nodes, per_node = n_nodes(plan)
    header = f"torchtitan overrides for {plan.model} on {plan.hardware}: {plan.layout_tag}\n(written by parallax export)"
    launch = f"torchrun --nnodes {nodes} --nproc-per-node {per_node} -m torchtitan.train $(grep -v '^#' FILE)"
    return Exported(format=NAME, text=argv.write(options, header), launch=launch, lost=losses.settle(lossy))


def _unsayable(plan: Plan, losses: Losses) -> None:
    checks = (("zero", plan.zero == 1, "ZeRO-1 (its FSDP2 shards gradients with the optimizer state)"),
              ("sp", plan.tp > 1 and not plan.sp, "tensor parallelism without SP (its TP plans shard norms by sequence)"),
              ("compression", plan.compression != "none", f"{plan.compression} gradient compression"),
              ("stack", plan.stack == "fused", "the fused stack (torchtitan runs eager or compiled PyTorch)"),
              ("zero", plan.zero == 0 and plan.cp > 1, "context parallelism without FSDP (it shards over cp)"),
              ("dp_shard", plan.zero >= 2 and plan.shard_degree % plan.cp, "a shard group that cp does not divide"),
              ("zero", plan.zero >= 2 and plan.shard_degree == 1, "FSDP over one rank (it applies FSDP only where "
               "dp_shard x cp > 1)"))
    for field, lost, what in checks:
        if lost:
            losses.add(field, what)


def _model(plan: Plan, losses: Losses) -> list[tuple[str, Any]]:
    if plan.model not in FLAVORS:
        losses.add("model", f"{plan.model} (its flavors: {', '.join(FLAVORS)}; name your own with --model.name)")
        return []
    name, flavor = FLAVORS[plan.model]
    return [("--model.name", name), ("--model.flavor", flavor)] + \
        ([("--model.converters", "float8")] if plan.dtype == "fp8" else [])


def _data_parallel(plan: Plan) -> list[tuple[str, Any]]:
    """FSDP2 shards over dp_shard x cp; DDP replicates over dp_replicate."""
    if plan.zero < 2:
        return [(P + "data_parallel_replicate_degree", plan.dp), (P + "data_parallel_shard_degree", 1)]
    return [(P + "data_parallel_replicate_degree", plan.dp_replicate),
            (P + "data_parallel_shard_degree", plan.shard_degree // plan.cp),
            (P + "fsdp_reshard_after_forward", "default" if plan.zero == 3 else "never"),
            *([(T + "enable_cpu_offload", True)] if plan.offload else [])]


def _pipeline(plan: Plan) -> list[tuple[str, Any]]:
    if plan.pp == 1:
        return [(P + "pipeline_parallel_degree", 1)]
    return [(P + "pipeline_parallel_degree", plan.pp), (P + "pipeline_parallel_schedule", SCHEDULES[plan.schedule]),
            (P + "pipeline_parallel_microbatch_size", plan.micro_batch),
            (P + "module_fqns_per_model_part", _parts(plan))]


def _parts(plan: Plan) -> str:
    """Each virtual stage's modules by name: tok_embeddings, layers.i, norm and output (the JSON list of
    lists torchtitan's parser takes)."""
    import json

    parts, block = [], 0
    for s, count in enumerate(blocks_of_stages(plan)):
        names = (["tok_embeddings"] if s == 0 else []) + [f"layers.{i}" for i in range(block, block + count)]
        parts.append(names + (["norm", "output"] if s == len(plan.stages) - 1 else []))
        block += count
    return json.dumps(parts, separators=(",", ":"))


def _batch(plan: Plan) -> list[tuple[str, Any]]:
    """local_batch_size is one data-parallel rank's sequences per step; accumulation is derived from it."""
    local = plan.micro_batch if plan.pp == 1 else plan.micro_batch * plan.num_micro_batches
    return [(T + "local_batch_size", local), (T + "global_batch_size", plan.global_batch), (T + "seq_len", plan.seq_len)]


def _precision(plan: Plan) -> list[tuple[str, Any]]:
    param = "float32" if plan.dtype == "fp32" else "float16" if plan.dtype == "fp16" else "bfloat16"
    return [(T + "mixed_precision_param", param), (T + "mixed_precision_reduce", "float32")]


def _recompute(plan: Plan, losses: Losses) -> list[tuple[str, Any]]:
    policies = block_recompute(plan)
    policy = uniform(policies)
    if policy in ("none", "full"):
        return [("--activation_checkpoint.mode", policy)]
    k = _every_kth(policies)
    if policy == "selective" or k is None:
        losses.add("recompute", "Megatron's selective policy or an irregular per-block one (torchtitan "
                   "checkpoints every block, every k-th, or op by op)")
        return [("--activation_checkpoint.mode", "none")]
    return [("--activation_checkpoint.mode", "selective"), ("--activation_checkpoint.selective_ac_option", str(k))]


def _every_kth(policies: list[str]) -> int | None:
    """k when the blocks counted from 1 checkpoint fully exactly at multiples of k, and keep the rest."""
    full = [i + 1 for i, p in enumerate(policies) if p == "full"]
    if not full or any(p not in ("full", "none") for p in policies):
        return None
    k = full[0]
    return k if full == list(range(k, len(policies) + 1, k)) else None


def read(text: str, suffix: str = "") -> Stated:
    """torchtitan overrides (a file of lines or a command line) or its TOML config file."""
    found = _toml(text) if suffix == ".toml" else argv.read(text, "torchtitan")
    get = lambda name, low=1: argv.whole(found, name, "torchtitan", low)
    replicate, shard = get(P + "data_parallel_replicate_degree") or 1, get(P + "data_parallel_shard_degree", -1)
    cp, pp = get(P + "context_parallel_degree") or 1, get(P + "pipeline_parallel_degree") or 1
    axes: dict[str, Any] = {"tp": get(P + "tensor_parallel_degree") or 1, "cp": cp, "pp": pp,
                            "ep": get(P + "expert_parallel_degree") or 1}
    axes["sp"] = axes["tp"] > 1
    axes.update(_read_sharding(found, replicate, shard, cp))
    if argv.truth(found, "--compile.enable"):
        axes["stack"] = "compile"
    stated = Stated(format=NAME, axes=axes, global_batch=get(T + "global_batch_size"), seq_len=get(T + "seq_len"),
                    model=_read_model(found), dtype=_read_dtype(found), unpriced=_read_unpriced(found))
    return _read_pipeline(stated, found, get)


def _read_sharding(found: dict, replicate: int, shard: int | None, cp: int) -> dict[str, Any]:
    if shard == 1 and cp == 1:
        return {"zero": 0, "dp": replicate}
    reshard = found.get(P + "fsdp_reshard_after_forward", "default")
    zero = 2 if reshard == "never" else 3
    axes = {"zero": zero, "offload": argv.truth(found, T + "enable_cpu_offload")}
    if shard not in (None, -1):
        axes["dp"] = replicate * shard
        if replicate > 1:
            axes["dp_shard"] = shard * cp
    return axes


def _read_model(found: dict) -> str | None:
    pair = (found.get("--model.name"), found.get("--model.flavor"))
    return next((name for name, flavor in FLAVORS.items() if flavor == pair), None)


def _read_dtype(found: dict) -> str:
    if "float8" in str(found.get("--model.converters", "")):
        return "fp8"
    param = found.get(T + "mixed_precision_param", "bfloat16")
    return {v: k for k, v in REDUCE.items()}.get(param, "bf16")


def _read_unpriced(found: dict) -> list[str]:
    notes = []
    if found.get("--activation_checkpoint.selective_ac_option") == "op":
        notes.append("activation_checkpoint.selective_ac_option: op-level SAC priced as no recomputation")
    if found.get(T + "mixed_precision_reduce", "float32") != "float32":
        notes.append(f"training.mixed_precision_reduce: {found[T + 'mixed_precision_reduce']} priced as float32")
    if argv.truth(found, P + "enable_async_tensor_parallel"):
        notes.append("parallelism.enable_async_tensor_parallel: priced as synchronous TP")
    return notes


def _read_pipeline(stated: Stated, found: dict, get) -> Stated:
    axes, blocks = dict(stated.axes), None
    if axes["pp"] > 1:
        schedule = found.get(P + "pipeline_parallel_schedule", "1F1B")
        names = {v: k for k, v in SCHEDULES.items()}
        if schedule not in names:
            raise FormatError(P[2:] + "pipeline_parallel_schedule", f"{schedule!r} is not priced",
                              f"use one of {', '.join(names)}")
        axes["schedule"] = names[schedule]
        if P + "pipeline_parallel_microbatch_size" in found:
            axes["micro_batch"] = get(P + "pipeline_parallel_microbatch_size")
        blocks = _read_parts(found.get(P + "module_fqns_per_model_part"))
        if blocks is not None:
            axes["vpp"] = len(blocks) // axes["pp"]
    elif T + "local_batch_size" in found:
        axes["micro_batch"] = get(T + "local_batch_size")
    recompute = _read_recompute(found, get)
    return stated.model_copy(update={"axes": axes, "stage_blocks": blocks, "block_recompute": recompute})


def _read_parts(value) -> list[int] | None:
    import json

    if value is None:
        return None
    try:
        parts = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        raise FormatError(P[2:] + "module_fqns_per_model_part", "is not a JSON list of lists",
                          'e.g. [["tok_embeddings","layers.0"],["layers.1","norm","output"]]') from None
    if not isinstance(parts, list) or not all(isinstance(p, list) for p in parts):
        raise FormatError(P[2:] + "module_fqns_per_model_part", "is not a list of lists of module names",
                          'e.g. [["tok_embeddings","layers.0"],["layers.1","norm","output"]]')
    return [sum(str(name).startswith("layers.") for name in part) for part in parts]


def _read_recompute(found: dict, get):
    mode = found.get("--activation_checkpoint.mode", "selective")
    if mode in ("none", "full"):
        return mode
    if mode != "selective":
        raise FormatError("activation_checkpoint.mode", f"{mode!r}", "use none, selective or full")
    option = found.get("--activation_checkpoint.selective_ac_option", "2")
    if option == "op":
        return "none"
    return f"every:{get('--activation_checkpoint.selective_ac_option')}"  # the stride; the blocks are the model's


def _toml(text: str) -> dict:
    """A torchtitan TOML config as the overrides it stands for."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise FormatError("--from", f"not a torchtitan TOML file: {error}", "give its train config") from None
    found: dict = {}
    for section, fields in data.items():
        if isinstance(fields, dict):
            for key, value in fields.items():
                found[f"--{section}.{key}"] = value if isinstance(value, (bool, str)) else \
                    str(value) if not isinstance(value, list) else value
    return found
