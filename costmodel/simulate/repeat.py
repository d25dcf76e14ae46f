"""A step of many identical micro-batches, played at two short lengths and counted.

Why: the engine keeps an event per operation, so a step of a million micro-batches (a
huge global batch on few GPUs) would hold tens of millions of events and exhaust memory.
Every micro-batch of a uniform plan is the same work, so past the pipeline's warm-up each
extra one adds the same steady-state period to every rank: the step is affine in the
micro-batch count (but for each micro-batch's share of once-a-step work, autocast's first cast and
the gradients added into `.grad`, which moves as 1/m: past the 256 played, by well under 1% of that
work). Playing `a` and `a + unit` micro-batches (unit: what the schedule
needs, pp for the interleaved one) gives that period; every time, busy and memory figure
is then the played one carried on to the plan's count. The timeline kept (trace, plots)
is the longer played one, and the result says how many were played.
"""
from __future__ import annotations

from dataclasses import fields, replace

from layout.axes import CHUNKED_SCHEDULES
from layout.plan import Plan

MAX_PLAYED_MICRO_BATCHES = 256  # ~10^5 events for a 16-stage pipeline: a fraction of a second, tens of MB


def played_lengths(plan: Plan, cap: int = MAX_PLAYED_MICRO_BATCHES) -> tuple[int, int] | None:
    """(a, b): the two micro-batch counts to play in place of the plan's, or None to play it whole."""
    m, unit = plan.num_micro_batches, plan.pp if plan.schedule in CHUNKED_SCHEDULES else 1
    if m <= cap or plan.dp_micro_batches or plan.groups:
        return None
    a = max(2 * plan.pp * plan.vpp, cap // unit * unit)  # past the warm-up and cool-down
    return (a, a + unit) if a + unit < m else None


def shortened(plan: Plan, micro_batches: int) -> Plan:
    """The plan with `micro_batches` per replica: the same layout, a smaller global batch."""
    return plan.model_copy(update={"global_batch": micro_batches * plan.micro_batch * plan.data_parallel})


def carried(short, longer, a: int, b: int, plan: Plan):
    """The SimResult of `plan` from its runs at `a` (short) and `b` (longer) micro-batches."""
    t = (plan.num_micro_batches - b) / (b - a)
    result = _affine(short, longer, t)
    ranks = [_affine(x, y, t) for x, y in zip(short.ranks, longer.ranks)]
    busiest = max(r.busy_s for r in ranks)
    peak = max(ranks, key=lambda k: k.peak_memory_bytes)
    flops_per_token_s = longer.mfu * longer.step_time_s / (longer.plan.global_batch * longer.plan.seq_len)
    return replace(result, plan=plan, ranks=ranks, played_micro_batches=b,
                   bubble_fraction=(result.pipeline_s - busiest) / busiest if busiest else 0.0,
                   peak_memory_bytes=peak.peak_memory_bytes, peak_memory_rank=peak.rank,
                   peak_memory_time_s=peak.peak_memory_time_s,
                   tokens_per_s=plan.global_batch * plan.seq_len / result.step_time_s,
                   mfu=flops_per_token_s * plan.global_batch * plan.seq_len / result.step_time_s)


def _affine(short, longer, t: float):
    """A copy of `longer` whose numbers go on past it by `t` times their change from `short`."""
    updates = {}
    for f in fields(longer):
        x, y = getattr(short, f.name), getattr(longer, f.name)
        if isinstance(y, float) and isinstance(x, (int, float)):
            updates[f.name] = y + t * (y - x)
        elif isinstance(y, dict) and all(isinstance(v, float) for v in y.values()):
            updates[f.name] = {k: v + t * (v - x.get(k, 0.0)) for k, v in y.items()}
    return replace(longer, **updates)
