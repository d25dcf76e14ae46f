"""Each pipeline rank's memory constants for the solver: what its peaks hold besides its blocks'
states and saved activations (`rank_extra_bytes`) and its optimizer step's temporaries
(`step_fixed_bytes`), composed from `costmodel.peak`'s moments as the estimator composes them.
"""
from __future__ import annotations


from costmodel.data_parallel import layer_params_on_rank
from costmodel.reserved import (all_gather_pool_bytes, allocator_slack_bytes, moment_slacks,
                                root_hole_bytes)
from costmodel.device_states import device_states
from costmodel.peak import (accumulated_in_a_block_moment, activation_moments, block_buffer_bytes,
                            block_copy_bytes_per_param, closing_moments, gathers_zero3_units,
                            owned_shares, root_buffer_bytes, root_held_bytes)
from costmodel.offload import states_on_host
from costmodel.in_flight import held_output_bytes
from costmodel.memory import (activation_bytes, activation_keywords, held_gradient_bytes, moment_bytes,
                              new_gradient_bytes, optimizer_step_bytes, transient_bytes)
from layout.plan import Plan
from costmodel.workload import LayerProfile, tied_params_on_rank
from hardware.schema import Cluster


def step_fixed_bytes(prefix: list[LayerProfile], block: LayerProfile, suffix: list[LayerProfile], plan: Plan,
                cluster: Cluster, caching: bool) -> tuple[float, ...]:
    """Per pipeline rank, the optimizer step's memory that does not scale with its parameters
    (`costmodel.peak.optimizer_step_temporaries`: on a CPU, those of its largest weight), and
    FSDP2's all-gather pool cached beside it (`costmodel.reserved`)."""
    largest_share, device, S = owned_shares(plan)[1], cluster.gpu.device_type, plan.n_virtual_stages
    fixed = []
    for r in range(plan.pp):
        own = [block] + (prefix if r == 0 else []) + (suffix if r == plan.stage_rank(S - 1) else [])
        pool = _pool(own, block, plan) if caching else 0.0
        if states_on_host(plan, cluster):
            fixed.append(pool)
            continue
        largest = max(layer.largest_weight / (plan.tp if layer.tp_shardable else 1) for layer in own)
        fixed.append(optimizer_step_bytes(0.0, largest * largest_share, device, plan.stack, moment_bytes(plan)) + pool)
    return tuple(fixed)


def closing_extra_bytes(prefix: list[LayerProfile], block: LayerProfile, suffix: list[LayerProfile], plan: Plan,
                        cluster: Cluster, caching: bool) -> tuple[float, ...]:
    """Per pipeline rank, ZeRO-3's root unit at the backward's end beyond the rank's end states, at
    the larger of `costmodel.peak.closing_moments` (sharded only without a pipeline: one rank
    holding the embedding and the head), with FSDP2's all-gather pool cached beside (`costmodel.reserved`)."""
    if not gathers_zero3_units(plan):
        return ()
    root = params_on_rank(prefix + suffix, plan)
    tied = sum(tied_params_on_rank(l, plan.tp) for l in suffix if l.kind == "head")
    gradients = device_states(root, 0.0, plan, cluster)["gradients"]
    moments = closing_moments(root, tied, layer_params_on_rank(block, plan.tp, plan.ep), gradients, plan,
                              held=bool(held_gradient_bytes(root, plan)))
    pool = _pool(prefix + suffix + [block], block, plan) if caching else 0.0
    return (max(sum(m.values()) for m in moments) + pool,) * plan.pp


def _pool(own: list[LayerProfile], block: LayerProfile, plan: Plan) -> float:
    """FSDP2's all-gather stream's pool on a rank holding `own`'s end layers beside its blocks."""
    return all_gather_pool_bytes(plan, params_on_rank([l for l in own if l is not block], plan),
                                 layer_params_on_rank(block, plan.tp, plan.ep))


def rank_extra_bytes(prefix: list[LayerProfile], block: LayerProfile, suffix: list[LayerProfile], plan: Plan,
                      rebuilt: float, caching: bool = True) -> tuple[tuple, tuple]:
    """Each pipeline rank's peak reservation besides states and saved activations, as
    `costmodel.peak.peak_moments` holds it, without and with a fully recomputed block
    (`rebuilt` bytes): the largest of the loss's moment (its layers' temporaries), the root
    unit's backward (ZeRO-3's gathered embedding and head, the head's saved activations
    freed) and a block's backward (the block's gather buffers, the root unit's weights where it
    holds the embedding, the accumulation transient, the larger of the block's temporaries and
    the rebuilt block, the head's saved activations freed), each with the caching allocator's blocks cached then, and FSDP2's
    all-gather pool beside them (`costmodel.reserved`; none on CPU ranks: `caching`).
    Returned as (without, with - without) per rank: a constant and the coefficient of the
    solver's per-rank full-recompute indicator."""
    kw = activation_keywords(plan, 0.0, plan.dtype)
    S = plan.n_virtual_stages
    ends = [(prefix if r == 0 else []) + (suffix if r == plan.stage_rank(S - 1) else []) for r in range(plan.pp)]
    sharded = gathers_zero3_units(plan)

    def largest(layers: list[LayerProfile]) -> float:
        return max((new_gradient_bytes(l, plan) for l in layers if accumulated_in_a_block_moment(l, plan)), default=0.0)

    accumulating = plan.num_micro_batches >= 2
    block_temporaries = transient_bytes(block, **kw)
    block_buffer = block_buffer_bytes(layer_params_on_rank(block, plan.tp, plan.ep), plan.dtype,
                                      block_copy_bytes_per_param(plan)) if sharded else 0.0
    without, growth, seen = [], [], {}
    for own in ends:
        if len(own) in seen and seen[len(own)][0] == own:  # the middle ranks hold no ends: priced once
            plain, grows = seen[len(own)][1]
            without.append(plain)
            growth.append(grows)
            continue
        terms = dict(end_temporaries=max((transient_bytes(layer, **kw) for layer in own), default=0.0),
                     head_saved=sum(activation_bytes(layer, "none", **kw) + held_output_bytes(layer, pipelined=plan.pp > 1, **kw)
                                    for layer in own if layer.kind == "head"),
                     accumulation=max(largest([block]), largest(own)) if accumulating else 0.0,
                     root_buffer=root_buffer_bytes(params_on_rank(own, plan), plan.dtype) if sharded else 0.0,
                     block_buffer=block_buffer,
                     # sharded only without a pipeline: its one rank holds the embedding
                     root_held=root_held_bytes(params_on_rank(own, plan), bool(prefix), plan.dtype) if sharded else 0.0)
        slacks = _slacks(own, block, plan, kw, terms["end_temporaries"], sharded) if caching else [0.0] * 3
        pool = _pool(own + [block], block, plan) if caching else 0.0

        def held(work: float) -> float:
            return max(sum(m.values()) + slack for m, slack in zip(activation_moments(0.0, block_work=work, **terms),
                                                                     slacks)) + pool

        plain, rebuilding = held(block_temporaries), held(max(block_temporaries, rebuilt))
        without.append(plain)
        growth.append(rebuilding - plain)
        seen[len(own)] = (own, (plain, rebuilding - plain))
    return tuple(without), tuple(growth)


def _slacks(own: list[LayerProfile], block: LayerProfile, plan: Plan, kw: dict, end_temporaries: float,
            sharded: bool) -> list[float]:
    """The caching allocator's blocks cached at each moment (`costmodel.reserved.moment_slacks`)."""
    end = max((allocator_slack_bytes(layer, **kw) for layer in own), default=0.0)
    hole = root_hole_bytes(plan, params_on_rank(own, plan), end_temporaries, sharded)
    return moment_slacks(end, allocator_slack_bytes(block, **kw), hole)


def params_on_rank(layers, plan) -> float:
    return sum(layer_params_on_rank(layer, plan.tp, plan.ep) for layer in layers)
