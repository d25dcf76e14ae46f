"""The layouts a search builds: in order of their floor, each into an entry (its uniform
template, stage-model coefficients and cheap bound) only while its floor could beat the
best uniform plans found so far (`_Frontier`), and each entry whose bound could beat them
priced uniform with the linear stage model (`rank_uniform`). A layout whose average
rank's states and leanest activations overflow one GPU is dropped before it is built.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from costmodel.accumulation import held_zero
from costmodel.data_parallel import layer_params_on_rank
from costmodel.layout import kv_bytes_per_sequence
from costmodel.in_flight import fewest_in_flight
from costmodel.memory import (activation_bytes, activation_keywords, layout_state_bytes,
                              model_state_bytes)
from costmodel.offload import states_on_host
from costmodel.device_states import gathered_weights_held, pipelined_fsdp
from costmodel.peak import gradients_held
from costmodel.terms import usable_memory_bytes
from costmodel.workload import Workload
from hardware.schema import Cluster
from layout.axes import RECOMPUTE
from layout.layout import Layout
from layout.plan import Plan

from planner.search.bounds import lower_bound
from planner.search.coefficients import LayerTimes, StageModelData, block_span, stage_model_data
from planner.search.linear_model import least_recompute_counts, linear_step
from planner.search.floor import Floors
from planner.search.space import layouts, recompute_choices, to_plan


@dataclass
class Entry:
    layout: Layout
    template: Plan
    data: StageModelData
    bound: float
    uniform_best: float = float("inf")
    promise: float = float("inf")  # linear time of the better of uniform and greedy mixed checkpointing
    uniform_policy: str = "full"
    proven: float | None = None
    tightened: bool = False  # the memory-aware bound has replaced the cheap one
    split: list[dict[str, int]] | None = None  # the bottleneck bound's split, rounded to whole blocks
    solved: bool = False  # CP-SAT has run on it (`branch_and_bound.refine`)


def all_entries(workload, cluster, global_batch, fixed, dtype, model, memory_reserve, dropped: list | None = None,
                deadline: float = float("inf")) -> tuple[list[Entry], bool]:
    """Every layout with its coefficients and cheap bound, lowest bound first, and whether the
    enumeration finished before `deadline` (a perf_counter time); the layouts whose states
    and leanest activations overflow are counted in `dropped` instead. (The search builds
    only the layouts whose floor could beat its best: `Frontier`; the tests build them all.)"""
    build = EntryBuilder(workload, cluster, global_batch, dtype, model, memory_reserve)
    entries = []
    for layout in layouts(workload, cluster, global_batch, fixed):
        if time.perf_counter() > deadline:
            entries.sort(key=lambda e: e.bound)
            return entries, False
        entry = build(layout)
        if entry is None and dropped is not None:
            dropped.append(layout)
        elif entry is not None:
            entries.append(entry)
    entries.sort(key=lambda e: e.bound)
    return entries, True


class EntryBuilder:
    """A layout's `Entry` (its uniform template, coefficients and cheap bound), or None where
    its states and leanest activations overflow; layer prices shared across the layouts of
    one search."""

    def __init__(self, workload, cluster, global_batch, dtype, model, memory_reserve) -> None:
        self.workload, self.cluster, self.global_batch, self.dtype = workload, cluster, global_batch, dtype
        self.model, self.memory_reserve = model or workload.name, memory_reserve
        self.times, self.per_rank = LayerTimes(), {}
        self.capacity = usable_memory_bytes(cluster, memory_reserve)  # every layout's bound: its own is smaller

    def __call__(self, layout: Layout) -> Entry | None:
        workload, cluster = self.workload, self.cluster
        if _states_overflow(workload, layout, self.dtype, self.capacity, self.per_rank, cluster, self.global_batch):
            return None
        template = to_plan(layout, workload, cluster, global_batch=self.global_batch, dtype=self.dtype, recompute="none",
                           model=self.model, shared_stages=True)
        room = usable_memory_bytes(cluster, self.memory_reserve, template, workload)  # this layout's communicators
        data = stage_model_data(workload, template, cluster, room, self.times)
        return Entry(layout, template, data, lower_bound(data, layout.pp, layout.vpp, template.num_micro_batches))


class Frontier:
    """The layouts in order of their floor (`floor.Floors`), built into entries only while
    their floor is below a threshold the search lowers as it finds plans: the rest are
    bounded by the lowest floor left. Each entry built whose bound is below the threshold is
    priced uniform (`rank_uniform`), and its best time may lower the threshold (`kth_uniform`)."""

    def __init__(self, workload, cluster, request_fixed, build: EntryBuilder, top_k: int, deadline: float) -> None:
        floors = Floors(workload, cluster, build.dtype, build.global_batch, build.times)
        self.workload, self.fixed, self.build, self.top_k = workload, request_fixed, build, top_k
        self.pending, self.complete = [], True
        for layout in layouts(workload, cluster, build.global_batch, request_fixed):
            if time.perf_counter() > deadline:
                self.complete = False
                break
            self.pending.append((floors.floor(layout), layout))
        self.pending.sort(key=lambda item: item[0])
        self.entries: list[Entry] = []
        self.dropped = 0
        self.uniform: list[float] = []  # the linear model's best uniform time of each priced layout
        self._next = 0

    def grow(self, threshold, deadline: float) -> None:
        """Build the layouts whose floor is below `threshold()`, until `deadline` once one
        layout has a fitting uniform plan (a search never ends empty-handed for want of time
        while a layout is left that might fit)."""
        while self._next < len(self.pending) and self.pending[self._next][0] < threshold():
            if time.perf_counter() > deadline and min(self.uniform, default=float("inf")) < float("inf"):
                return
            entry = self.build(self.pending[self._next][1])
            self._next += 1
            if entry is None:
                self.dropped += 1
                continue
            self.entries.append(entry)
            if entry.bound < threshold():
                rank_uniform(self.workload, [entry], self.fixed)
                self.uniform.append(entry.uniform_best)

    def kth_uniform(self) -> float:
        """The k-th best layout's uniform time so far (inf until k layouts have a fitting one)."""
        times = sorted(self.uniform)
        return times[self.top_k - 1] if len(times) >= self.top_k else float("inf")

    def floor_left(self) -> float:
        """What every layout not built could reach at best."""
        return self.pending[self._next][0] if self._next < len(self.pending) else float("inf")

    @property
    def considered(self) -> int:
        return len(self.pending)


def _states_overflow(workload: Workload, layout: Layout, dtype: str, capacity: float, per_rank: dict,
                     cluster: Cluster, global_batch: int) -> bool:
    """Whether no split of the layout's blocks fits, judged on their weights, optimizer states and
    held gradients and their activations at the leanest policy (`fewest_in_flight`: what no split
    among a rank's stages holds less of; experts priced at the dense per-parameter figure, which
    shards over more ranks): either the average pipeline rank overflows one GPU (the fullest
    holds at least the average), or the blocks each rank could take before it overflows fall
    short of the model's. Such a layout's bound is inf, so it is dropped before its coefficients
    are built. Offloaded states are on the host."""
    state = _state_bytes_per_param(layout, dtype, cluster, global_batch)
    params, block_params = _params_on_rank(workload, layout, per_rank)
    activations = _leanest_activations(workload, layout, dtype, per_rank)
    m = global_batch // (layout.dp * layout.micro_batch)
    least = [fewest_in_flight(layout.schedule, r, layout.pp, layout.vpp, m) for r in range(layout.pp)]
    leanest = activations / workload.n_blocks
    average = (params * state + activations * min(c for c, _ in least) + leanest * sum(e for _, e in least)) / layout.pp
    per_block = block_params / workload.n_blocks * state
    takes = sum(max(0.0, (capacity - e * leanest) / max(per_block + c * leanest, 1e-30)) for c, e in least)
    return average > capacity or takes < workload.n_blocks


def _state_bytes_per_param(layout: Layout, dtype: str, cluster: Cluster, global_batch: int) -> float:
    """A parameter's bytes on its rank at the peak: weights, optimizer states, gradients where the
    peak holds them (at most sharded: pipelined FSDP2 holds them whole), the gathered 16-bit copy
    FSDP2 holds (`costmodel.device_states.gathered_weights_held`: ZeRO-2's, a pipelined stage's)."""
    if states_on_host(layout, cluster):
        return 0.0
    shard, per_param = layout.shard_degree, layout_state_bytes(layout, dtype)
    states = model_state_bytes(1.0, dtype, held_zero(layout), shard, layout.stack, per_param)
    if pipelined_fsdp(layout):  # the master weights stay sharded
        states["weights"] = model_state_bytes(1.0, dtype, layout.zero, shard, layout.stack, per_param)["weights"]
    held = gradients_held(layout, global_batch // (layout.dp * layout.micro_batch))
    return (states["weights"] + states["optimizer"] + (states["gradients"] if held else 0.0)
            + gathered_weights_held(1.0, layout, dtype, cluster))


def _params_on_rank(workload: Workload, layout: Layout, per_rank: dict) -> tuple[float, float]:
    """Every layer's parameters on a TP (and EP) rank, and the blocks' alone."""
    key = (layout.tp, layout.ep)
    if key not in per_rank:
        per_rank[key] = tuple(sum(layer_params_on_rank(s.layer, layout.tp, layout.ep) * s.count for s in workload.segments
                                  if blocks is None or s.layer.kind == "block") for blocks in (None, True))
    return per_rank[key]


def _leanest_activations(workload: Workload, layout: Layout, dtype: str, per_rank: dict) -> float:
    """The blocks' activations per micro-batch at the leanest policy, summed over the model."""
    key = ("activations", layout.tp, layout.sp, layout.micro_batch, layout.cp, layout.stack, dtype)
    if key not in per_rank:
        keywords = activation_keywords(layout, kv_bytes_per_sequence(workload), dtype)
        per_rank[key] = sum(min(activation_bytes(s.layer, p, **keywords) for p in RECOMPUTE) * s.count
                            for s in workload.segments if s.layer.kind == "block")
    return per_rank[key]


def rank_uniform(workload: Workload, entries: list[Entry], fixed: dict) -> list[Entry]:
    """Price every layout's uniform plans, and its greedy least-recompute mix,
    with the linear stage model (exactly the estimator's composition, without
    building plans)."""
    first, last = block_span(workload)
    for entry in entries:
        allowed = recompute_choices(fixed, entry.layout)
        blocks = [min(st.end, last) - max(st.start, first) for st in entry.template.stages]
        lay, m = entry.layout, entry.template.num_micro_batches
        for policy in allowed:
            step, headroom = linear_step(entry.data, [{policy: b} for b in blocks], lay.pp, lay.vpp, m)
            if headroom >= 0 and step < entry.uniform_best:
                entry.uniform_best, entry.uniform_policy = step, policy
        greedy = least_recompute_counts(entry.data, blocks, lay.pp, allowed)
        if greedy is not None:
            entry.promise = min(entry.uniform_best, linear_step(entry.data, greedy, lay.pp, lay.vpp, m)[0])
    return entries
