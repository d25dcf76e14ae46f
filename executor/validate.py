"""Refuse a plan that cannot run on a model before any process starts."""
from __future__ import annotations

from torch import nn

from costmodel.plan import Plan
from hardware.errors import PlanError

from executor.layers import layer_map


def validate(plan: Plan, model: nn.Module, world_size: int | None = None) -> None:
    """Raise PlanError naming the field when `plan` does not fit `model` or the launch."""
    lmap = layer_map(model)
    n = lmap.n_layers
    if world_size is not None and world_size != plan.n_gpus:
        raise PlanError("dp*tp*pp", f"{plan.dp}*{plan.tp}*{plan.pp} = {plan.n_gpus} but {world_size} processes requested",
                        f"use --nproc {plan.n_gpus}")
    if plan.n_virtual_stages > n:
        raise PlanError("pp", f"{plan.n_virtual_stages} (virtual) stages for {n} layers", f"use at most {n} stages")
    if plan.stages[-1].end != n:
        raise PlanError("stages", f"last stage ends at {plan.stages[-1].end} but the model has {n} layers "
                        f"(embedding + {n - 2} blocks + head)", f"end the last stage at {n}")
    for heads, what in ((lmap.heads, "attention heads"), (lmap.kv_heads, "key/value heads")):
        if plan.tp > 1 and heads is not None and heads % plan.tp:
            raise PlanError("tp", f"tp={plan.tp} does not divide the {heads} {what}",
                            f"use a tp dividing {heads}")
    if plan.sp and plan.seq_len % plan.tp:
        raise PlanError("sp", f"seq_len {plan.seq_len} is not divisible by tp={plan.tp}", "turn sp off or change tp")
    if plan.sp and plan.pp > 1:
        raise PlanError("sp", "sequence parallelism across pipeline stages is not supported by the executor",
                        "use sp with pp=1")
    if plan.zero == 1 and plan.tp > 1:
        raise PlanError("zero", "ZeRO-1 (ZeroRedundancyOptimizer) cannot shard tensor-parallel DTensor parameters",
                        "use zero 2 or 3 with tp > 1")
    max_seq = _max_positions(model)
    if max_seq is not None and plan.seq_len > max_seq:
        raise PlanError("seq_len", f"{plan.seq_len} exceeds the model's {max_seq} positions", f"use at most {max_seq}")


def _max_positions(model: nn.Module) -> int | None:
    for holder in (getattr(model, "cfg", None), getattr(getattr(model, "model", None), "config", None)):
        for name in ("max_seq_len", "max_position_embeddings", "n_positions"):
            value = getattr(holder, name, None)
            if isinstance(value, int):
                return value
    return None
