"""`--from FILE` on `estimate` and `plan`: a user's own torchtitan, DeepSpeed, Accelerate or
Megatron-LM configuration priced as it stands, and a better layout proposed in the same format.

The file is read by `formats.read`, completed by what the command line adds (the model, the
batch, the sequence length: what the tool keeps outside its config), and made a Plan by
`formats.stated.to_plan`, so it is priced by the same estimator as every plan.
"""
from __future__ import annotations

from pathlib import Path

from hardware.errors import FormatError, PlanError
from layout.plan import Plan
from planner.api import estimate, plan
from planner.resolve import resolve_hardware, resolve_workload

GIB = 2**30
SEARCH_DEPTH = 12  # layouts ranked for a proposal: the first one the user's tool can express is proposed


def stated_plan(path: Path, fmt: str | None, model: str | None, hw: str | None, given: dict):
    """(the user's layout as a priced Plan, what was read): the file, completed by the command line."""
    import formats
    from formats.stated import merge, missing, to_plan

    stated = merge(formats.read(path, fmt), {"model": model, **given})
    if (flag := missing(stated)) is not None:
        raise PlanError(flag, f"the {stated.format} file does not state it", "give it on the command line")
    if hw is None:
        raise PlanError("--hw", "is needed with --from", "the GPUs the configuration runs on, e.g. --hw 8xh100-sxm")
    cluster = resolve_hardware(hw)
    if stated.n_gpus is not None and stated.n_gpus != cluster.n_gpus:
        raise FormatError("--hw", f"{cluster.spec()} has {cluster.n_gpus} GPUs, the {stated.format} file launches "
                          f"{stated.n_gpus}", f"name hardware of {stated.n_gpus} GPUs")
    workload = resolve_workload(stated.model, seq_len=stated.seq_len, dtype=stated.dtype or "bf16", cluster=cluster)
    own = to_plan(stated, cluster, [layer.kind for layer in workload.layers])
    return own.model_copy(update={"estimate": estimate(workload, own, cluster)}), stated, workload, cluster


def propose(own: Plan, stated, workload, cluster, request_options: dict) -> tuple[Plan, list[str]]:
    """The fastest layout the user's tool can run, for the user's model, cluster, batch and recipe
    (precision and kernel stack): the user's own when no layout found is faster. Where no layout the
    search ranks can be expressed, the search's pick and the fields the tool cannot say."""
    import formats

    module = formats.TRAINING[stated.format]
    fixed = {**module.PINS, "stack": own.stack}
    result = plan(workload, cluster, global_batch=own.global_batch, seq_len=own.seq_len, dtype=own.dtype,
                  fixed=fixed, top_k=SEARCH_DEPTH, **request_options)
    named = lambda p: p.model_copy(update={"model": own.model, "alternatives": []})
    spoken = next((named(c) for c in [result, *result.alternatives] if _expressible(named(c), stated.format)), None)
    if own.estimate.fits and (spoken is None or own.estimate.step_time_s <= spoken.estimate.step_time_s):
        return own, []
    if spoken is not None:
        return spoken, []
    return named(result), formats.export(named(result), stated.format, lossy=True).lost


def _expressible(candidate: Plan, fmt: str) -> bool:
    import formats

    try:
        formats.export(candidate, fmt)
    except FormatError:
        return False
    return True


def comparison(own: Plan, proposed: Plan) -> str:
    """One line: the user's step against the proposal's."""
    from planner.search.pinned import memory_note

    mine, best = own.estimate, proposed.estimate
    if not mine.fits:
        return (f"your layout ({own.layout_tag}) does not fit as priced ({memory_note(mine)}); proposed "
                f"({proposed.layout_tag}): {best.step_time_s:.3f} s a step, {best.held_bytes / GIB:.1f} GiB reserved")
    if proposed is own:
        return f"your layout ({own.layout_tag}), {mine.step_time_s:.3f} s a step, is the fastest your tool runs: keep it"
    speedup = mine.step_time_s / best.step_time_s
    return (f"your layout ({own.layout_tag}): {mine.step_time_s:.3f} s a step; proposed ({proposed.layout_tag}): "
            f"{best.step_time_s:.3f} s, {speedup:.2f}x faster")
