"""Pipelines on CPU ranks that time-share a node's cores.

GPU ranks own their device, and the closed-form pipeline composition holds.
CPU ranks launched beyond the core count share cores: while some ranks wait
in the pipeline bubble, the busy ones run faster. This module replays the
schedule under processor sharing for such profiles (`Node.oversubscription`
greater than 1, recorded by `parallax calibrate`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hardware.schema import Cluster

from layout.plan import Plan
from .simulate.schedule import rank_orders

if TYPE_CHECKING:
    from .layout import RankTime


def shared_core_pipeline_time(ranks: list[RankTime], plan: Plan, cluster: Cluster) -> float | None:
    """The pipeline's length when the node's ranks time-share its cores (`Node.oversubscription` > 1).

    The profile's rates are those of a rank while all n ranks of its node compute; with
    k of them busy a rank runs min(oversubscription, n/k) times faster (processor
    sharing: k runnable single-thread ranks on c cores each get min(1, c/k) of a core).
    In a pipeline the ranks waiting in the warm-up and drain, or for a slower stage,
    hand their share to the ones computing, so the bubble is partly refilled and the
    slowest stage runs faster than the all-busy rate. The schedule's op order
    (simulate/schedule.py) is played with its data dependencies, each op progressing at
    its rank's current share. None when the cores are not shared: one device per rank.
    """
    over = cluster.node.oversubscription
    if over is None or over <= 1.0 or plan.pp == 1:
        return None
    pp, vpp, m = plan.pp, plan.vpp, plan.num_micro_batches
    orders = rank_orders(plan.schedule, pp, m, vpp)
    per_pp = plan.dp * plan.cp * plan.tp  # physical ranks doing each pipeline rank's work at once
    n = cluster.gpus_per_node
    pp_per_node = max(1, n // per_pp)
    work = []
    split = plan.splits_backward  # its backward runs as input gradients (B), then weight gradients (W)
    for r in ranks:
        comm = (r.tp_comm + r.pp_comm + r.zero_comm) / 2
        w = r.weight_grad if split else 0.0
        work.append({"F": (r.forward + comm) / vpp, "B": (r.backward - w + r.recompute + comm) / vpp, "W": w / vpp})
    last = pp * vpp - 1
    done: set = set()
    pos, left = [0] * pp, [None] * pp
    t = 0.0

    def ready(op) -> bool:
        if op.phase == "F":
            return op.stage == 0 or ("F", op.micro_batch, op.stage - 1) in done
        if op.phase == "W":
            return ("B", op.micro_batch, op.stage) in done
        return op.stage == last or ("B", op.micro_batch, op.stage + 1) in done

    while any(pos[r] < len(orders[r]) for r in range(pp)):
        running = [r for r in range(pp) if pos[r] < len(orders[r]) and ready(orders[r][pos[r]])]
        if not running:
            return None  # an order the dependencies cannot run: keep the closed form
        busy: dict[int, int] = {}
        for r in running:
            if left[r] is None:
                left[r] = work[r][orders[r][pos[r]].phase]
            busy[r // pp_per_node] = busy.get(r // pp_per_node, 0) + 1
        speed = {r: min(over, n / min(busy[r // pp_per_node] * per_pp, n)) for r in running}
        dt = min(left[r] / speed[r] for r in running)
        t += dt
        for r in running:
            left[r] -= speed[r] * dt
            if left[r] <= 1e-12 * (1.0 + t):
                op = orders[r][pos[r]]
                done.add((op.phase, op.micro_batch, op.stage))
                pos[r], left[r] = pos[r] + 1, None
    return t
