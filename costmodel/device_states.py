"""A rank's model states on its device, by category, as each way of holding them keeps them:
ZeRO's shards, FSDP2's gathered copies, a pipeline's unsharded gradients, offload's host share,
and a weight's whole gradient where DTensor makes it whole. The moments of `costmodel.peak` and
the solver's coefficients (`planner/search/coefficients.py`) read these same terms.
"""
from __future__ import annotations

from hardware.schema import Cluster
from layout.plan import Plan

from .accumulation import held_zero
from .memory import WEIGHT_BYTES, gathered_weight_bytes, model_state_bytes, plan_state_bytes
from .offload import device_state_bytes, states_on_host


def device_states(params: float, expert_params: float, plan: Plan, cluster: Cluster,
                  whole_gradients: float = 0.0, stepping: bool = False) -> dict[str, float]:
    """The model states of a rank's `params` parameters on its device, by category: expert
    states shard over the ranks holding the same experts; offloaded ones are on the host;
    `whole_gradients` more parameters' gradients where the rank keeps a weight's whole
    (`whole_gradient_params`). FSDP2 inside a pipeline (`pipelined_fsdp`) keeps its master
    weights sharded, and its gradients unsharded until the step's one reduce-scatter: sharded
    at the optimizer step (`stepping`)."""
    if states_on_host(plan, cluster):  # offloaded: the sharded states and the optimizer step live on the host
        return device_state_bytes(params, plan)
    states = _states_at_zero(params, expert_params, plan, held_zero(plan))
    if whole_gradients:
        states["gradients"] += model_state_bytes(whole_gradients, plan.dtype, held_zero(plan), plan.shard_degree,
                                                 plan.stack, plan_state_bytes(plan))["gradients"]
    if pipelined_fsdp(plan):
        at_rest = _states_at_zero(params, expert_params, plan, plan.zero)
        states["weights"] = at_rest["weights"]
        if stepping:
            states["gradients"] = at_rest["gradients"]
    return states


def _states_at_zero(params: float, expert_params: float, plan: Plan, zero: int) -> dict[str, float]:
    per_param = plan_state_bytes(plan)
    states = model_state_bytes(params - expert_params, plan.dtype, zero, plan.shard_degree, plan.stack, per_param)
    if expert_params:
        experts = model_state_bytes(expert_params, plan.dtype, zero, max(1, plan.shard_degree // plan.ep),
                                    plan.stack, per_param)
        states = {k: states[k] + experts[k] for k in states}
    return states


def pipelined_fsdp(plan) -> bool:
    """FSDP2 under torch.distributed.pipelining (ZeRO-2/3 over a pipeline, eager and compile
    stacks): the schedule keeps each stage's 16-bit weights gathered and its gradients unsharded
    from one micro-batch to the next and reduce-scatters once per step (`held_zero`), while the
    fp32 master weights stay sharded. The dry run of llama-160m dp4 pp2 ZeRO-2 and ZeRO-3 at 256
    tokens read, on the first rank, 0.084 GiB of sharded weights and 0.507 of gathered weights
    and unsharded gradients, where the whole fp32 weights priced read +14.5%."""
    return plan.pp > 1 and plan.zero >= 2 and plan.gathers_weights and plan.stack != "fused"


def gathered_weights_held(params: float, layout, dtype: str, cluster: Cluster) -> float:
    """The `dtype` weights FSDP2 holds gathered through a step's micro-batches: ZeRO-2's
    (`gathered_weight_bytes`) and any pipelined stage's (`pipelined_fsdp`; an offloaded one's
    are in `device_state_bytes`). `layout`: a Plan or a Layout."""
    if pipelined_fsdp(layout) and layout.shard_degree > 1 and not states_on_host(layout, cluster):
        return WEIGHT_BYTES[dtype] * params
    return gathered_weight_bytes(params, dtype, held_zero(layout), layout.shard_degree, layout.stack)


def whole_gradient_params(plan: Plan, shards: float, params_on_rank: float) -> float:
    """The parameters beyond a layer's `params_on_rank` whose gradient a rank keeps as `.grad`,
    where DTensor made it `shards` TP shards whole (`held_gradient_shards`): without FSDP2's
    units (ZeRO-0/1, or any pipelined stage), `.grad` keeps a weight's first gradient as made.
    llama-160m dp2 tp4+sp ZeRO-1 at 256 tokens read 0.22 GiB of gradients at its peak, the
    embedding's whole fp32 table where its shard is 0.15."""
    return (shards - 1) * params_on_rank if held_zero(plan) <= 1 else 0.0
