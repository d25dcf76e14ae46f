"""Hugging Face Accelerate: the config file `accelerate launch --config_file` reads.

Key names follow Accelerate's own config classes (accelerate/commands/config/config_args.py,
the FSDP plugin and `ParallelismConfig` at 1.x); `tests/test_formats_tools.py` loads every
export with Accelerate's loader and builds its FSDP plugin where Accelerate installs.

What maps: DDP (ZeRO-0) as MULTI_GPU, ZeRO-2/3 as FSDP2 (`fsdp_reshard_after_forward`
false/true), offload (`fsdp_offload_params`), hybrid sharding, tensor and context
parallelism (`parallelism_config`), the precision (`mixed_precision`), full recomputation
(`fsdp_activation_checkpointing`) and the compile stack (`dynamo_config`). Accelerate wraps
MULTI_GPU models in torch's DDP with its defaults, a bucket copy beside every gradient
(`ddp_bucket_view` false); views are the training script's to ask for
(`DistributedDataParallelKwargs`), not the file's. The batch is the
training script's: the launch line passes it as the Trainer's arguments. Accelerate's
config has no ZeRO-1, no pipeline, no expert parallelism, no Megatron-style sequence
parallelism and no gradient compressor.
"""
from __future__ import annotations

from typing import Any

import yaml

from hardware.errors import FormatError
from layout.axes import ZERO_STAGES
from layout.plan import Plan

from .common import Exported, Losses, Stated, block_recompute, n_nodes, rebuilds_any, recipe_losses, section, uniform, whole_number

NAME = "accelerate"
PINS = {"pp": 1, "ep": 1, "sp": False, "compression": "none"}  # what a search for Accelerate may not change
PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp8": "fp8", "fp32": "no"}
PARALLEL = "parallelism_config"
KNOWN = {"compute_environment", "distributed_type", "mixed_precision", "num_machines", "num_processes",
         "machine_rank", "main_training_function", "use_cpu", "fsdp_config", PARALLEL, "dynamo_config", "rdzv_backend",
         "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "downcast_bf16", "enable_cpu_affinity",
         "debug", "gpu_ids", "main_process_ip", "main_process_port"}


def export(plan: Plan, lossy: bool) -> Exported:
    losses = Losses("Accelerate")
    _unsayable(plan, losses)
    nodes, _ = n_nodes(plan)
    config: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "distributed_type": _distributed(plan),
                              "mixed_precision": PRECISION[plan.dtype], "num_machines": nodes,
                              "num_processes": plan.n_gpus, "machine_rank": 0, "main_training_function": "main",
                              "use_cpu": False}
    if plan.zero >= 2:
        config["fsdp_config"] = _fsdp(plan, losses)
    elif uniform(block_recompute(plan)) != "none":
        losses.add("recompute", "recomputation outside FSDP (Accelerate's config checkpoints under FSDP only)")
    if plan.tp > 1 or plan.cp > 1 or plan.dp_replicate > 1 and plan.zero >= 2:
        config[PARALLEL] = _parallelism(plan, losses)
    if plan.stack == "compile":
        config["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
    launch = (f"accelerate launch --config_file FILE train.py --per_device_train_batch_size "
              f"{plan.micro_batch} --gradient_accumulation_steps {plan.num_micro_batches}")
    return Exported(format=NAME, text=yaml.safe_dump(config, sort_keys=False), launch=launch,
                    lost=losses.settle(lossy))


def _distributed(plan: Plan) -> str:
    if plan.zero >= 2:
        return "FSDP"
    return "MULTI_GPU" if plan.n_gpus > 1 else "NO"


def _fsdp(plan: Plan, losses: Losses) -> dict[str, Any]:
    policies = block_recompute(plan)
    if uniform(policies) not in ("none", "full"):
        losses.add("recompute", "selective or per-block recomputation (Accelerate checkpoints every block or none)"
                   + ("; exported as every block" if rebuilds_any(policies) else ""))
    return {"fsdp_version": 2, "fsdp_reshard_after_forward": plan.zero == 3, "fsdp_offload_params": plan.offload,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True, "fsdp_activation_checkpointing": rebuilds_any(policies)}


def _parallelism(plan: Plan, losses: Losses) -> dict[str, int]:
    shard = plan.shard_degree if plan.zero >= 2 else 1
    if shard % plan.cp:
        losses.add("dp_shard", f"a shard group of {shard} over cp {plan.cp} (Accelerate shards over dp_shard x cp)")
    return {"parallelism_config_dp_replicate_size": plan.dp_replicate if plan.zero >= 2 else plan.data_parallel,
            "parallelism_config_dp_shard_size": max(1, shard // plan.cp), "parallelism_config_tp_size": plan.tp,
            "parallelism_config_cp_size": plan.cp}


def _unsayable(plan: Plan, losses: Losses) -> None:
    checks = (("zero", plan.zero == 1, "ZeRO-1 (FSDP shards gradients with the optimizer state)"),
              ("pp", plan.pp > 1, "a pipeline"), ("ep", plan.ep > 1, "expert parallelism"),
              ("sp", plan.sp, "Megatron-style sequence parallelism (its TP plans shard the matmuls only)"),
              ("compression", plan.compression != "none", f"{plan.compression} gradient compression"),
              ("stack", plan.stack == "fused", "the fused stack (Accelerate runs the model's own modules)"),
              ("cp", plan.cp > 1 and plan.zero < 2, "context parallelism without FSDP"),
              ("tp", plan.tp > 1 and plan.zero < 2, "tensor parallelism without FSDP"))
    for field, lost, what in checks:
        if lost:
            losses.add(field, what)
    if plan.reduces_through_ddp and plan.ddp_bucket_view:
        losses.add("ddp_bucket_view", "gradients as views into DDP's buckets (its file leaves DDP at torch's "
                   "default, a bucket copy of each; DistributedDataParallelKwargs(gradient_as_bucket_view=True) in the "
                   "training script asks for views)")
    recipe_losses(plan, losses, says={"ddp_bucket_view": (False,)})


def read(text: str) -> Stated:
    """An Accelerate config file as a layout (the batch comes from the command line)."""
    config = _load(text)
    kind = config.get("distributed_type", "NO")
    fsdp = _section(config, "fsdp_config")
    parallel = _section(config, PARALLEL)
    axes: dict[str, Any] = {}
    notes = []
    if kind == "FSDP":
        axes.update(_fsdp_sharding(fsdp, notes))
    elif kind == "DEEPSPEED":
        axes.update(_deepspeed_plugin(_section(config, "deepspeed_config")))
    elif kind not in ("MULTI_GPU", "NO"):
        raise FormatError("distributed_type", f"{kind!r} is not priced from an Accelerate file",
                          "use FSDP, DEEPSPEED or MULTI_GPU")
    size = lambda key: _whole(parallel.get(f"parallelism_config_{key}_size", 1), f"{PARALLEL}.{key}_size")
    axes.update(tp=size("tp"), cp=size("cp"))
    if kind == "MULTI_GPU" and axes["tp"] == axes["cp"] == 1 and (config.get("num_processes") or 1) > 1:
        axes["ddp_bucket_view"] = False  # torch DDP's default, which Accelerate keeps
    if kind == "FSDP" and size("dp_replicate") > 1:
        axes["dp_shard"] = size("dp_shard") * axes["cp"]
    if _section(config, "dynamo_config").get("dynamo_backend", "NO") not in ("NO", "no"):
        axes["stack"] = "compile"
    precision = {v: k for k, v in PRECISION.items()}
    dtype = precision.get(config.get("mixed_precision", "no"))
    if dtype is None:
        raise FormatError("mixed_precision", f"{config.get('mixed_precision')!r}", "use no, fp16, bf16 or fp8")
    return Stated(format=NAME, axes=axes, dtype=dtype, n_gpus=config.get("num_processes"),
                  block_recompute="full" if fsdp.get("fsdp_activation_checkpointing") else "none",
                  unpriced=notes + [f"{key}: not priced" for key in sorted(set(config) - KNOWN)])


FSDP1 = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0}  # fsdp_sharding_strategy of FSDP1 -> ZeRO stage


def _fsdp_sharding(fsdp: dict, notes: list[str]) -> dict[str, Any]:
    """ZeRO-2/3 and offload of an FSDP2 section; an FSDP1 one read by its sharding strategy, priced as FSDP2."""
    offload = bool(fsdp.get("fsdp_offload_params", False))
    if fsdp.get("fsdp_version", 1) == 2:
        return {"zero": 3 if fsdp.get("fsdp_reshard_after_forward", True) else 2, "offload": offload}
    strategy = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
    strategy = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD"}.get(strategy, strategy)
    if strategy not in FSDP1:
        raise FormatError("fsdp_config.fsdp_sharding_strategy", f"{strategy!r} is not priced",
                          f"use one of {', '.join(FSDP1)}, or fsdp_version 2 with parallelism_config for HSDP")
    notes.append("fsdp_config.fsdp_version: FSDP1's flat parameters priced as FSDP2")
    return {"zero": FSDP1[strategy], "offload": offload and FSDP1[strategy] >= 2}


def _deepspeed_plugin(plugin: dict) -> dict[str, Any]:
    """Accelerate's DeepSpeed plugin section (zero_stage, offload devices), or its ds_config file's name."""
    if "deepspeed_config_file" in plugin:
        raise FormatError("deepspeed_config.deepspeed_config_file", f"names {plugin['deepspeed_config_file']}",
                          "price that ds_config itself with --from")
    stage = plugin.get("zero_stage", 2)
    if stage not in ZERO_STAGES or isinstance(stage, bool):
        raise FormatError("deepspeed_config.zero_stage", f"{stage!r} is not a ZeRO stage",
                          f"use {', '.join(map(str, ZERO_STAGES))}")
    offload = any(plugin.get(key, "none") == "cpu" for key in ("offload_optimizer_device", "offload_param_device"))
    return {"zero": stage, "offload": offload and stage >= 2}


def _load(text: str) -> dict:
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise FormatError("--from", f"not an Accelerate config: YAML error{line}", "give the file "
                          "`accelerate config` writes") from None
    if not isinstance(config, dict):
        raise FormatError("--from", "an Accelerate config is a YAML mapping", "give the file `accelerate config` writes")
    return config


def _section(config: dict, key: str) -> dict:
    return section(config, key, "Accelerate")


def _whole(value: Any, field: str) -> int:
    return whole_number(value, field, "Accelerate", low=1)
