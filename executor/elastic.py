"""Elastic resume: re-plan a checkpointed job for a different number of ranks.

The model-parallel layout (tp, pp, stage partition, recomputation) is kept
when it fits the new world size, since it was chosen for the model, and the
data-parallel degree absorbs the change: dp = world / (tp * pp). The global
batch is kept (so the loss stays on its curve: the same tokens per step, see
executor/checkpoint.py), the micro-batch is reduced until dp * micro_batch
divides it. When tp * pp does not divide the new world, pipeline and then
tensor degrees are lowered (uniform stages) until a valid plan is found.
The checkpoint itself is resharded by torch.distributed.checkpoint on load.
"""
from __future__ import annotations

from costmodel.plan import Plan, uniform_stages
from hardware.errors import PlanError


def _with(plan: Plan, dp: int, tp: int, pp: int, kinds: list[str] | None) -> Plan | None:
    if plan.global_batch % dp:
        return None
    mb = plan.micro_batch
    while mb > 1 and plan.global_batch % (dp * mb):
        mb -= 1
    update = {"dp": dp, "tp": tp, "pp": pp, "micro_batch": mb, "estimate": None, "alternatives": [], "solver": None}
    if pp != plan.pp:
        if kinds is None:
            return None
        update.update(stages=uniform_stages(kinds, pp * (plan.vpp if pp > 1 else 1), plan.stages[0].recompute[-1]),
                      schedule="1f1b" if pp == 1 else plan.schedule, vpp=plan.vpp if pp > 1 else 1)
    if tp == 1:
        update["sp"] = False
    try:
        return Plan.model_validate({**plan.model_dump(), **update})
    except ValueError:
        return None


def replan(plan: Plan, world_size: int, layer_kinds: list[str] | None = None) -> tuple[Plan, str]:
    """A plan for `world_size` ranks derived from `plan`, and a note saying what changed."""
    if world_size == plan.n_gpus:
        return plan, ""
    if world_size < 1:
        raise PlanError("nproc", f"must be positive, got {world_size}")
    candidates = [(plan.tp, plan.pp)]
    candidates += [(plan.tp, p) for p in range(plan.pp - 1, 0, -1)]
    candidates += [(t, p) for t in range(plan.tp - 1, 0, -1) for p in range(plan.pp, 0, -1)]
    for tp, pp in candidates:
        if world_size % (tp * pp):
            continue
        new = _with(plan, world_size // (tp * pp), tp, pp, layer_kinds)
        if new is not None:
            note = (f"elastic re-plan for {world_size} ranks: dp {plan.dp}->{new.dp}, tp {plan.tp}->{new.tp}, "
                    f"pp {plan.pp}->{new.pp}, micro-batch {plan.micro_batch}->{new.micro_batch}, "
                    f"global batch {plan.global_batch} kept")
            return new.model_copy(update={"notes": [*plan.notes, note]}), note
    raise PlanError("nproc", f"no layout of {world_size} ranks keeps global batch {plan.global_batch}",
                    f"use a rank count dividing {plan.global_batch} times tp*pp")
