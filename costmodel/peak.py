"""A pipeline rank's memory at its peak, by category, as the dry run measures it: the moments
a step's memory can peak at (the loss, the root unit's and a block's backward, the optimizer
step) and what each holds, with what the caching allocator reserves beside them. The solver's
coefficients (`planner/search/coefficients.py`) call these same terms.
"""
from __future__ import annotations


from hardware.schema import Cluster

from .autocast import autocast_copy_bytes, cast_back_bytes, cast_gradient_pile_bytes, cast_params_on_rank
from .accumulation import held_zero
from .data_parallel import layer_params_on_rank
from .in_flight import held_output_bytes, rank_holdings, receive_buffer_bytes, receive_buffers, saved_at_peak
from .memory import (WEIGHT_BYTES, activation_bytes, activation_keywords, bucket_copy_bytes, held_gradient_bytes,
                     held_gradient_shards, moment_bytes, new_gradient_bytes, optimizer_step_bytes, reduce_bytes,
                     tied_on_rank, transient_bytes)
from .layout import RankTime, kv_bytes_per_sequence, stage_runs
from .offload import states_on_host
from .device_states import device_states, gathered_weights_held, pipelined_fsdp, whole_gradient_params
from .reserved import (all_gather_pool_bytes, allocator_slack_bytes, caches_blocks, moment_slacks,
                       peak_reserved_bytes, root_hole_bytes)
from layout.axes import REBUILT
from layout.plan import Plan
from .workload import LayerProfile, Workload, tied_params_on_rank


def owned_shares(plan: Plan) -> tuple[float, float]:
    """The fractions of its parameters and of its largest weight a rank owns (steps) under
    ZeRO: a 1/shard_degree share of each (FSDP2's shards; ZeRO-1's rows of every weight,
    executor/apply/zero_one.py)."""
    shard = plan.shard_degree if plan.zero >= 1 else 1
    return 1 / shard, 1 / shard


def peak_moments(plan: Plan, workload: Workload, rank_index: int, rank: RankTime,
                 cluster: Cluster) -> tuple[dict, float, float]:
    """The rank's memory by category at the largest of its four candidate peaks, as the dry
    run measures them:
    - the loss, computed outside every FSDP2 unit between forward and backward: every
      in-flight micro-batch's saved activations and the last layers' temporaries (the loss's
      fp32 logits and their gradients), no gathered buffers;
    - the root unit's backward (the head's, after the loss's): the saved activations less
      the head's one micro-batch (the loss's log-probabilities, its largest, are freed) and
      ZeRO-3's gathered root weights with their unsharded gradients;
    - a block's backward: the saved activations less the head's one micro-batch (freed by
      then), the block's and the next's gathered weights and one block's unsharded gradients,
      the accumulation transient, and the larger of the block's temporaries and a fully
      recomputed block being rebuilt (one layer at a time), and the root unit's weights where
      it holds the embedding (`root_held_bytes`);
    - the optimizer step: every gradient and AdamW's temporaries (`optimizer_step_bytes`), or
      just before it, under ZeRO-3, the root unit's unsharded gradients and the flat copy its
      reduce-scatter reads (in the reduce dtype) beside every other gradient.
    Under ZeRO-2 FSDP2 holds the rank's gathered 16-bit weights at all three instead
    (`gathered_weight_bytes`). Model states are there at each, but for one micro-batch under
    FSDP2 without pipelining no gradient exists yet (`gradients_at_peak`); held unsharded
    (`held_gradient_bytes`), they sit beside the gather buffers instead. Returns the peak's categories, every
    in-flight micro-batch's saved activations (`activations` less them: that moment's transient), and what
    the caching allocator reserves at its largest (`reserved.peak_reserved_bytes`)."""
    shares_table = tied_on_rank(workload, plan)
    shards = [(held_gradient_shards(layer, plan, shares_table), layer_params_on_rank(layer, plan.tp, plan.ep) * count)
              for est in rank.stage_estimates for layer, _, count in stage_runs(plan, workload, est.index)]
    whole = sum(whole_gradient_params(plan, n, params) for n, params in shards)
    states = device_states(rank.params, rank.expert_params, plan, cluster, whole)
    ending = dict(states)  # a backward's end: every state as the backward leaves it
    stepping = {**device_states(rank.params, rank.expert_params, plan, cluster, whole, stepping=True),
                "activations": optimizer_step_temporaries(plan, workload, rank, cluster)}
    if not gradients_at_peak(plan):
        states["gradients"] = 0.0
    held_gradients = held_gradient_bytes(rank.params + sum((n - 1) * params for n, params in shards), plan)
    if held_gradients:  # unsharded until the last micro-batch reduces them, and no sharded ones yet
        states["gradients"] = 0.0
    dense = rank.params - rank.expert_params
    states["gradients"] += bucket_copy_bytes(dense, plan, stepping=False)
    stepping["gradients"] += bucket_copy_bytes(dense, plan, stepping=True)
    ending["gradients"] += bucket_copy_bytes(dense, plan, stepping=True)
    kw = activation_keywords(plan, kv_bytes_per_sequence(workload), plan.dtype)
    head_saved, rebuild, block_temporaries, end_temporaries = 0.0, 0.0, 0.0, 0.0
    biggest, root, tied, cast, block_slack, end_slack, cast_back = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    kept_by_stage, outputs_by_stage = {}, {}  # per micro-batch of each of the rank's stages
    for est in rank.stage_estimates:
        kept_by_stage[est.index], outputs_by_stage[est.index] = 0.0, 0.0
        for layer, policy, count in stage_runs(plan, workload, est.index):
            kept = activation_bytes(layer, policy, **kw)
            output = held_output_bytes(layer, pipelined=plan.pp > 1, **kw)
            kept_by_stage[est.index] += kept * count
            outputs_by_stage[est.index] += output * count
            cast += cast_params_on_rank(layer, plan.tp, plan.ep) * count
            cast_back = max(cast_back, backward_end_bytes(layer, plan))
            if layer.kind == "block":
                block_temporaries = max(block_temporaries, transient_bytes(layer, **kw))
                block_slack = max(block_slack, allocator_slack_bytes(layer, **kw))
                biggest = max(biggest, layer_params_on_rank(layer, plan.tp, plan.ep))
            else:
                end_temporaries = max(end_temporaries, transient_bytes(layer, **kw))
                end_slack = max(end_slack, allocator_slack_bytes(layer, **kw))
                root += layer_params_on_rank(layer, plan.tp, plan.ep) * count
                if layer.kind == "head":  # its one micro-batch, the logits with it
                    head_saved += (kept + output) * count
                    tied += tied_params_on_rank(layer, plan.tp) * count
            if policy in REBUILT:
                rebuild = max(rebuild, activation_bytes(layer, "none", **kw))
    receiving = rank_receiving(plan, workload, list(kept_by_stage))
    for index in kept_by_stage:  # a held micro-batch's input is its receive buffer, counted in `receiving`
        kept_by_stage[index] = max(0.0, kept_by_stage[index] - stage_input_bytes(plan, workload, index))
    holdings = rank_holdings(plan.schedule, rank_index, plan.pp, plan.vpp, plan.num_micro_batches)
    saved = saved_at_peak(holdings, kept_by_stage, outputs_by_stage) + receiving
    sharded = gathers_zero3_units(plan)
    gathered = {"root": root_buffer_bytes(root, plan.dtype), "block": block_buffer_bytes(biggest, plan.dtype, block_copy_bytes_per_param(plan))}
    first_layers = 0 in kept_by_stage and workload.layers[0].kind != "block"
    moments = activation_moments(saved, end_temporaries, head_saved, max(rebuild, block_temporaries),
                                 accumulation_transient(plan, workload, rank), gathered["root"], gathered["block"],
                                 root_held_bytes(root, first_layers, plan.dtype) if sharded else 0.0)
    held = gathered_weights_held(rank.params, plan, plan.dtype, cluster)
    if held:
        moments = [{**m, "buffers": held} for m in moments]
    elif not sharded:
        moments = [{"activations": m["activations"]} for m in moments]
    copies = autocast_copy_bytes(cast, plan)
    pile = cast_gradient_pile_bytes(cast, plan)
    if pile or cast_back:  # a backward's end: every gradient, the cast copies and their gradients, no activations
        closing = {**ending, "activations": cast_back,
                   "buffers": copies + pile + (held if pipelined_fsdp(plan) else 0.0)}
        stepping = max(stepping, closing, key=lambda m: sum(m.values()))
    if copies:  # autocast's compute-dtype weights, from the first forward to the backward's end
        moments = [{**m, "buffers": m.get("buffers", 0.0) + copies} for m in moments]
    if held_gradients:  # FSDP2's unsharded parameters' gradients, beside its gather buffers
        moments = [{**m, "buffers": m.get("buffers", 0.0) + held_gradients} for m in moments]
    peak = {**states, **max(moments, key=lambda m: sum(m.values()))}
    if sharded and root:  # the backward's end, the root unit's gradients made and reduced
        root_gradients = device_states(root, 0.0, plan, cluster)["gradients"]
        for extra in closing_moments(root, tied, biggest, root_gradients, plan, held=bool(held_gradients)):
            closing = {**stepping, **extra, "gradients": stepping["gradients"] + extra.get("gradients", 0.0)}
            stepping = max(stepping, closing, key=lambda m: sum(m.values()))
    stepping["activations"] += receiving
    caching = caches_blocks(cluster)
    slacks = moment_slacks(end_slack, block_slack, root_hole_bytes(plan, root, end_temporaries, sharded))
    reserved = peak_reserved_bytes([sum(states.values()) + sum(m.values()) for m in moments],
                                   slacks if caching else [0.0] * len(moments), sum(stepping.values()),
                                   all_gather_pool_bytes(plan, root, biggest) if caching else 0.0)
    if sum(stepping.values()) > sum(peak.values()):
        return stepping, stepping["activations"], reserved  # nothing saved then: no transient beside the ops
    return peak, saved, reserved


def activation_moments(saved: float, end_temporaries: float, head_saved: float, block_work: float,
                       accumulation: float, root_buffer: float, block_buffer: float,
                       root_held: float = 0.0) -> list[dict[str, float]]:
    """The three moments of a rank's activation peak (`peak_moments`), by category: the loss
    (every in-flight micro-batch's `saved` activations and the last layers' temporaries), the
    root unit's backward (the head's one micro-batch of saved activations freed, ZeRO-3's
    gathered root weights), and a block's backward (the larger of its temporaries and a
    rebuilt block, the accumulation transient, the block's gather buffers and the root unit's
    weights held, `root_held`). The solver calls
    it with `saved` 0 and adds its own linear saved term (`rank_extra_bytes`)."""
    return [
        {"activations": saved + end_temporaries, "buffers": 0.0},
        {"activations": saved - head_saved, "buffers": root_buffer},
        {"activations": saved - head_saved + block_work + accumulation, "buffers": block_buffer + root_held},
    ]


def closing_moments(root: float, tied: float, block: float, root_gradients: float, plan: Plan,
                    held: bool = False) -> list[dict[str, float]]:
    """ZeRO-3's backward end beyond the rank's states (its `buffers` and `activations`, and what
    its `gradients` lack then), at the two moments it can peak at:
    - the embedding's backward, the last of the root unit (embedding, head, norm): the unit
      gathered, the last block's reduce-scatter copy still in flight (FSDP2 frees it when the
      next unit's reduce-scatter starts), and the unit's unsharded gradients, a tied table's
      three times (the head's, the embedding's new one and their sum, which autograd adds out of
      place); the unit's sharded gradients are not made yet. The dry run of llama-3.2-1b dp8
      ZeRO-3 at 512 tokens read 1.47 GiB of tied gradients, 0.49 of the gathered table and 0.23
      of a block's copy there, above the blocks' sharded gradients;
    - the unit's reduce-scatter: its gathered weights and the flat copy of its gradients in the
      reduce dtype. Only this one where gradients are held unsharded across micro-batches
      (`held`), the embedding's backward then adding to gradients already counted."""
    weight, reduced = WEIGHT_BYTES[plan.dtype], reduce_bytes(plan)
    scatter = {"buffers": weight * root, "activations": reduced * root}
    if held:
        return [scatter]
    embedding = {"gradients": -root_gradients, "buffers": weight * root + reduced * block,
                 "activations": weight * (root + 2 * tied)}
    return [embedding, scatter]


def root_held_bytes(root_params: float, holds_first_layers: bool, dtype: str) -> float:
    """FSDP2's root unit under ZeRO-3 through the blocks' backward: its gathered 16-bit weights
    where it holds the layers before the blocks. One unit holds the embedding and the head; it is
    gathered for the head's backward and resharded only once every parameter of it has its
    gradient, the embedding's last. The dry run of llama-3-70b dp64 ZeRO-3 offloaded read 5.51 GiB
    of unsharded parameters at a block's backward: one block's and the root's 2.1 billion."""
    return WEIGHT_BYTES[dtype] * root_params if holds_first_layers else 0.0


def stage_input_bytes(plan: Plan, workload: Workload, index: int) -> float:
    """One micro-batch's input buffer on virtual stage `index` (`in_flight.receive_buffer_bytes`
    of the layer before it), none on the first: a held micro-batch's input, counted as the buffer."""
    if index == 0:
        return 0.0
    layer = workload.layers[plan.stages[index].start - 1]
    return receive_buffer_bytes(layer, **activation_keywords(plan, 0.0, plan.dtype))


def rank_receiving(plan: Plan, workload: Workload, stages: list[int]) -> float:
    """What a pipeline rank's virtual `stages` hold in receive buffers through the step
    (`in_flight.receive_buffers`)."""
    keywords, layers = activation_keywords(plan, 0.0, plan.dtype), workload.layers
    inputs = {i: stage_input_bytes(plan, workload, i) for i in stages}
    grads = {i: receive_buffer_bytes(layers[plan.stages[i].end - 1], **keywords) for i in stages}
    return receive_buffers(stages, plan.n_virtual_stages, inputs, grads, plan.num_micro_batches)


def optimizer_step_temporaries(plan: Plan, workload: Workload, rank: RankTime, cluster: Cluster) -> float:
    """AdamW's temporaries in the rank's step (`memory.optimizer_step_bytes`), over the
    parameters it owns: a 1/shard_degree share of each under ZeRO (`owned_shares`)."""
    if states_on_host(plan, cluster):
        return 0.0
    largest = 0.0
    for est in rank.stage_estimates:
        for layer, _, _ in stage_runs(plan, workload, est.index):
            largest = max(largest, layer.largest_weight / (plan.tp if layer.tp_shardable else 1))
    params_share, largest_share = owned_shares(plan)
    return optimizer_step_bytes(rank.params * params_share, largest * largest_share, cluster.gpu.device_type, plan.stack,
                                moment_bytes(plan))


def gradients_at_peak(plan: Plan) -> bool:
    """Whether gradients exist at the activation peak (`gradients_held`)."""
    return gradients_held(plan, plan.num_micro_batches)


def gradients_held(layout, num_micro_batches: int) -> bool:
    """Whether gradients exist at the activation peak of `layout` (a Layout or Plan). With one
    micro-batch and no pipeline, not where nothing keeps them between steps: zero_grad sets
    them to None and the backward makes them as it frees activations (FSDP2, and on the
    eager and compile stacks every rank outside DDP, executor/apply/gradient_reduce.py).
    DDP's buckets (its gradients are views into them), Megatron's gradient buffer under
    ZeRO-0/1 (the fused stack), accumulated micro-batches and pipelined FSDP2's unsharded
    gradients are there."""
    if layout.pp > 1 or num_micro_batches > 1:
        return True
    if layout.stack == "fused":
        return layout.zero <= 1
    return layout.reduces_through_ddp


def root_buffer_bytes(root_params: float, dtype: str) -> float:
    """FSDP2's root unit under ZeRO-3 (the stage's embedding, head and norms) during its
    backward: its gathered 16-bit weights and their unsharded gradients."""
    return 2 * WEIGHT_BYTES[dtype] * root_params


def block_copy_bytes_per_param(plan: Plan) -> float:
    """Bytes per parameter that the flat copy a block's reduce-scatter reads adds beside a
    block's backward (`block_buffer_bytes`' `reduced`): one in the reduce dtype, or none where
    FSDP2 holds the gradients unsharded across micro-batches (`held_gradient_bytes`, priced
    whole), as the last micro-batch's reduce-scatter copies a block's held gradients in and
    frees them: the copy takes their place. The dry run of llama-3.2-1b dp8 ZeRO-3 holding
    them, 2 micro-batches at 512 tokens, peaks in block 14's backward with 15 blocks' held fp32
    gradients and block 15's copy (232 MiB each), not 16 and the copy."""
    return 0.0 if held_gradient_bytes(1.0, plan) else reduce_bytes(plan)


def block_buffer_bytes(block_params: float, dtype: str, reduced: float = 2.0) -> float:
    """FSDP2 under ZeRO-3 during a block's backward: the block gathered while the next is
    prefetched, one block's unsharded gradients, and the flat copy of them its reduce-scatter
    reads, in the reduce dtype (`reduced` bytes each: FSDP2 copies the gradients in before it
    frees them)."""
    return (3 * WEIGHT_BYTES[dtype] + reduced) * block_params


def accumulation_transient(plan: Plan, workload: Workload, rank: RankTime) -> float:
    """Accumulating gradients over micro-batches, autograd computes a weight's gradient into a
    new tensor before adding it to `.grad`: one weight at a time, the largest the rank holds
    whose backward runs while a block's does (`accumulated_in_a_block_moment`)."""
    if plan.num_micro_batches < 2:
        return 0.0
    return max((new_gradient_bytes(layer, plan) for est in rank.stage_estimates
                for layer, _, _ in stage_runs(plan, workload, est.index)
                if accumulated_in_a_block_moment(layer, plan)), default=0.0)


def accumulated_in_a_block_moment(layer: LayerProfile, plan: Plan) -> bool:
    """Whether `layer`'s new gradient belongs to a block's backward moment: every layer's but
    an embedding's outside ZeRO-3's units, whose backward is its micro-batch's last, priced at
    the backward's end instead (`backward_end_bytes`)."""
    return layer.kind != "embedding" or gathers_zero3_units(plan)


def backward_end_bytes(layer: LayerProfile, plan: Plan) -> float:
    """Bytes `layer` adds beside the states at a backward's end: autocast's cast-back
    (`cast_back_bytes`), or an embedding's new gradient where it accumulates over micro-batches
    outside ZeRO-3's units (whose root unit `closing_moments` prices). An embedding's backward is
    its micro-batch's last, so that micro-batch's activations are gone by then; under autocast it
    is newer than the pile's cast nodes and runs with the pile held; and under DTensor's TP the
    new gradient is the whole table. llama-160m dp1 tp2+sp pp2 ZeRO-0, 2 micro-batches of 4 at
    128 tokens: the first rank's dry run peaks in `embedding_dense_backward` with the whole fp32
    table (93.8 MiB) and 18 cast gradients, no block's activations (+13.7% priced in a block's
    moment); dp4 tp2 ZeRO-1 at 256 tokens: -4.05% unpriced."""
    if layer.kind != "embedding":
        return cast_back_bytes(layer, plan)
    if plan.num_micro_batches < 2 or gathers_zero3_units(plan):
        return 0.0
    return new_gradient_bytes(layer, plan)


def gathers_zero3_units(plan: Plan) -> bool:
    """Whether FSDP2 shards the rank's weights in units it gathers for each use (ZeRO-3)."""
    return held_zero(plan) >= 3 and plan.gathers_weights
