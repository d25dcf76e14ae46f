"""Event-driven simulation of one training step of a plan: the entry for every plan.

`estimate` composes a step from a closed formula; the simulator *plays* the step
(`playback`): one data-parallel replica's pipeline ranks (DP ranks are symmetric), each
with a compute stream and intra-/inter-node links, running the plan's real schedule order
against the data dependencies between stages. A mixed-cluster plan is played by the same
code with one cluster per pipeline rank (`mixed`).
"""
from __future__ import annotations

from hardware.schema import Cluster
from layout.plan import Plan

from ..autocast import under_autocast
from ..workload import Workload
from .mixed import simulate_mixed
from .ops import DEFAULT_BUCKET_BYTES
from .playback import SimResult, simulate_uniform


def simulate(workload: Workload, plan: Plan, cluster, *, bucket_bytes: float = DEFAULT_BUCKET_BYTES) -> SimResult:
    """Simulate one step of `plan` on `cluster` (a `Cluster`, or the `MixedCluster` a plan with
    groups was made for); raises PlanError if the plan does not fit the model or cluster."""
    workload = under_autocast(workload, plan)
    if plan.groups or not isinstance(cluster, Cluster):
        return simulate_mixed(workload, plan, cluster, bucket_bytes)
    return simulate_uniform(workload, plan, cluster, bucket_bytes)
