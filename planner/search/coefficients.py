"""Per-layout cost coefficients for the CP-SAT stage model, taken from the cost model.

The solver prices one block per checkpointing policy once ("price repeated
layers once") and the fixed layers (embedding, head) once, using the very
functions the estimator composes, so that the solver's linear model and the
estimator agree on uniform plans.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from costmodel.compute import Context, LayerParts, LayerTime, layer_parts, layer_time
from costmodel.data_parallel import (dp_time, expert_reduction_time, layer_params_on_rank, optimizer_seconds_per_param, prefetch_fill,
                                     sharded_collectives, sharded_exposed, weight_gather_time)
from costmodel.reserved import caches_blocks
from costmodel.device_states import device_states, gathered_weights_held, pipelined_fsdp, whole_gradient_params
from costmodel.peak import backward_end_bytes, gradients_at_peak, owned_shares
from costmodel.terms import p2p_time
from costmodel.autocast import (autocast_copy_bytes, cast_gradient_pile_bytes, cast_params_on_rank,
                               under_autocast)
from costmodel.layout import layout_of
from costmodel.offload import states_on_host
from costmodel.in_flight import (Holding, fewest_in_flight, held_output_bytes, least_held_moment, rank_holdings,
                                receive_buffer_bytes, receive_buffers)
from costmodel.memory import (activation_bytes, activation_keywords, bucket_copy_bytes,
                              held_gradient_bytes, held_gradient_shards, moment_bytes, optimizer_step_bytes,
                              tied_on_rank)
from layout.axes import RECOMPUTE, V_SCHEDULES, hands_over_in_place, stage_rank
from layout.plan import Plan
from costmodel.workload import LayerProfile, Workload
from hardware.schema import Cluster

from planner.search.rank_peak import closing_extra_bytes, rank_extra_bytes, step_fixed_bytes

POLICIES = RECOMPUTE
_CONTEXT_FIELDS = tuple(f.name for f in fields(Context) if f.name != "cluster")


@dataclass(frozen=True)
class LayerCoefficients:
    """One layer on one rank for one micro-batch, per policy."""

    time: dict[str, float]  # fwd + bwd + recompute + TP comm + exposed ZeRO-3 gathers
    backward: dict[str, float]  # bwd + recompute (the DP-overlap window)
    activation: dict[str, float]  # bytes kept per micro-batch
    params: float  # parameters on the rank
    expert_params: float = 0.0  # of `params`: expert weights, reduced over their own replicas after the backward
    states: float = 0.0  # bytes of its states on the rank at the activation peak (experts shard over fewer ranks)
    step_states: float = 0.0  # bytes at the optimizer step: every state and AdamW's per-parameter temporaries
    end_states: float = 0.0  # bytes at a backward's end: every state, no temporaries yet
    weight_grad: float = 0.0  # of `time`: the weight gradients a zero-bubble schedule moves into the bubble
    pile: float = 0.0  # bytes at a backward's end beside `states`: autocast's cast gradients (`cast_gradient_pile_bytes`)
    cast_back: float = 0.0  # beside the pile at a backward's end (`backward_end_bytes`): the rank's largest counts
    output: float = 0.0  # bytes per micro-batch in the pipeline's forward cache: the head's logits (`held_output_bytes`)


@dataclass(frozen=True)
class RankFixed:
    """One pipeline rank's per-micro-batch work and memory besides its blocks: the embedding on
    the first, the head on the last, a send at every virtual stage boundary and each stage's
    unhidden sharded collectives."""

    time: float
    saved: float  # its embedding's and head's bytes kept at the bounds' moment (`StageModelData.bound_holding`)
    params: float
    states: float = 0.0  # see LayerCoefficients
    step_states: float = 0.0
    weight_grad: float = 0.0
    closing: float = 0.0  # at a backward's end, besides its blocks (`StageModelData.closing_fixed`)


@dataclass(frozen=True)
class StageModelData:
    """Everything the CP-SAT model needs for one layout."""

    block: LayerCoefficients
    prefix: list[LayerCoefficients]  # layers before the blocks (stage 0)
    suffix: list[LayerCoefficients]  # layers after the blocks (last stage)
    n_blocks: int
    p2p: float  # per virtual stage boundary, per micro-batch
    in_flight: list[float]  # per pipeline rank: the bounds' factor for its blocks (`fewest_in_flight`)
    dp_seconds_per_param: float  # the overlapped reduction of the dense parameters (not the experts)
    dp_latency: float
    optimizer_seconds_per_param: float  # AdamW's step over every parameter the rank holds
    capacity: float
    core_sharing: float = 1.0  # how much faster a CPU rank may run while its node's peers wait (Node.oversubscription)
    fills: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # see `stage_fill`
    extra: tuple[float, ...] = ()  # per pipeline rank: its peak's buffers and transients (`rank_extra_bytes`)
    fixed: tuple[RankFixed, ...] = ()  # per pipeline rank, for the layout's pp and vpp (`rank_fixed`)
    rebuild: tuple[float, ...] = ()  # per pipeline rank: what a fully recomputed block adds to its peak
    schedule: str = "1f1b"  # the layout's: a zero-bubble one fills its ramps with weight gradients (`bubble_fill`)
    crossing: tuple[float, ...] = ()  # per pipeline rank: sends to another GPU group (`costmodel.mixed.crossing_seconds`)
    gather_seconds_per_param: float = 0.0  # ZeRO-1's weight all-gather after the step, of the dense parameters
    expert_seconds_per_param: float = 0.0  # the experts' reduction after the backward (`expert_reduction_time`)
    expert_latency: float = 0.0
    step_fixed: tuple[float, ...] = ()  # per pipeline rank: the step's temporaries that do not scale with its parameters
    holdings: tuple[tuple[Holding, ...], ...] = ()  # per pipeline rank: the moments it can peak at (`rank_holdings`)
    in_flight_extra: tuple[float, ...] = ()  # per pipeline rank: the bounds' bytes beside `in_flight` (`fewest_in_flight`)
    stage_input: float = 0.0  # a virtual stage's input per micro-batch: its receive buffer (`receive_buffer_bytes`)
    receiving: tuple[float, ...] = ()  # per pipeline rank: its stages' receive buffers, held through the step
    closing_extra: tuple[float, ...] = ()  # per pipeline rank: ZeRO-3's root unit at a backward's end (`closing_extra_bytes`)

    def holding_terms(self, r: int, S: int) -> list[tuple[dict[int, int], float]]:
        """Rank r's saved bytes at each moment it can peak at (`costmodel.in_flight.saved_at_peak`),
        as a linear form in its stages' blocks: per moment, each stage's micro-batches held (what
        its blocks' bytes per micro-batch are multiplied by) and what its embedding or head layers
        keep then, for no recomputation (their saved activations and the head's logits), less each
        held input of a stage but the first: its receive buffer, in `extra` (`receive_buffers`)."""
        terms = []
        for holding in self.holdings[r]:
            ends = sum(l.activation["none"] * saved + l.output * outputs
                       for s, saved, outputs in holding for l in self.end_layers(s, S))
            ends -= sum(self.stage_input * saved for s, saved, _ in holding if s > 0)
            terms.append(({s: saved for s, saved, _ in holding}, ends))
        return terms

    def saved_bytes(self, r: int, S: int, blocks: Mapping[int, float],
                    terms: list[tuple[dict[int, int], float]] | None = None) -> float:
        """Rank r's saved bytes at its peak, its blocks keeping `blocks[s]` bytes per micro-batch on
        each virtual stage s (`holding_terms`, or `terms` where the caller holds them)."""
        return max(sum(blocks.get(s, 0.0) * n for s, n in held.items()) + ends
                   for held, ends in (terms if terms is not None else self.holding_terms(r, S)))

    def bound_holding(self, r: int, S: int) -> tuple[dict[int, int], float]:
        """The `holding_terms` moment the bounds take for rank r: the one `fewest_in_flight` reads
        (the most held of its least-held stage), so its blocks' and end layers' bytes add up to
        no more than the rank's peak."""
        return self.holding_terms(r, S)[self.holdings[r].index(least_held_moment(self.holdings[r]))]

    def least_block_bytes(self, r: int) -> float:
        """What rank r's blocks keep at its peak beyond `in_flight` times their bytes, at the least
        (`costmodel.in_flight.fewest_in_flight`): for the bounds."""
        return self.in_flight_extra[r] if self.in_flight_extra else 0.0

    def extra_bytes(self, r: int) -> float:
        """Rank r's memory at its peak besides states and saved activations (`rank_extra_bytes`)
        and its receive buffers."""
        return (self.extra[r] if self.extra else 0.0) + self.receive_bytes(r)

    def receive_bytes(self, r: int) -> float:
        """Rank r's receive buffers, there at each of its moments (`costmodel.in_flight.receive_buffers`)."""
        return self.receiving[r] if self.receiving else 0.0

    def after_backward_seconds(self, params: float, experts: float) -> float:
        """What follows a rank's backward unhidden (`costmodel.terms._assemble`), linear in its
        parameters: the optimizer step, ZeRO-1's all-gather of the dense weights, the experts' reduction."""
        return (params * self.optimizer_seconds_per_param + (params - experts) * self.gather_seconds_per_param
                + (experts * self.expert_seconds_per_param + self.expert_latency if experts else 0.0))

    def step_bytes(self, r: int, step_states: float) -> float:
        """Rank r's memory at its optimizer step (`costmodel.peak.peak_moments`'s stepping moment):
        activations gone, its layers' `step_states` and the temporaries of its largest weight."""
        return step_states + (self.step_fixed[r] if self.step_fixed else 0.0) + self.receive_bytes(r)

    def closing_fixed(self, fixed: list[LayerCoefficients], r: int) -> float:
        """Rank r's memory at a backward's end (`costmodel.peak.peak_moments`' closing moments)
        besides its blocks' `end_states + pile` each: its embedding and head layers' end states and
        piles, the larger of the largest backward-end bytes of those and its blocks (`backward_end_bytes`) and
        ZeRO-3's root unit then (`closing_extra`; the two never meet), and its receive buffers."""
        return (sum(l.end_states + l.pile for l in fixed)
                + max(self.closing_extra_bytes(r), *(l.cast_back for l in [*fixed, self.block]))
                + self.receive_bytes(r))

    def closing_extra_bytes(self, r: int) -> float:
        """ZeRO-3's root unit at rank r's backward end (`rank_peak.closing_extra_bytes`)."""
        return self.closing_extra[r] if self.closing_extra else 0.0

    def closes_above_states(self, r: int) -> bool:
        """Whether rank r's backward end holds more than its states (the solver's closing constraint)."""
        return bool(self.block.pile or self.closing_extra_bytes(r)
                    or any(l.cast_back for l in (self.block, *self.prefix, *self.suffix)))

    def rebuild_bytes(self, r: int) -> float:
        """What rank r's peak grows by once it fully recomputes a block (`rank_extra_bytes`)."""
        return self.rebuild[r] if self.rebuild else self.block.activation["none"]

    def stage_fill(self, s: int, S: int) -> float:
        """The sharded collectives of virtual stage s (of S) that one-layer prefetch cannot hide
        (`costmodel.data_parallel.prefetch_fill`), per micro-batch: its first layer is the
        embedding on stage 0 and a block elsewhere, its last the head on the last stage. Priced
        with unrecomputed blocks, the least a recomputed block can expose."""
        single, first, middle, last = self.fills
        return single if S == 1 else first if s == 0 else last if s == S - 1 else middle

    def end_layers(self, s: int, S: int) -> list[LayerCoefficients]:
        """The embedding's layers on virtual stage 0 and the head's on the last (of S)."""
        return (self.prefix if s == 0 else []) + (self.suffix if s == S - 1 else [])

    def stages_of(self, r: int, pp: int, S: int) -> list[int]:
        """The virtual stages (of S) pipeline rank r runs, where the schedule places them
        (`layout.axes.stage_rank`: looped, or in a V)."""
        return [s for s in range(S) if stage_rank(self.schedule, pp, s) == r]

    def sends(self, s: int, pp: int, S: int) -> bool:
        """Whether virtual stage s sends its output to another rank: not the last stage, nor the
        turn of a V (stages pp-1 and pp on one rank)."""
        return s < S - 1 and not hands_over_in_place(self.schedule, pp, s, S)


class LayerTimes:
    """`costmodel.compute.layer_time` memoised over one search: layouts that differ only in
    ZeRO, dp, hybrid sharding or the schedule share their layers' times (price repeated
    layers, and layouts, once)."""

    def __init__(self) -> None:
        self._memo: dict[tuple, LayerTime] = {}
        self._parts: dict[tuple, LayerParts] = {}  # what every policy of a layer shares
        self.layers: dict[tuple, LayerCoefficients] = {}  # `_layer`'s, by `layer_key`

    def __call__(self, layer: LayerProfile, ctx: Context, policy: str) -> LayerTime:
        # every field of the context (its seconds per weight element differ by accumulation and autocast), the
        # cluster by identity
        base = (id(layer), id(ctx.cluster), *(getattr(ctx, name) for name in _CONTEXT_FIELDS))
        key = (*base, policy)
        if key not in self._memo:
            if base not in self._parts:
                self._parts[base] = layer_parts(layer, ctx)
            self._memo[key] = layer_time(layer, ctx, policy, self._parts[base])
        return self._memo[key]


def layer_key(layer: LayerProfile, plan: Plan, cluster: Cluster) -> tuple:
    """What a layer's coefficients depend on: every field `_layer` reads, and not the schedule,
    vpp or the pipeline's depth beyond whether there is one (held_zero, gradients_at_peak), so
    the layouts that differ only there share them."""
    return (id(layer), id(cluster), plan.dtype, plan.tp, plan.sp, plan.tp_overlap, plan.micro_batch, plan.cp, plan.ep,
            plan.stack,
            plan.zero, plan.dp_shard, plan.dp, plan.pp > 1, plan.num_micro_batches == 1, plan.offload,
            plan.master_dtype, plan.optimizer_dtype, plan.reduce_dtype, plan.ddp_bucket_view,
            plan.num_micro_batches if plan.holds_unsharded_gradients or plan.copies_into_buckets else 0)


def _layer(layer: LayerProfile, plan: Plan, lay, times: LayerTimes, cluster: Cluster,
           tied: bool = False) -> LayerCoefficients:
    """`tied`: the model's head shares its embedding's weight on the rank (`tied_on_rank`)."""
    ctx = lay.ctx
    params = layer_params_on_rank(layer, plan.tp, plan.ep)
    states, step_states, end_states = _layer_states(params, layer.expert_params / plan.ep, plan, cluster,
                                                    shards=held_gradient_shards(layer, plan, tied))
    cast = cast_params_on_rank(layer, plan.tp, plan.ep)
    copies = autocast_copy_bytes(cast, plan)  # until the backward ends
    states, end_states = states + copies, end_states + copies
    time, backward, activation = {}, {}, {}
    collectives = sharded_collectives(params, plan, lay)  # the same under every policy
    kw = activation_keywords(plan, ctx.cp_kv_bytes, plan.dtype)
    for policy in POLICIES:
        t = times(layer, ctx, policy)
        zero = sharded_exposed(params, t, plan, lay, collectives)
        time[policy] = t.total + zero
        backward[policy] = t.backward + t.recompute
        activation[policy] = activation_bytes(layer, policy, **kw)
    return LayerCoefficients(time=time, backward=backward, activation=activation, params=params, states=states, end_states=end_states,
                             output=held_output_bytes(layer, pipelined=plan.pp > 1, **kw), step_states=step_states, expert_params=layer.expert_params / plan.ep,
                             weight_grad=times(layer, ctx, "none").weight_grad, pile=cast_gradient_pile_bytes(cast, plan),
                             cast_back=backward_end_bytes(layer, plan))


def _layer_states(params: float, expert_params: float, plan: Plan, cluster: Cluster,
                  shards: float = 1.0) -> tuple[float, float, float]:
    """A layer's states on the rank at the activation peak, at the optimizer step and at a
    backward's end (with autocast's copies, there until then), as
    `costmodel.peak.peak_moments` holds them (`device_states`: experts shard over fewer ranks;
    no gradients yet where `gradients_at_peak` says so; ZeRO-2's held 16-bit weights; DDP's bucket
    copies, `bucket_copy_bytes`); a gradient made whole over `shards` TP shards kept so, by `.grad`
    or FSDP2's held gradients (`held_gradient_shards`)."""
    whole = whole_gradient_params(plan, shards, params)
    device = device_states(params, expert_params, plan, cluster, whole)
    held = gathered_weights_held(params, plan, plan.dtype, cluster)
    gradients = held_gradient_bytes(params * shards, plan) or (
        device["gradients"] if gradients_at_peak(plan) else 0.0)
    dense = params - expert_params
    at_peak = sum(device.values()) - device["gradients"] + gradients + held + bucket_copy_bytes(dense, plan, stepping=False)
    temporaries = 0.0 if states_on_host(plan, cluster) else optimizer_step_bytes(
        params * owned_shares(plan)[0], 0.0, cluster.gpu.device_type, plan.stack, moment_bytes(plan))
    buckets = bucket_copy_bytes(dense, plan, stepping=True)
    stepped = sum(device_states(params, expert_params, plan, cluster, whole, stepping=True).values())
    ending = sum(device.values()) + buckets + (held if pipelined_fsdp(plan) else 0.0)
    return at_peak, stepped + buckets + temporaries, ending


def block_span(workload: Workload) -> tuple[int, int]:
    """Index of the first block and one past the last; the blocks must be one segment."""
    kinds = [layer.kind for layer in workload.layers]
    first = kinds.index("block")
    last = len(kinds) - kinds[::-1].index("block")
    return first, last


def single_block_profile(workload: Workload) -> bool:
    return sum(1 for seg in workload.segments if seg.layer.kind == "block") == 1


def stage_model_data(workload: Workload, plan: Plan, cluster: Cluster, capacity: float,
                     times: LayerTimes | None = None) -> StageModelData:
    """`plan` carries the layout (its stages are ignored); `times` shares layer prices across
    the layouts of one search."""
    times = times if times is not None else LayerTimes()
    workload = under_autocast(workload, plan)
    cluster = cluster.for_stack(plan.stack)
    lay = layout_of(plan, cluster, workload)
    first, last = block_span(workload)
    layers = workload.layers
    coeff, tied = {}, tied_on_rank(workload, plan)
    for layer in layers:
        if id(layer) not in coeff:
            key = layer_key(layer, plan, cluster)
            if key not in times.layers:
                times.layers[key] = _layer(layer, plan, lay, times, cluster, tied)
            coeff[id(layer)] = times.layers[key]
    block = coeff[id(layers[first])]
    # Collective times are concave in their size (the cheapest of affine protocol costs): their
    # latency (`dp_latency`) plus their least marginal cost per parameter, from a billion
    # parameters on, bound them from below at every size (a chord from zero would count the
    # latency again in the slope and overshoot beyond the probe).
    probe = 1e9
    fewest = [fewest_in_flight(plan.schedule, r, plan.pp, plan.vpp, plan.num_micro_batches) for r in range(plan.pp)]
    dp_slope = (dp_time(2 * probe, plan, lay) - dp_time(probe, plan, lay)) / probe
    data = StageModelData(
        block=block,
        prefix=[coeff[id(layer)] for layer in layers[:first]],
        suffix=[coeff[id(layer)] for layer in layers[last:]],
        n_blocks=last - first,
        p2p=p2p_time(layers[first], plan, lay) if plan.pp > 1 else 0.0,
        in_flight=[least[0] for least in fewest],
        in_flight_extra=tuple(least[1] * min(block.activation.values()) for least in fewest),
        dp_seconds_per_param=dp_slope,
        dp_latency=dp_time(1.0, plan, lay) if plan.dp > 1 else 0.0,
        optimizer_seconds_per_param=optimizer_seconds_per_param(plan, cluster),
        # ZeRO-1's weight all-gather follows the step as the optimizer does: linear in the rank's parameters
        gather_seconds_per_param=(weight_gather_time(2 * probe, plan, lay) - weight_gather_time(probe, plan, lay)) / probe,
        expert_seconds_per_param=(expert_reduction_time(2 * probe, plan, lay) - expert_reduction_time(probe, plan, lay)) / probe,
        expert_latency=expert_reduction_time(1.0, plan, lay),
        capacity=capacity,
        schedule=plan.schedule,
        core_sharing=max(1.0, cluster.node.oversubscription or 1.0) if plan.pp > 1 else 1.0,
        fills=_stage_fills(layers[0], layers[first], layers[-1], plan, lay, times),
        holdings=tuple(rank_holdings(plan.schedule, r, plan.pp, plan.vpp, plan.num_micro_batches) for r in range(plan.pp)),
    )
    caching = caches_blocks(cluster)
    extra, rebuild = rank_extra_bytes(layers[:first], layers[first], layers[last:], plan, block.activation["none"],
                                       caching)
    # every stage boundary carries a block's output or its gradient (the embedding's output is alike)
    boundary = receive_buffer_bytes(layers[first], **activation_keywords(plan, 0.0, plan.dtype))
    data = replace(data, extra=extra, rebuild=rebuild, receiving=_receiving(data, boundary, plan),
                   closing_extra=closing_extra_bytes(layers[:first], layers[first], layers[last:], plan, cluster, caching),
                   step_fixed=step_fixed_bytes(layers[:first], layers[first], layers[last:], plan, cluster, caching),
                   stage_input=boundary if plan.pp > 1 else 0.0)
    return replace(data, fixed=all_rank_fixed(data, plan.pp, plan.n_virtual_stages))


def _receiving(data: StageModelData, boundary: float, plan: Plan) -> tuple[float, ...]:
    """Per pipeline rank, its stages' receive buffers through the step (`receive_buffers`), each
    `boundary` bytes per micro-batch."""
    S = plan.n_virtual_stages
    per_stage = dict.fromkeys(range(S), boundary)
    return tuple(receive_buffers(data.stages_of(r, plan.pp, S), S, per_stage, per_stage, plan.num_micro_batches)
                 for r in range(plan.pp))


def with_crossing(data: StageModelData, crossing: list[float], vpp: int) -> StageModelData:
    """`data` for the ranks of a mixed pipeline split whose sends to other groups cost `crossing`
    (per pipeline rank)."""
    pp = len(crossing)
    data = replace(data, crossing=tuple(crossing))
    return replace(data, fixed=all_rank_fixed(data, pp, pp * vpp))


def fixed_per_rank(data: StageModelData, pp: int, vpp: int) -> tuple[RankFixed, ...]:
    """Each pipeline rank's `RankFixed`: the layout's own, computed once, or for another split."""
    if len(data.fixed) == pp:
        return data.fixed
    return all_rank_fixed(data, pp, pp * vpp)


def all_rank_fixed(data: StageModelData, pp: int, S: int) -> tuple[RankFixed, ...]:
    """`rank_fixed` of every rank; the ranks holding neither end nor a crossing send (every
    middle rank of a uniform layout) are alike, so one of them is priced for all."""
    out, middle = [], None
    for r in range(pp):
        plain = (r != 0 and r != stage_rank(data.schedule, pp, S - 1) and not (data.crossing and data.crossing[r])
                 and not (data.schedule in V_SCHEDULES and r == pp - 1))  # a V's turn sends one hop less
        if plain and middle is not None:
            out.append(middle)
            continue
        out.append(rank_fixed(data, r, pp, S))
        middle = out[-1] if plain else middle
    return tuple(out)


def rank_fixed(data: StageModelData, r: int, pp: int, S: int) -> RankFixed:
    stages = data.stages_of(r, pp, S)
    layers = [l for s in stages for l in data.end_layers(s, S)]
    crossing = data.crossing[r] if data.crossing else 0.0
    return RankFixed(time=sum(l.time["none"] for l in layers) + sum(data.p2p * data.sends(s, pp, S) + data.stage_fill(s, S)
                                                                   for s in stages)
                     + crossing,
                     saved=data.bound_holding(r, S)[1],
                     params=sum(l.params for l in layers),
                     states=sum(l.states for l in layers), step_states=sum(l.step_states for l in layers),
                     weight_grad=sum(l.weight_grad for l in layers),
                     closing=data.closing_fixed(layers, r))


def _stage_fills(embedding: LayerProfile, block: LayerProfile, head: LayerProfile, plan: Plan, lay,
                 times: LayerTimes) -> tuple:
    """`StageModelData.fills`: (single stage, first, middle, last)."""
    if not plan.gathers_weights:
        return (0.0, 0.0, 0.0, 0.0)

    def fill(a: LayerProfile, b: LayerProfile) -> float:
        runs = [(a, "none", 1), (b, "none", 1)]
        return prefetch_fill(runs, [(times(l, lay.ctx, "none"), 1) for l in (a, b)], plan, lay)

    return fill(embedding, head), fill(embedding, block), fill(block, block), fill(block, head)
