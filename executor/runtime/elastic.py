"""Elastic resume: re-plan a job for the ranks that are left (or were given).

When a node dies under torchrun's elastic agent (`--nnodes MIN:MAX`), the agent
restarts the workers on the nodes that remain, with a smaller WORLD_SIZE; when a
user passes another `--nproc`, the launcher does the same before starting. Either
way the planner chooses a layout for the new world afresh (any dp, tp, pp, vpp,
zero: the layout that was best for 8 ranks need not be for 4), on the plan's own
hardware profile resized to the new rank count, keeping the global batch, sequence
length and dtype so the loss stays on its curve (every step's tokens depend on the
seed and the step only, executor/checkpoints/store.py). The checkpoint, named by parameter,
is resharded onto that layout by torch.distributed.checkpoint on load.

A model the planner cannot trace by name (an importable "package.module:function")
keeps its model-parallel layout where it divides the new world, the data-parallel
degree absorbing the change.
"""
from __future__ import annotations

from layout.plan import Plan, uniform_stages
from hardware.errors import ParallaxError, PlanError


def replan(plan: Plan, world_size: int, layer_kinds: list[str] | None = None) -> tuple[Plan, str]:
    """A plan for `world_size` ranks, from the planner where it knows the model, and a note."""
    if world_size == plan.n_gpus:
        return plan, ""
    if world_size < 1:
        raise PlanError("nproc", f"must be positive, got {world_size}")
    from planner.trace.models.catalog import list_models

    if plan.groups:
        raise PlanError("nproc", f"a mixed-cluster plan places its groups on its {plan.n_gpus} ranks; which GPU "
                        f"types {world_size} ranks would be is unknown", f"resume on {plan.n_gpus} ranks, or plan the "
                        "cluster that is left with `parallax plan MODEL --hw A+B`")
    if plan.model not in list_models():
        return _keep_model_parallel(plan, world_size, layer_kinds)
    import planner

    fixed = {"stack": plan.stack} if plan.stack != "eager" else None
    try:
        cluster = plan.cluster().resized(world_size)
        new = planner.plan(plan.model, cluster, global_batch=plan.global_batch, seq_len=plan.seq_len, dtype=plan.dtype,
                           fixed=fixed, top_k=1)
    except ParallaxError as error:
        raise PlanError("world size", f"no layout of {world_size} ranks trains {plan.model}: {error}",
                        "resume on more ranks") from None
    note = f"elastic re-plan for {world_size} ranks: the planner picked {new.layout_tag} (was {plan.layout_tag})"
    new = new.model_copy(update={"model": plan.model, "alternatives": [], "notes": [*plan.notes, note],
                                 "compression": plan.compression if new.reduces_through_ddp else "none"})
    return new, note


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


def _keep_model_parallel(plan: Plan, world_size: int, layer_kinds: list[str] | None) -> tuple[Plan, str]:
    """tp and pp kept where they divide the world (lowered otherwise), dp = world / (tp * pp)."""
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
