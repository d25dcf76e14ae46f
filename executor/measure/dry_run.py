"""Dry run: the executor's own appliers on fake tensors, at the plan's full world size.

Why: the cost model's memory is a formula; what a rank holds is what the
executor allocates. A dry run measures the second without a GPU. For one rank
of each distinct role (one per pipeline rank: dp, cp, tp and ep ranks of a
pipeline rank hold the same shapes), it

- starts torch's fake process group (`fake_pg`) at the plan's world size, as
  that rank, so every collective returns at once with outputs of the right shape;
- builds the model under `FakeTensorMode` (no storage is allocated: a 70B
  model builds in seconds) and runs `materialize_rank`, the same appliers in
  the same order as `parallax run`;
- replays one optimizer step under torch's memory trackers
  (`FSDPMemTracker` where FSDP2 holds the parameters, `MemTracker` otherwise),
  after one untimed step that creates the optimizer state.

A pipeline rank runs its own chunks in the order torch's schedule gives it
(`pipeline_replay`), fed from receive buffers held as torch's stages hold them. The step replays at most `replay_micro_batches`
micro-batches: past the pipeline's warm-up (and past the second micro-batch
without stages) every further micro-batch repeats a state already measured.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from layout.plan import Plan
from executor.measure.pipeline_replay import MicroBatch, replay_pipeline
from executor.measure.dry_run_trackers import OFFLOADED, AllocationTrace, CategoryPeaks, replay_allocator, tracker_for
from hardware.errors import PlanError



@dataclass
class RankMemory:
    """One measured rank: its peak and each category's own peak, beside the prediction."""

    rank: int
    pp_rank: int
    measured: dict[str, float]  # each category's own maximum ("host": an offloaded plan's states)
    measured_peak: float  # on the device
    at_peak: dict[str, float]  # each category at the moment of the peak
    predicted: dict[str, float]
    predicted_peak: float
    capacity: float
    predicted_host: float | None = None  # an offloaded plan's host bytes per GPU (the estimate's per node, shared)
    allocator: dict[str, float] = field(default_factory=dict)  # the allocation trace replayed: allocated, reserved
    runtime: dict[str, float] = field(default_factory=dict)  # the estimate's CUDA context, workspaces, NCCL buffers
    gpu_bytes: float | None = None  # the GPU's whole memory (None: a mixed cluster's, judged on capacity)
    predicted_reserved: float | None = None  # the estimate's max_memory_reserved with no memory pressure

    @property
    def error(self) -> float:
        return self.predicted_peak / self.measured_peak - 1 if self.measured_peak else math.nan

    @property
    def reserved(self) -> float | None:
        """The replayed allocator's reservation with expandable segments (as `parallax run` sets it:
        executor.runtime.mesh.ALLOCATOR_SETTINGS), on the device where its room is known (the cache
        given back under pressure), else with no memory pressure."""
        return self.allocator.get("reserved_on_device", self.allocator.get("reserved_expandable"))

    @property
    def device_total(self) -> float | None:
        """What the GPU would hold at the peak: the reservation and the runtime's memory."""
        return None if self.reserved is None else self.reserved + sum(self.runtime.values())

    @property
    def fits(self) -> bool:
        """Judged on device memory only (what an offloaded plan holds on the host is not the GPU's):
        by the allocator's replay on the device where it ran there (out of memory only when the live
        tensors do not fit once the cache is given back), else the tensors' peak against the plan's
        usable memory."""
        if "out_of_memory" in self.allocator:
            return not self.allocator["out_of_memory"]
        if self.device_total is not None and self.gpu_bytes is not None:
            return self.device_total <= self.gpu_bytes
        return self.measured_peak <= self.capacity


@dataclass
class DryRun:
    plan: Plan
    ranks: list[RankMemory]
    replayed_micro_batches: int
    notes: list[str] = field(default_factory=list)

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.measured_peak)


def replay_micro_batches(plan: Plan) -> int:
    """Micro-batches replayed: every state of the step appears by then (the accumulation
    transient from the second; a pipeline's deepest warm-up within 3*pp, a multiple of pp
    as the interleaved schedule wants)."""
    m = plan.num_micro_batches
    return min(m, 2) if plan.pp == 1 else min(m, 3 * plan.pp)


def roles(plan: Plan) -> list[int]:
    """Pipeline ranks to measure: all of them up to 4, else the first, the last and the one
    the estimate says peaks highest."""
    if plan.pp <= 4:
        return list(range(plan.pp))
    predicted = [_predicted_stage(plan, r) for r in range(plan.pp)]
    worst = max(range(plan.pp), key=lambda r: sum(predicted[r].values()))
    return sorted({0, plan.pp - 1, worst})


def _predicted_stage(plan: Plan, pp_rank: int) -> dict[str, float]:
    stage = next(s for s in plan.estimate.stages if plan.stage_rank(s.index) == pp_rank)
    return dict(stage.memory_bytes)


def _predicted_reserved(plan: Plan, pp_rank: int) -> float | None:
    return next(s for s in plan.estimate.stages if plan.stage_rank(s.index) == pp_rank).reserved_bytes


def with_estimate(plan: Plan, model_name: str, cluster=None, trust_module: bool = False) -> Plan:
    """`plan` with a fresh estimate, priced through the run report's door (`executor.runtime.predict`)."""
    from executor.runtime.predict import estimate_of

    return plan.model_copy(update={"estimate": estimate_of(plan, model_name, cluster, trust_module)})


def dry_run(plan: Plan, model_name: str | None = None, *, cluster=None, pp_ranks: list[int] | None = None,
            trust_module: bool = False) -> DryRun:
    """Measure `plan` on fake tensors, one rank per pipeline role, beside its estimate
    (on `cluster`, default the plan's own hardware); a module factory is built only with `trust_module`."""
    name = model_name or plan.model
    build_model_check(name, trust_module)
    if plan.reduces_through_ddp:
        raise PlanError("zero", f"the dry run cannot follow DDP (zero={plan.zero} over plain replicas): its C++ "
                                "reducer allocates real gradient buckets and fails on the fake process group",
                        "dry-run the layout with zero 1 (no DDP), 2 or 3 (FSDP2), or measure it with `parallax run`")
    plan = with_estimate(plan, name, cluster, trust_module)
    replay = replay_micro_batches(plan)
    short = _shortened(plan, replay)
    out = []
    for pp_rank in pp_ranks if pp_ranks is not None else roles(plan):
        rank = pp_rank * plan.data_parallel * plan.tp  # (pp, dp, tp) mesh, row-major
        measured = _measure_isolated(short, name, rank, trust_module, _device_room(plan, cluster),
                                     plan.num_micro_batches)
        predicted, reserved = _predicted_stage(plan, pp_rank), _predicted_reserved(plan, pp_rank)
        out.append(RankMemory(rank=rank, pp_rank=pp_rank, measured=measured.categories, measured_peak=measured.peak,
                              at_peak=measured.at_peak, allocator=measured.allocator,
                              runtime=dict(plan.estimate.runtime_memory_bytes), gpu_bytes=_gpu_bytes(plan, cluster),
                              predicted=predicted, predicted_peak=sum(predicted.values()),
                              capacity=capacity_of(plan, pp_rank), predicted_host=_host_per_gpu(plan, cluster),
                              predicted_reserved=reserved))
    notes = [] if replay == plan.num_micro_batches else [
        f"replayed {replay} of {plan.num_micro_batches} micro-batches: later ones repeat states already measured"]
    if plan.offload:
        notes.append("offload: the sharded weights, gradients and AdamW state are the host's (the host row), "
                     "outside the device peak that is judged against the GPU")
    return DryRun(plan, out, replay, notes)


def _gpu_bytes(plan: Plan, cluster) -> float | None:
    """The whole memory of the plan's GPU (None for a mixed cluster: each group has its own)."""
    if plan.groups:
        return None
    return (cluster or plan.cluster()).gpu.hbm_gb * 2**30


def _device_room(plan: Plan, cluster) -> float | None:
    """What the caching allocator can take from the GPU: its memory less the runtime's (the CUDA
    context, workspaces, NCCL buffers), which torch's allocator never sees."""
    gpu = _gpu_bytes(plan, cluster)
    return None if gpu is None else gpu - sum(plan.estimate.runtime_memory_bytes.values())


def _host_per_gpu(plan: Plan, cluster) -> float | None:
    """The estimate's host memory per node, shared by the node's GPUs (uniform offloaded plans)."""
    if not plan.offload or plan.groups or not plan.estimate.host_memory_bytes:
        return None
    return plan.estimate.host_memory_bytes / (cluster or plan.cluster()).node.gpus_per_node


def capacity_of(plan: Plan, pp_rank: int) -> float:
    """Usable memory of pipeline rank `pp_rank`'s GPUs: its own group's on a mixed cluster (the
    smallest of the groups holding it), the plan's GPU's otherwise."""
    groups = [g for g in plan.estimate.groups if pp_rank in g.stages]
    return min(g.memory_capacity_bytes for g in groups) if groups else plan.estimate.memory_capacity_bytes


def build_model_check(name: str, trust_module: bool = False) -> None:
    """Fail on an unknown or untrusted model before any process group starts (one line, not a traceback)."""
    from executor.runtime.models import _builder

    _builder(name, trust_module)


def _shortened(plan: Plan, micro_batches: int) -> Plan:
    """The plan with its step cut to `micro_batches` micro-batches (same micro-batch size)."""
    if micro_batches == plan.num_micro_batches:
        return plan
    per_micro_batch = plan.global_batch // plan.num_micro_batches
    return plan.model_copy(update={"global_batch": per_micro_batch * micro_batches})


def _measure_isolated(plan: Plan, name: str, rank: int, trust_module: bool = False,
                      room: float | None = None, receiving: int | None = None) -> CategoryPeaks:
    """`_measure_rank`, in a fresh process where the plan has TP and pipeline roles: torch's
    DTensor keeps sub-meshes of an earlier process group (by equal mesh) that a re-initialised
    fake world no longer knows."""
    if plan.pp == 1 or plan.tp == 1:
        return _measure_rank(plan, name, rank, trust_module, room, receiving)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_measure_rank, plan, name, rank, trust_module, room, receiving).result()


def _measure_rank(plan: Plan, name: str, rank: int, trust_module: bool = False,
                  room: float | None = None, receiving: int | None = None) -> CategoryPeaks:
    """`plan`'s step on one rank; a pipeline's stages allocate receive buffers for `receiving`
    micro-batches (the whole step's, where `plan` replays fewer; `pipeline_replay`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from executor.apply.materialize import materialize_rank
    from executor.runtime.mesh import build_mesh
    from executor.runtime.models import build_model
    from planner.trace.hf import masks_as_in_a_real_run

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.n_gpus)
    try:
        mesh = build_mesh(plan)  # outside the fake mode: the mesh's own tensors are real
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            model = build_model(name, trust_module=trust_module)
        hidden = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding)).embedding_dim
        # Outside the mode the fake parameters still compute fake, while the meshes FSDP2 builds
        # over TP (DeviceMesh._concatenate) stay real tensors, as they must.
        with _torch_quiet():
            run = materialize_rank(plan, model, mesh)
        host = OFFLOADED if plan.offload else ()
        peaks, trace = CategoryPeaks(host), AllocationTrace(host)
        with fake, masks_as_in_a_real_run():  # HF builds no causal mask in a real run of unpadded sequences
            _create_optimizer_state(run)  # before tracking: the trackers take existing state as optimizer state
            with tracker_for(run, peaks, trace):
                _replay_step(run, plan, hidden, receiving or plan.num_micro_batches)
        replay_allocator(peaks, trace, room)
        return peaks
    finally:
        dist.destroy_process_group()


def _create_optimizer_state(run) -> None:
    """One step on zero gradients: AdamW allocates its state lazily, at the first step."""
    for module in run.modules:
        for p in module.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)


# What torch says of its own fake tensors here (deep-copying a fake module for a second
# pipeline chunk reads a FakeTensor's data pointer; the module tracker loses a chunk's parent
# between its forward and the backward a schedule runs much later): about torch, never the
# user's model, so not passed on as notes.
TORCH_NOISE = ("Accessing the data pointer of FakeTensor", "The module hierarchy tracking")


@contextlib.contextmanager
def _torch_quiet():
    with warnings.catch_warnings():
        for noise in TORCH_NOISE:
            warnings.filterwarnings("ignore", message=noise)
        yield


def _replay_step(run, plan: Plan, hidden: int, receiving: int) -> None:
    from executor.runtime.train import _plain_step, step_context

    rows = plan.global_batch // plan.dp
    tokens = torch.zeros(rows, plan.seq_len // plan.cp, dtype=torch.long)
    with step_context(plan, run.device), _torch_quiet():
        if run.schedule is None:
            _plain_step(run, plan, tokens, tokens, call=lambda module, x: MicroBatch(module)(x))
        else:
            replay_pipeline(run, plan, tokens, hidden, receiving)
    run.sync_gradients()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
