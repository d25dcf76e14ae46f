"""torchtitan: the `--module`/`--config` choice and the overrides its ConfigManager parses.

Names follow torchtitan 0.3.0 (PyPI): `torchtitan/config/configs.py` (TrainingConfig,
ParallelismConfig, CompileConfig), `torchtitan/distributed/activation_checkpoint.py` (the
activation-checkpoint subcommands none, full, selective, memory-budget) and
`torchtitan/config/manager.py` (tyro, with torchtitan's rule that a list of strings is
comma-separated). `tests/test_formats_tools.py` parses every export with those classes and
that parser where torchtitan installs; its model registry needs triton, so the whole
`ConfigManager.parse_args` runs only on a CUDA machine.

What maps: the data-parallel replicate and shard degrees (DDP, FSDP2 with ZeRO-3 as
`fsdp_reshard_after_forward always` and ZeRO-2 as `never`, HSDP), tensor parallelism with or
without sequence parallelism, the pipeline's degree, schedule, micro-batch and exact
partition (`module_fqns_per_model_part`), context and expert degrees, the batch and
accumulation, bf16 or fp32 compute, bf16 or fp32 weights (`training.dtype`, its AdamW's moments
following them), FSDP2's fp32 gradient reduction, FSDP2's CPU offload, full recomputation of every block,
its op-level selective checkpointing (Parallax's `op`), and the compile stack. torchtitan
0.3.0 has no ZeRO-1, no gradient compression, no fp16, no FP8 recipe for these models in its
registry, and no Megatron-style selective policy.
"""
from __future__ import annotations

import re
import shlex
import tomllib
from typing import Any

from hardware.errors import FormatError
from layout.axes import V_SCHEDULES
from layout.plan import Plan

from . import argv
from .common import (Exported, Losses, Stated, block_recompute, blocks_of_stages, n_nodes, rebuilds_any, recipe_losses,
                     uniform)

NAME = "torchtitan"
PINS = {"compression": "none"}  # what a search for a torchtitan run may not change
SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B", "zero-bubble": "InterleavedZeroBubble",
             "zbv": "ZBVZeroBubble"}
CONFIGS = {"llama-3-8b": "llama3_8b", "llama-3-70b": "llama3_70b", "llama-3-405b": "llama3_405b"}  # --module llama3
# What each registry config sets beneath the overrides (torchtitan 0.3.0, models/llama3/config_registry.py):
# the batch, the length, TP, the checkpointing, and 405B's compile, async TP and float8 linears (lm_head kept bf16)
REGISTRY = {
    "llama3_8b": {"--training.local_batch_size": "1", "--training.seq_len": "8192", "ac": "selective"},
    "llama3_70b": {"--training.local_batch_size": "8", "--training.seq_len": "8192",
                   "--parallelism.tensor_parallel_degree": "8", "ac": "full"},
    "llama3_405b": {"--training.local_batch_size": "2", "--training.seq_len": "8192",
                    "--parallelism.tensor_parallel_degree": "8", "ac": "full", "--compile.enable": True,
                    "--compile.enable_async_tensor_parallel": True, "float8": True},
}
PARAM_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}
AC = re.compile(r"^activation[-_]checkpoint:([a-z-]+)$")
P, T = "--parallelism.", "--training."


def export(plan: Plan, lossy: bool) -> Exported:
    losses = Losses("torchtitan")
    _unsayable(plan, losses)
    options: list[tuple[str, Any]] = [*_model(plan, losses), *_data_parallel(plan),
                                      (P + "tensor_parallel_degree", plan.tp), (P + "context_parallel_degree", plan.cp),
                                      (P + "expert_parallel_degree", plan.ep), *_pipeline(plan), *_batch(plan),
                                      (T + "mixed_precision_param", PARAM_DTYPE.get(plan.dtype, "bfloat16")),
                                      (T + "dtype", "bfloat16" if plan.master_dtype == "bf16" else "float32"),
                                      ("--compile.enable" if plan.stack == "compile" else "--compile.no-enable", True),
                                      ("--compile.enable-async-tensor-parallel" if plan.tp_overlap
                                       else "--compile.no-enable-async-tensor-parallel", True)]
    if plan.tp > 1:
        options.append((P + ("enable-sequence-parallel" if plan.sp else "no-enable-sequence-parallel"), True))
    text = argv.write(options, f"torchtitan {CONFIGS.get(plan.model, plan.model)} for {plan.model} on "
                      f"{plan.hardware}: {plan.layout_tag}\n(written by parallax export)")
    text += f"activation_checkpoint:{_recompute(plan, losses)}\n"  # tyro's subcommand: after every flag
    nodes, per_node = n_nodes(plan)
    launch = f"torchrun --nnodes {nodes} --nproc-per-node {per_node} -m torchtitan.train $(grep -v '^#' FILE)"
    return Exported(format=NAME, text=text, launch=launch, lost=losses.settle(lossy))


# bf16 weights (training.dtype, its AdamW then keeps bf16 moments) and FSDP2's fp32 reduction, the only one 0.3.0 takes
SAYS = {"master_dtype": ("bf16",), "optimizer_dtype": ("bf16",), "reduce_dtype": ("fp32",),
        "tp_overlap": (True,)}  # async TP (the rules allow it on the compile stack only)


def _unsayable(plan: Plan, losses: Losses) -> None:
    recipe_losses(plan, losses, SAYS)
    checks = (("zero", plan.zero == 1, "ZeRO-1 (its FSDP2 shards gradients with the optimizer state)"),
              ("compression", plan.compression != "none", f"{plan.compression} gradient compression"),
              ("stack", plan.stack == "fused", "the fused stack (torchtitan runs eager or compiled PyTorch)"),
              ("dtype", plan.dtype == "fp16", "fp16 training (its weights are bfloat16 or float32)"),
              ("dtype", (plan.dtype == "fp8") != _float8(plan.model), _float8_why(plan)),
              ("zero", plan.zero == 0 and plan.cp > 1, "context parallelism without FSDP (it shards over cp)"),
              ("dp_shard", plan.zero >= 2 and plan.shard_degree % plan.cp, "a shard group that cp does not divide"),
              ("zero", plan.zero >= 2 and plan.shard_degree == 1, "FSDP over one rank (it applies FSDP only where "
               "dp_shard x cp > 1)"))
    for field, lost, what in checks:
        if lost:
            losses.add(field, what)


def _float8(model: str) -> bool:
    return REGISTRY.get(CONFIGS.get(model, ""), {}).get("float8", False)


def _float8_why(plan: Plan) -> str:
    if plan.dtype == "fp8":
        return "FP8 for this model (0.3.0's registry trains only llama3_405b in float8)"
    return f"{plan.dtype} for this model (its {CONFIGS.get(plan.model)} config trains in float8)"


def _model(plan: Plan, losses: Losses) -> list[tuple[str, Any]]:
    if plan.model not in CONFIGS:
        losses.add("model", f"{plan.model} (its registry: {', '.join(CONFIGS)}; add a config for your own)")
        return []
    return [("--module", "llama3"), ("--config", CONFIGS[plan.model])]


def _data_parallel(plan: Plan) -> list[tuple[str, Any]]:
    """FSDP2 shards over dp_shard x cp; DDP replicates over dp_replicate."""
    if plan.zero < 2:
        return [(P + "data_parallel_replicate_degree", plan.dp), (P + "data_parallel_shard_degree", 1)]
    return [(P + "data_parallel_replicate_degree", plan.dp_replicate),
            (P + "data_parallel_shard_degree", plan.shard_degree // plan.cp),
            (P + "fsdp_reshard_after_forward", "always" if plan.zero == 3 else "never"),
            (T + ("enable_cpu_offload" if plan.offload else "no-enable-cpu-offload"), True)]


def _pipeline(plan: Plan) -> list[tuple[str, Any]]:
    if plan.pp == 1:
        return [(P + "pipeline_parallel_degree", 1)]
    return [(P + "pipeline_parallel_degree", plan.pp), (P + "pipeline_parallel_schedule", SCHEDULES[plan.schedule]),
            (P + "pipeline_parallel_microbatch_size", plan.micro_batch),
            (P + "module_fqns_per_model_part", _parts(plan)),
            (T + "disable_cuda_graphs", True)]  # its Trainer refuses a pipeline under CUDA graphs


def _parts(plan: Plan) -> list[str]:
    """Each virtual stage's modules, comma-separated: tok_embeddings, layers.i, norm and output."""
    parts, block = [], 0
    for s, count in enumerate(blocks_of_stages(plan)):
        names = (["tok_embeddings"] if s == 0 else []) + [f"layers.{i}" for i in range(block, block + count)]
        parts.append(",".join(names + (["norm", "output"] if s == len(plan.stages) - 1 else [])))
        block += count
    return parts


def _batch(plan: Plan) -> list[tuple[str, Any]]:
    """local_batch_size is one data-parallel rank's sequences per accumulation step; with a pipeline it is
    split into micro-batches, so it holds them all."""
    local = plan.micro_batch if plan.pp == 1 else plan.micro_batch * plan.num_micro_batches
    return [(T + "local_batch_size", local), (T + "global_batch_size", plan.global_batch), (T + "seq_len", plan.seq_len)]


MODES = {"none": "none", "full": "full", "op": "selective"}  # Parallax's policy -> torchtitan 0.3.0's mode


def _recompute(plan: Plan, losses: Losses) -> str:
    policy = uniform(block_recompute(plan))
    if policy in MODES:
        return MODES[policy]
    policies = block_recompute(plan)
    fallback = "full" if rebuilds_any(policies) else "none"  # lossy: never less recomputation
    losses.add("recompute", "Megatron's selective policy or a per-block one (torchtitan 0.3.0 checkpoints every "
               f"block whole, or op by op; exported as {fallback})")
    return fallback


def read(text: str, suffix: str = "") -> Stated:
    """torchtitan overrides (a file of lines or a command line), or an older release's TOML file;
    a `.toml` file whose first statement is an override (`parallax export --out run.toml` writes
    overrides whatever the name) is read as overrides."""
    if suffix == ".toml" and not _overrides(text):
        found, mode = _toml(text)
    else:
        words = argv.split(text, NAME)
        modes = [m.group(1) for w in words if (m := AC.match(w))]
        found = argv.read(shlex.join(w for w in words if not AC.match(w)), NAME)
        found = dict(_canonical(flag, value) for flag, value in found.items())
        defaults = REGISTRY.get(found.get("--config"), {})
        found = {**{k: v for k, v in defaults.items() if k.startswith("--")}, **found}
        mode = modes[-1] if modes else defaults.get("ac", "selective")  # the config's own, else the Trainer's default
    get = lambda name: argv.whole(found, name, NAME)
    cp, pp, tp = get(P + "context_parallel_degree") or 1, get(P + "pipeline_parallel_degree") or 1, \
        get(P + "tensor_parallel_degree") or 1
    axes: dict[str, Any] = {"tp": tp, "cp": cp, "pp": pp, "ep": get(P + "expert_parallel_degree") or 1,
                            "sp": tp > 1 and found.get(P + "enable_sequence_parallel", True) is not False}
    axes.update(_read_sharding(found, get, cp, pp))
    if found.get("--compile.enable") is True:
        axes["stack"] = "compile"
        axes["tp_overlap"] = axes["sp"] and found.get("--compile.enable_async_tensor_parallel") is True
    if found.get(T + "dtype") == "bfloat16":  # the weights themselves bf16, so its AdamW's moments too
        axes.update(master_dtype="bf16", optimizer_dtype="bf16")
    param = found.get(T + "mixed_precision_param", "bfloat16")
    stated = Stated(format=NAME, axes=axes, global_batch=_global_batch(found), local_batch=get(T + "local_batch_size"),
                    seq_len=get(T + "seq_len"),
                    model=next((m for m, c in CONFIGS.items() if c == found.get("--config")), None),
                    dtype="fp8" if REGISTRY.get(found.get("--config"), {}).get("float8") else
                    {v: k for k, v in PARAM_DTYPE.items()}.get(param, "bf16"),
                    block_recompute=_read_mode(mode), unpriced=_read_unpriced(found, mode))
    return _read_pipeline(stated, found, get)


def _global_batch(found: dict) -> int | None:
    """The stated global batch; its default, -1, is the local batch times the data-parallel degree."""
    value = argv.whole(found, T + "global_batch_size", NAME, low=-1)
    return None if value in (None, -1) else value


def _canonical(flag: str, value) -> tuple[str, Any]:
    """'--section.some-field' as '--section.some_field' (tyro takes both); tyro's '--section.no-field'
    switch as the field set False."""
    section, dot, field = flag.partition(".")
    field = field.replace("-", "_")
    if dot and field.startswith("no_") and value is True:
        return f"{section}.{field[3:]}", False
    return f"{section}{dot}{field}", value


def _read_sharding(found: dict, get, cp: int, pp: int) -> dict[str, Any]:
    replicate, shard = get(P + "data_parallel_replicate_degree") or 1, argv.whole(
        found, P + "data_parallel_shard_degree", NAME, low=-1)
    if shard == 1 and cp == 1:
        return {"zero": 0, "dp": replicate}
    reshard = found.get(P + "fsdp_reshard_after_forward", "default")
    zero = 2 if reshard == "never" or (reshard == "default" and pp > 1) else 3  # its default: no reshard in a pipeline
    axes = {"zero": zero, "offload": found.get(T + "enable_cpu_offload") is True}
    if shard not in (None, -1):
        axes["dp"] = replicate * shard
        if replicate > 1:
            axes["dp_shard"] = shard * cp
    return axes


def _read_mode(mode: str) -> str:
    if mode not in ("none", "full", "selective", "memory-budget"):
        raise FormatError("activation_checkpoint", f"{mode!r}", "use none, full, selective or memory-budget")
    return {"full": "full", "selective": "op"}.get(mode, "none")


def _read_unpriced(found: dict, mode: str) -> list[str]:
    notes = []
    if mode == "memory-budget":
        notes.append(f"activation_checkpoint:{mode}: the compiler's memory-budget checkpointing priced as none")
    if found.get("--compile.enable_async_tensor_parallel") is True and found.get("--compile.enable") is not True:
        notes.append("compile.enable_async_tensor_parallel without compile: priced as synchronous TP")
    return notes


def _read_pipeline(stated: Stated, found: dict, get) -> Stated:
    axes, blocks = dict(stated.axes), None
    if axes["pp"] > 1:
        schedule = found.get(P + "pipeline_parallel_schedule", "1F1B")
        names = {v: k for k, v in SCHEDULES.items()}
        if schedule not in names:
            raise FormatError("parallelism.pipeline_parallel_schedule", f"{schedule!r} is not priced",
                              f"use one of {', '.join(names)}")
        axes["schedule"] = names[schedule]
        axes["micro_batch"] = get(P + "pipeline_parallel_microbatch_size") or 1
        blocks = _read_parts(found.get(P + "module_fqns_per_model_part"))
        if blocks is not None:
            axes["vpp"] = max(1, len(blocks) // axes["pp"])
        if axes["schedule"] in V_SCHEDULES:  # torchtitan's ZBV runs two stages per rank, whatever the parts say
            axes["vpp"] = 2
    elif T + "local_batch_size" in found:
        axes["micro_batch"] = get(T + "local_batch_size")
    return stated.model_copy(update={"axes": axes, "stage_blocks": blocks})


def _read_parts(value) -> list[int] | None:
    if value is None:
        return None
    parts = value if isinstance(value, list) else [value]
    return [sum(name.strip().startswith("layers.") for name in str(part).split(",")) for part in parts]


def _overrides(text: str) -> bool:
    """Whether the text's first line that is not blank or a comment is a command-line override."""
    first = next((line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")), "")
    return first.startswith("--")


def _toml(text: str) -> tuple[dict, str]:
    """An older torchtitan's TOML config as the overrides it stands for, and its checkpointing mode."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise FormatError("--from", f"not a torchtitan TOML file: {error}", "give its train config") from None
    found: dict = {}
    for section, fields in data.items():
        for key, value in (fields.items() if isinstance(fields, dict) else ()):
            found[f"--{section}.{key}"] = value if isinstance(value, bool) else \
                [",".join(map(str, v)) if isinstance(v, list) else str(v) for v in value] if isinstance(value, list) \
                else str(value)
    mode = str(found.pop("--activation_checkpoint.mode", "selective"))
    return found, mode
