"""DeepSpeed: the `ds_config` JSON and the `deepspeed` launcher line.

Key names follow DeepSpeed's own config classes (deepspeed/runtime/config.py,
deepspeed/runtime/zero/config.py, deepspeed/runtime/zero/offload_config.py at 0.19.x), and
`tests/test_formats_tools.py` parses every export with `deepspeed.runtime.config.DeepSpeedConfig`
where DeepSpeed installs.

What maps: ZeRO 0-3 (`zero_optimization.stage`), FSDP2-style offload (ZeRO-Offload:
`offload_optimizer`, and `offload_param` at stage 3), micro-batch and accumulation, bf16/fp16, fp16/bf16 gradient
communication (`communication_data_type`), tensor parallelism (AutoTP,
`tensor_parallel.autotp_size`) and full recomputation (`activation_checkpointing`, which
the training script's `deepspeed.checkpointing` reads). DeepSpeed's config has no hybrid
sharding (0.19 removed MiCS, and refuses its key), no context
parallelism, no pipeline (DeepSpeed pipelines are built in code), no expert parallelism,
no sequence parallelism of Megatron's kind and no lossy gradient compressor of Parallax's.
"""
from __future__ import annotations

import json
from typing import Any

from hardware.errors import FormatError
from hardware.untrusted import parse_json
from layout.plan import Plan

from .common import Exported, Losses, Stated, block_recompute, n_nodes, rebuilds_any, recipe_losses, section, uniform, whole_number

NAME = "deepspeed"
PINS = {"pp": 1, "cp": 1, "ep": 1, "sp": False}  # what a search for a DeepSpeed run may not change
# the section deepspeed.checkpointing.configure() reads; its presence says the script checkpoints every block
CHECKPOINTING = {"partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
                 "number_checkpoints": None, "synchronize_checkpoint_boundary": False, "profile": False}
KNOWN = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization",
         "bf16", "fp16", "communication_data_type", "activation_checkpointing", "tensor_parallel", "optimizer",
         "scheduler", "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer"}


def export(plan: Plan, lossy: bool) -> Exported:
    losses = Losses("DeepSpeed")
    _unsayable(plan, losses)
    config: dict[str, Any] = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.num_micro_batches,
        "zero_optimization": _zero(plan, losses),
    }
    if plan.dtype in ("bf16", "fp16"):
        config[plan.dtype] = {"enabled": True}
    if plan.compression in ("fp16", "bf16"):
        config["communication_data_type"] = plan.compression
    if plan.tp > 1:
        config["tensor_parallel"] = {"autotp_size": plan.tp}
    policies = block_recompute(plan)
    if uniform(policies) not in ("none", "full"):
        losses.add("recompute", f"per-block policies ({_policies(policies)}): DeepSpeed checkpoints every block or "
                   "none" + ("; exported as every block" if rebuilds_any(policies) else ""))
    if rebuilds_any(policies):  # lossy: never less recomputation than the plan's
        config["activation_checkpointing"] = dict(CHECKPOINTING)
    nodes, per_node = n_nodes(plan)
    launch = f"deepspeed --num_nodes {nodes} --num_gpus {per_node} train.py --deepspeed --deepspeed_config FILE"
    return Exported(format=NAME, text=json.dumps(config, indent=2) + "\n", launch=launch, lost=losses.settle(lossy))


def _zero(plan: Plan, losses: Losses) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": plan.zero}
    if plan.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if plan.zero == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if plan.zero >= 2 and plan.dp_replicate > 1:
        losses.add("dp_shard", "hybrid sharding (DeepSpeed 0.19 removed MiCS; ZeRO++'s hpZ shards weights twice, "
                   "not the optimizer)")
    return zero


def _unsayable(plan: Plan, losses: Losses) -> None:
    checks = (("cp", plan.cp > 1, "context parallelism"), ("pp", plan.pp > 1, "a pipeline (DeepSpeed builds one in "
              "code, PipelineModule, not in ds_config)"), ("ep", plan.ep > 1, "expert parallelism in its config"),
              ("sp", plan.sp, "Megatron's sequence parallelism (DeepSpeed's Ulysses splits attention heads)"),
              ("compression", plan.compression not in ("none", "fp16", "bf16"), f"{plan.compression} gradient compression"),
              ("dtype", plan.dtype == "fp8", "FP8 training in ds_config"),
              ("stack", plan.stack != "eager", f"the {plan.stack} stack (DeepSpeed runs the script's own modules)"))
    for field, lost, what in checks:
        if lost:
            losses.add(field, what)
    recipe_losses(plan, losses)


def _policies(policies: list[str]) -> str:
    return ", ".join(f"{policies.count(p)} {p}" for p in sorted(set(policies)))


def read(text: str) -> Stated:
    """A ds_config as a layout: its ZeRO stage, offload, batch and precision."""
    config = parse_json(text, "--from", "the ds_config", error=FormatError)
    if not isinstance(config, dict):
        raise FormatError("--from", "a ds_config is a JSON object", "give DeepSpeed's config file")
    zero = _section(config, "zero_optimization")
    axes: dict[str, Any] = {"zero": _int(zero.get("stage", 0), "zero_optimization.stage")}
    offloaded = any(_section(zero, key).get("device") == "cpu" for key in ("offload_optimizer", "offload_param"))
    if offloaded:
        axes["offload"] = True
    if "tensor_parallel" in config:
        axes["tp"] = _int(_section(config, "tensor_parallel").get("autotp_size", 1), "tensor_parallel.autotp_size")
    if config.get("communication_data_type") in ("fp16", "bf16"):
        axes["compression"] = config["communication_data_type"]
    stated = Stated(format=NAME, axes=axes, global_batch=_stated(config.get("train_batch_size"), "train_batch_size"),
                    block_recompute="full" if "activation_checkpointing" in config else "none",
                    dtype=_dtype(config), unpriced=_unpriced(config, zero))
    return _batch(stated, config)


def _batch(stated: Stated, config: dict) -> Stated:
    """micro-batch, and dp when the batch, micro-batch and accumulation are all stated
    (DeepSpeed's own identity: train_batch_size = micro x accumulation x data-parallel ranks)."""
    micro = _stated(config.get("train_micro_batch_size_per_gpu"), "train_micro_batch_size_per_gpu")
    accumulation = _stated(config.get("gradient_accumulation_steps"), "gradient_accumulation_steps")
    axes = dict(stated.axes)
    if micro is not None:
        axes["micro_batch"] = _int(micro, "train_micro_batch_size_per_gpu")
    if micro and accumulation and stated.global_batch:
        replicas, rest = divmod(stated.global_batch, micro * accumulation)
        if rest:
            raise FormatError("train_batch_size", f"{stated.global_batch} is not micro {micro} x accumulation "
                              f"{accumulation} x the data-parallel ranks", "DeepSpeed refuses it too")
        axes["dp"] = replicas
    return stated.model_copy(update={"axes": axes})


def _dtype(config: dict) -> str:
    for dtype in ("bf16", "fp16"):
        if _section(config, dtype).get("enabled") in (True, "auto"):
            return dtype
    return "fp32"


def _unpriced(config: dict, zero: dict) -> list[str]:
    found = [f"{key}: not priced" for key in sorted(set(config) - KNOWN)]
    optimizer = _section(config, "optimizer").get("type")
    if optimizer and str(optimizer).lower() not in ("adam", "adamw"):
        found.append(f"optimizer.type: {optimizer} priced as AdamW")
    found += [f"zero_optimization.{key}: ZeRO++ quantization not priced" for key in
              ("zero_quantized_weights", "zero_quantized_gradients") if zero.get(key)]
    if _section(zero, "offload_optimizer").get("device") == "nvme":
        found.append("zero_optimization.offload_optimizer.device: nvme priced as host memory")
    return found


def _stated(value: Any, field: str) -> int | None:
    """A batch figure, or None where the file leaves it to the launcher ("auto", as HF's Trainer writes)."""
    return None if value in (None, "auto") else _int(value, field)


def _section(config: dict, key: str) -> dict:
    return section(config, key, "DeepSpeed")


def _int(value: Any, field: str) -> int:
    return whole_number(value, field, "DeepSpeed")
