"""What one forward or backward of one virtual stage costs, laid out in time.

Every micro-batch of a stage runs the same layers, so each (stage, phase) is
priced once into an `OpTemplate`: segment offsets relative to the op's start,
when each layer finishes (gradient buckets become ready then), and the
activation bytes the op adds or frees. Costs come from the analytic model's
own per-layer terms (`compute.layer_time`, `compute.forward_collectives`,
`collectives.*`), so the simulator and `estimate` disagree only where the
*timing* differs, never the prices.

Inside an op, each layer computes and then runs its TP collectives on the
critical path (merged into one segment per layer). Under ZeRO-3 each layer's
weights are all-gathered over the data-parallel group before it runs, the
next layer's gather is prefetched while it computes (one layer ahead, as
DeepSpeed's default prefetch bucket allows), and in backward its gradient is
reduce-scattered right after; the op lasts until both streams are done.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import collectives as coll
from ..compression import reduction_element_bytes
from ..compute import LayerTime, forward_collectives, layer_time
from ..data_parallel import fsdp_serial_copies, layer_params_on_rank, sharded_collectives
from ..layout import Layout
from ..in_flight import held_output_bytes
from ..memory import activation_bytes, activation_keywords, reduce_bytes
from ..peak import stage_input_bytes
from layout.plan import Plan
from ..workload import LayerProfile, Workload

DEFAULT_BUCKET_BYTES = 25e6  # PyTorch DDP's default gradient bucket


@dataclass(frozen=True)
class Segment:
    stream: str  # "compute", "intra" or "inter"
    kind: str  # "tp" | "zero_gather" | "zero_scatter"
    name: str
    offset: float
    duration: float


@dataclass(frozen=True)
class OpTemplate:
    duration: float  # compute-stream occupancy
    compute: float
    recompute: float
    tp_comm: float
    zero_wait: float  # time the op stalls on ZeRO-3 gathers/scatters
    segments: tuple[Segment, ...]
    layer_done: tuple[float, ...]  # offset at which each layer (stage order) finishes this phase
    comm_tail: float  # offset at which the op's own comm (ZeRO-3) ends


@dataclass(frozen=True)
class Bucket:
    stage: int
    layers: tuple[int, int]  # [first, last) layer indices (workload order)
    ready_offset: float  # offset in the stage's last backward when its grads are final
    grad_bytes: float  # bytes on the wire


def stream_for(group: coll.Group) -> str:
    return "intra" if group.nodes == 1 else "inter"


class Pricer:
    """Prices layers once per (layer object, policy) and stages once per phase."""

    def __init__(self, plan: Plan, workload: Workload, lay: Layout):
        self.plan, self.workload, self.lay = plan, workload, lay
        self._layers: dict[tuple[int, str], tuple[LayerTime, float, float]] = {}
        self.tp_stream = stream_for(lay.ctx.tp_group)
        self.dp_stream = stream_for(lay.dp_group if plan.zero < 2 else lay.shard_group)
        self.pp_stream = "inter" if lay.pp_inter_node else "intra"

    def layer(self, layer: LayerProfile, policy: str) -> tuple[LayerTime, float, tuple[float, float, float]]:
        """(LayerTime, forward TP comm, ZeRO-2/3 (forward gather, backward gather, reduce-scatter) seconds)."""
        key = (id(layer), policy)
        if key not in self._layers:
            lt = layer_time(layer, self.lay.ctx, policy)
            fwd_comm = forward_collectives(layer, self.lay.ctx)
            params = layer_params_on_rank(layer, self.plan.tp, self.plan.ep)
            sharded = sharded_collectives(params, self.plan, self.lay)
            forward, backward = fsdp_serial_copies(params, self.plan, self.lay.ctx.cluster)  # on the compute stream
            lt = LayerTime(lt.forward + forward, lt.backward + backward, lt.recompute, lt.tp_comm, lt.weight_grad)
            self._layers[key] = (lt, fwd_comm, sharded)
        return self._layers[key]

    def stage_layers(self, index: int) -> list[tuple[int, LayerProfile, str]]:
        stage = self.plan.stages[index]
        idx = range(stage.start, stage.end)
        return [(i, self.workload.layers[i], p) for i, p in zip(idx, stage.recompute)]

    def template(self, index: int, phase: str) -> OpTemplate:
        """Lay out one op: per layer compute then TP comm, ZeRO-3 comm with one-layer prefetch."""
        rows = self.stage_layers(index)
        if phase != "F":
            rows = rows[::-1]
        split = self.plan.splits_backward  # the backward as input gradients (B), then weights' (W)
        work, gathers, scatters, comp, recomp = [], [], [], 0.0, 0.0
        for _, layer, policy in rows:
            lt, fwd_comm, (fwd_gather, bwd_gather, scatter) = self.layer(layer, policy)
            if phase == "F":
                c, t = lt.forward, fwd_comm
            elif phase == "W":
                c, t, fwd_gather, bwd_gather, scatter = lt.weight_grad, 0.0, 0.0, 0.0, 0.0
            else:
                c, t = lt.backward - (lt.weight_grad if split else 0.0) + lt.recompute, lt.tp_comm - fwd_comm
                recomp += lt.recompute
            comp += c
            work.append((c, t))
            gathers.append(fwd_gather if phase == "F" else bwd_gather)
            scatters.append(scatter if phase != "F" else 0.0)
        return _lay_out(rows, work, gathers, scatters, comp - recomp, recomp, phase, self)


def _lay_out(rows, work, gathers, scatters, compute, recompute, phase, pricer) -> OpTemplate:
    """Two streams, compute and the DP link: gather k+1 may start once layer k starts."""
    segments: list[Segment] = []
    n = len(rows)
    comm_free = gathers[0]
    gather_end = [0.0] * n
    gather_end[0] = gathers[0]
    if gathers[0]:
        segments.append(Segment(pricer.dp_stream, "zero_gather", f"gather L{rows[0][0]}", 0.0, gathers[0]))
    comp_free, done, tp_total = 0.0, [0.0] * n, 0.0
    for k, (i, _, _) in enumerate(rows):
        c, t = work[k]
        start = max(comp_free, gather_end[k])
        if k + 1 < n and gathers[k + 1]:
            g0 = max(comm_free, start)
            gather_end[k + 1] = comm_free = g0 + gathers[k + 1]
            segments.append(Segment(pricer.dp_stream, "zero_gather", f"gather L{rows[k + 1][0]}", g0, gathers[k + 1]))
        if t:
            segments.append(Segment(pricer.tp_stream, "tp", f"tp {phase} L{i}", start + c, t))
        comp_free = start + c + t
        tp_total += t
        done[k] = comp_free
        if scatters[k]:
            s0 = max(comm_free, comp_free)
            comm_free = s0 + scatters[k]
            segments.append(Segment(pricer.dp_stream, "zero_scatter", f"reduce-scatter L{i}", s0, scatters[k]))
    duration = max(comp_free, comm_free)
    if phase != "F":
        done = done[::-1]
    busy = compute + recompute + tp_total
    return OpTemplate(duration=duration, compute=compute, recompute=recompute, tp_comm=tp_total,
                      zero_wait=max(0.0, duration - busy), segments=tuple(segments),
                      layer_done=tuple(done), comm_tail=comm_free)


def stage_activation(plan: Plan, pricer: Pricer, index: int) -> float:
    """Bytes one in-flight micro-batch of virtual stage `index` keeps until its backward, the
    head's logits in the forward cache with them (freed with its activations here, at its input
    gradients' step under a split backward in the executor)."""
    kw = activation_keywords(plan, pricer.lay.ctx.cp_kv_bytes, plan.dtype)
    kept = sum(activation_bytes(layer, policy, **kw) + held_output_bytes(layer, pipelined=plan.pp > 1, **kw)
               for _, layer, policy in pricer.stage_layers(index))
    return max(0.0, kept - stage_input_bytes(plan, pricer.workload, index))  # its input: a receive buffer, held all step


def p2p_seconds(plan: Plan, workload: Workload, lay: Layout, boundary_layer: int) -> float:
    """One-way send of the activation (or its gradient) at a stage boundary, one micro-batch,
    over the links of `lay`."""
    layer = workload.layers[boundary_layer]
    nbytes = layer.boundary_bytes * plan.micro_batch_per_rank / plan.tp
    return coll.point_to_point(nbytes, lay.ctx.cluster, inter_node=lay.pp_inter_node)


def buckets(plan: Plan, pricer: Pricer, index: int, template: OpTemplate, bucket_bytes: float) -> list[Bucket]:
    """Group a stage's gradients (last layer first, as backward produces them) into ~bucket_bytes buckets."""
    wire = reduction_element_bytes(plan)
    grad_size = reduce_bytes(plan)
    stage = plan.stages[index]
    out, first, grads, params = [], stage.end, 0.0, 0.0
    for i in range(stage.end - 1, stage.start - 1, -1):
        layer = pricer.workload.layers[i]
        p = layer_params_on_rank(layer, plan.tp, plan.ep) - layer.expert_params / plan.ep  # dense; experts: _tail
        grads += p * grad_size
        params += p
        if grads >= bucket_bytes or i == stage.start:
            if params > 0:
                out.append(Bucket(index, (i, first), template.layer_done[i - stage.start], params * wire))
            first, grads, params = i, 0.0, 0.0
    return out
