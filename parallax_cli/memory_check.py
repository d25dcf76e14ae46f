"""`parallax plan --check-memory`: the pick's memory as the GPU would hold it, and a re-plan
keeping free what that reserves beyond the prediction.

Why: the search holds each plan's predicted reservation (its tensors and the caching allocator's
blocks, `costmodel.reserved`) to the GPU. That prediction composes a few mechanisms; the dry run
replays the pick's own allocations through a model of torch's allocator (`costmodel.allocator`),
on the GPU less the runtime's memory. What the replay reserves beyond the prediction becomes a
share of each GPU kept free, and the search runs again with it until its pick fits by that measure.
"""
from __future__ import annotations

from hardware.errors import ParallaxError, PlanError
from layout.plan import Plan

GIB = 2**30
ROUNDS = 3
MARGIN = 0.005  # of the GPU: a pick that lands exactly on the replay's figure is not refused for rounding


def fragmentation_share(rank) -> float:
    """What the replay reserves (with expandable segments, as `parallax run` sets the allocator)
    beyond the prediction, as a share of the GPU: the re-plan keeps it free. On the device where
    the pick fits there; with no memory pressure where it does not (what a smaller pick needs)."""
    replayed = rank.allocator
    fits_there = "reserved_on_device" in replayed and not replayed.get("out_of_memory")
    reserved = replayed["reserved_on_device"] if fits_there else replayed["reserved_expandable"]
    predicted = rank.predicted_reserved if rank.predicted_reserved is not None else replayed["allocated"]
    return max(0.0, reserved - predicted) / rank.gpu_bytes


def checked_plan(first: Plan, model: str, replan) -> tuple[Plan, list[str]]:
    """`first` dry-run; while the replay says a pick would not fit, or its reserve differs from
    the one it was searched with, `replan(reserve)` searches again with the replay's figure."""
    from executor.measure.dry_run import dry_run

    pick, reserve, lines, fitting = first, None, [], None
    for _ in range(ROUNDS):
        try:
            worst = dry_run(pick, model).worst
        except ParallaxError as error:
            return first, [f"memory not checked: {error}"]
        if worst.device_total is None or worst.gpu_bytes is None:
            return first, ["memory not checked: a mixed cluster's groups are judged on their usable memory"]
        share = fragmentation_share(worst)
        lines.append(_line(pick, worst, share))
        if worst.fits:
            fitting = pick
            if reserve is not None and share + MARGIN >= reserve:
                break
        reserve = share + MARGIN
        again = replan(reserve)
        if worst.fits and _same(again, pick):
            break
        pick = again
    if fitting is None:
        raise PlanError("--check-memory", f"no pick of {ROUNDS} searches fits by the allocator's replay",
                        "plan on more GPUs, or pin --recompute full")
    return fitting, lines


def _same(a: Plan, b: Plan) -> bool:
    return a.layout_tag == b.layout_tag and a.stages == b.stages


def _line(pick: Plan, rank, share: float) -> str:
    verdict = "fits" if rank.fits else "does not fit"
    return (f"memory check of {pick.layout_tag}: {rank.allocator['allocated'] / GIB:.1f} GiB allocated, "
            f"{rank.reserved / GIB:.1f} GiB reserved by the caching allocator's replay "
            f"({share:.1%} of the GPU beyond the prediction), {sum(rank.runtime.values()) / GIB:.2f} GiB runtime: "
            f"{rank.device_total / GIB:.1f} of {rank.gpu_bytes / GIB:.0f} GiB, {verdict}")
