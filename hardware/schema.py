"""Validated hardware profiles: a GPU, the node it sits in, and the cluster.

Profiles are data. Every numeric field of a catalog entry carries a source
(datasheet, paper, or `calibrate` run) in the model's `sources` mapping, and
validation refuses a profile whose numbers are not all sourced. The cost model
reads only these objects, never the machine it runs on.
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hardware.errors import HardwareError
from hardware.limits import MAX_GPUS
from hardware.untrusted import SafeName

Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8", "int8"]  # int8: tera-operations/s, served W8A8 GEMMs
Stack = Literal["eager", "compile", "fused"]  # the kernel stack a plan is priced for (layout.axes: the stack axis)


class _Sourced(BaseModel):
    """Base for models whose numeric fields must each name their source."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    sources: dict[str, str] = Field(default_factory=dict)
    # Fields the user states (counts, names), which need no citation.
    unsourced_fields: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="after")
    def _every_number_has_a_source(self):
        missing = [
            name
            for name, info in type(self).model_fields.items()
            if name != "sources" and name not in self.unsourced_fields
            and isinstance(getattr(self, name), (int, float, dict))
            and not isinstance(getattr(self, name), bool)
            and getattr(self, name) not in (None, {})
            and name not in self.sources
        ]
        if missing:
            raise ValueError(f"no source given for {', '.join(missing)}; add them under 'sources'")
        return self


COMPUTE_EFFICIENCIES = ("matmul_max", "matmul_half_dim", "attention", "fused_attention", "memory_bound",
                        "fp8_matmul_max", "optimizer")


# torch.compile runs eager's cuBLAS GEMMs and attention kernels and fuses the pointwise ops
# between them (priced as traffic, costmodel.compute.elementwise_traffic): without a fit of
# its own it takes eager's efficiencies.
STACK_FALLBACK = {"compile": ("eager",)}


class StackEfficiency(_Sourced):
    """One kernel stack's own compute efficiencies on a GPU, fitted on published runs of that
    stack: the same GEMM shapes reach a different share of peak through cuBLAS under eager
    autocast (a cast kernel per weight, no epilogue fusion, a launch per op) than through
    Transformer Engine's fused kernels. Links are not the stack's, so they are not here. A field
    left out keeps the GPU's base value."""

    matmul_max: float | None = Field(default=None, gt=0, le=1)
    matmul_half_dim: float | None = Field(default=None, ge=0)
    attention: float | None = Field(default=None, gt=0, le=1)
    fused_attention: float | None = Field(default=None, gt=0, le=1)
    memory_bound: float | None = Field(default=None, gt=0, le=1)
    fp8_matmul_max: float | None = Field(default=None, gt=0, le=1)
    optimizer: float | None = Field(default=None, gt=0, le=1)


class Efficiency(_Sourced):
    """Achievable fractions of peak, calibrated per GPU type.

    A matmul whose smallest dimension is `d` runs at
    `matmul_max * d / (d + matmul_half_dim)` of peak: small, TP-split GEMMs
    under-fill the streaming multiprocessors. The base values are one stack's (the
    catalog says which in their sources); `stacks` holds the others' compute
    efficiencies, and `for_stack` gives the set a plan's stack is priced with.
    """

    unsourced_fields: ClassVar[frozenset[str]] = frozenset({"stacks"})

    matmul_max: float = Field(gt=0, le=1)
    matmul_half_dim: float = Field(ge=0)
    attention: float = Field(gt=0, le=1)
    memory_bound: float = Field(gt=0, le=1)
    intra_node_bw: float = Field(gt=0, le=1)
    inter_node_bw: float = Field(gt=0, le=1)
    fp8_matmul_max: float | None = Field(
        default=None, gt=0, le=1, description="matmul_max of FP8 GEMMs, a fraction of the FP8 peak (None: matmul_max)")
    fused_attention: float | None = Field(
        default=None, gt=0, le=1,
        description="attention core speed where the scores are never materialised (a fused flash kernel), "
                    "a fraction of peak (None: `attention`, the unfused core's)")
    optimizer: float | None = Field(
        default=None, gt=0, le=1,
        description="optimizer step speed / the fused memory-bound estimate (None: fused, 1)")
    comm_overlap: float | None = Field(
        default=None, ge=0, le=1,
        description="fraction of a collective's time that hides behind concurrent compute (None: 1, "
                    "collectives on their own engines; near 0 where they need the cores the compute uses)")
    stacks: dict[Stack, StackEfficiency] = Field(
        default_factory=dict, description="other kernel stacks' compute efficiencies (see StackEfficiency)")
    priced_stack: Stack | None = Field(
        default=None, description="set by for_stack: the stack these values are already priced for")

    def for_stack(self, stack: str) -> "Efficiency":
        """These efficiencies as `stack` runs: its own fitted values over the base ones."""
        if self.priced_stack == stack:
            return self
        if self.priced_stack is not None:
            raise ValueError(f"efficiencies already priced for the {self.priced_stack} stack, not {stack}")
        values, sources = {}, dict(self.sources)
        for name in (*STACK_FALLBACK.get(stack, ()), stack):
            own = self.stacks.get(name)
            mine = {} if own is None else {k: getattr(own, k) for k in COMPUTE_EFFICIENCIES if getattr(own, k) is not None}
            values.update(mine)
            sources.update({k: f"{name} stack: {own.sources[k]}" for k in mine})
        return self.model_copy(update={**values, "sources": sources, "priced_stack": stack})


class RuntimeMemory(_Sourced):
    """Device memory a training process holds beyond its tensors and whatever its collectives
    allocate: the CUDA context, which no torch statistic counts, and the cuBLAS workspaces torch
    caches per handle and stream (inside `memory_allocated`)."""

    cuda_context_mib: float = Field(ge=0, description="the CUDA context with lazy module loading, MiB")
    cublas_workspace_mib: float = Field(ge=0, description="torch's default cuBLAS workspace for this arch, MiB")
    cublas_workspaces: int = Field(gt=0, description="workspaces a training step caches: one per thread and "
                                   "stream that runs a GEMM (the forward's, and autograd's device thread's)")

    def bytes(self) -> dict[str, float]:
        return {"cuda_context": self.cuda_context_mib * 2**20,
                "cublas_workspace": self.cublas_workspace_mib * self.cublas_workspaces * 2**20}


class GPU(_Sourced):
    unsourced_fields: ClassVar[frozenset[str]] = frozenset({"placeholder"})  # a flag, not a figure
    name: SafeName
    device_type: Literal["cuda", "cpu"] = Field("cuda", description="the torch device its ranks run on, which "
                                                "sets torch's defaults (AdamW's foreach path on cuda, its "
                                                "per-tensor loop on cpu)")
    arch: str | None = Field(None, pattern=r"^(sm\d{2,3}|gfx\d{3,4}[a-z]?)$", description="the GPU architecture "
                             "torch's kernel choices look at: CUDA's sm<major><minor> (sm80 for A100) or ROCm's "
                             "gfx target (gfx942 for MI300X); None on a CPU. It decides which scaled-dot-product-"
                             "attention kernel runs (`costmodel.attention`)")
    peak_tflops: dict[Dtype, float]
    hbm_gb: float = Field(gt=0)
    hbm_gbps: float = Field(gt=0, description="HBM bandwidth, GB/s")
    efficiency: Efficiency
    mtbf_hours: float | None = Field(default=None, gt=0)
    placeholder: bool = Field(False, description="its figures are an order-of-magnitude guess, not a datasheet's "
                              "or a measurement's (the catalog's generic CPU): `parallax calibrate` measures one")
    fresh_page_gbps: float | None = Field(
        default=None, gt=0, description="GB/s at which memory the allocator maps fresh is first touched (page "
        "faults and zeroing), for tensors of at least fresh_page_min_bytes: a host allocator returns those to the "
        "OS when freed, so every step maps them again. None: a caching allocator (CUDA's) reuses its blocks")
    fresh_page_min_bytes: float | None = Field(default=None, gt=0, description="the smallest tensor mapped fresh "
                                               "on every allocation (glibc: its mmap threshold's ceiling)")
    host_op_us: float | None = Field(None, gt=0, description="host microseconds eager PyTorch spends issuing one aten "
                                     "op on this machine (dispatch, autograd, launch), forward or backward: a layer "
                                     "runs no faster than its traced ops times this. None: not measured, not priced")
    runtime_memory: RuntimeMemory | None = Field(None, description="what the CUDA runtime holds per process (None: "
                                                 "nothing beyond the tensors, as on CPU ranks)")

    @field_validator("peak_tflops")
    @classmethod
    def _positive_peaks(cls, peaks: dict[str, float]) -> dict[str, float]:
        bad = [k for k, v in peaks.items() if v <= 0]
        if bad:
            raise ValueError(f"peak_tflops must be positive, got {bad}")
        return peaks

    def peak_flops(self, dtype: str) -> float:
        """Dense peak in FLOP/s for `dtype` (fp16 and bf16 fall back to each other; fp8 and int8
        never fall back: a GPU without such a peak cannot run those GEMMs)."""
        if dtype in ("fp8", "int8") and dtype not in self.peak_tflops:
            raise ValueError(f"GPU {self.name} has no {dtype} peak")
        for key in (dtype, {"bf16": "fp16", "fp16": "bf16"}.get(dtype, dtype), "fp32"):
            if key in self.peak_tflops:
                return self.peak_tflops[key] * 1e12
        raise ValueError(f"GPU {self.name} has no peak for {dtype}")


IntraFabric = Literal["nvswitch", "mesh", "pcie"]


class Node(_Sourced):
    gpus_per_node: int = Field(gt=0, le=MAX_GPUS)
    fabric: IntraFabric
    link_gbps: float = Field(gt=0, description="per-GPU unidirectional intra-node bandwidth, GB/s")
    link_latency_us: float = Field(ge=0)
    host_link_gbps: float | None = Field(None, gt=0, description="per-GPU host<->device bandwidth one way, GB/s "
                                         "(PCIe, or NVLink-C2C on Grace Hopper): what offloaded states cross")
    host_memory_gb: float | None = Field(None, gt=0, description="host memory per node, GB: offloaded states' room")
    host_memory_gbps: float | None = Field(None, gt=0, description="host memory bandwidth per node, GB/s: what the "
                                           "host optimizer step of offloaded states runs at")
    host_fresh_page_gbps: float | None = Field(
        None, gt=0, description="GB/s at which a rank first writes a new host tensor above the host allocator's mmap "
        "threshold (page faults and zeroing): the host AdamW's temporaries of offloaded states are mapped afresh "
        "every step. None: not measured, and not priced")
    oversubscription: float | None = Field(
        default=None, ge=1,
        description="threads the node's ranks run / the cores they share, when above 1 (CPU ranks time-sliced on "
                    "shared cores; the profile's rates are those with every rank busy). A rank's compute rate while "
                    "k of the node's n ranks are busy is then min(oversubscription, n/k) times that rate. "
                    "None: 1, one device per rank")


class Protocol(_Sourced):
    """One way a collective library moves data: a fixed launch cost, a latency per ring
    step inside a node and across nodes, and the share of the links' bus bandwidth it
    reaches (NCCL's LL, LL128 and Simple trade the last against the first two)."""

    name: str
    launch_us: float = Field(ge=0)
    intra_step_us: float = Field(ge=0)
    inter_step_us: float = Field(ge=0)
    bandwidth_fraction: float = Field(gt=0, le=1)


class CommunicatorMemory(_Sourced):
    """Device memory the library allocates itself for each communicator that runs a collective:
    invisible to torch's allocator statistics, counted by `cudaMemGetInfo` and nvidia-smi. A
    ring keeps two connections a channel whatever the group's size (NCCL's maintainer, quoted in
    NVIDIA/nccl#986), each with its protocols' buffers."""

    channels: int = Field(gt=0, description="channels a communicator opens")
    connections_per_channel: int = Field(gt=0, description="ring connections per channel (its two neighbours)")
    buffer_mib_per_connection: float = Field(gt=0, description="the protocols' buffers of one connection, MiB, "
                                             "as allocated (rounded to the allocation granularity)")

    def bytes_per_communicator(self) -> float:
        return self.channels * self.connections_per_channel * self.buffer_mib_per_connection * 2**20


class Collectives(_Sourced):
    """How the collective library behaves on this fabric (NCCL on GPUs, gloo on CPU ranks).

    A ring spans every rank of its group, so its latency is a sum over all its
    steps; `tree` lists the all-reduce double-binary-tree protocols, whose latency
    grows with log2 of the node count; the library picks the cheapest for each
    message, which makes bus bandwidth a function of message size. `nic_scaling`
    is the measured bus bandwidth across nodes as a fraction of its two-node value,
    by node count, interpolated in log2(nodes) and held flat beyond the points.
    """

    library: str
    ring: list[Protocol] = Field(min_length=1)
    passes: dict[Literal["all_reduce", "all_gather", "reduce_scatter"], float] = Field(
        default_factory=dict, description="traffic passes over the data each collective kind makes as the library "
        "runs it, where that departs from the ring's (all-reduce 2, all-gather and reduce-scatter 1): measured")
    tree: list[Protocol] = Field(default_factory=list)
    nic_scaling: list[tuple[float, float]] = Field(default_factory=list)
    memory: CommunicatorMemory | None = Field(None, description="the buffers each communicator allocates on the "
                                              "device (None: the library's memory is the host's, as gloo's)")

    @model_validator(mode="after")
    def _scaling_is_sourced_and_sorted(self):
        if self.nic_scaling:
            if "nic_scaling" not in self.sources:
                raise ValueError("no source given for nic_scaling; add it under 'sources'")
            nodes = [point[0] for point in self.nic_scaling]
            if nodes != sorted(nodes) or any(n < 1 for n in nodes) or any(f <= 0 for _, f in self.nic_scaling):
                raise ValueError("nic_scaling must be [nodes, fraction] points with nodes >= 1 ascending, fractions > 0")
        return self


class Cluster(_Sourced):
    """`n_nodes` identical nodes joined by one NIC per GPU."""

    unsourced_fields: ClassVar[frozenset[str]] = frozenset({"n_nodes"})

    name: SafeName
    gpu: GPU
    node: Node
    n_nodes: int = Field(gt=0, le=MAX_GPUS)
    nic_gbps: float = Field(gt=0, description="per-GPU inter-node NIC bandwidth, Gb/s (bits)")
    nic_latency_us: float = Field(ge=0)
    inter_fabric: str = "infiniband"
    storage_gbps_per_node: float | None = Field(None, gt=0, description="sustained checkpoint write bandwidth "
                                                "to shared storage per node, GB/s (prices a DCP save)")
    price_per_gpu_hour: float | None = Field(default=None, ge=0)
    collectives: Collectives | None = Field(
        default=None, description="the collective library's protocols on this fabric (None: one alpha-beta "
                                  "protocol from the link latencies, as `calibrate` measures them)")

    @property
    def n_gpus(self) -> int:
        return self.n_nodes * self.node.gpus_per_node

    @property
    def gpus_per_node(self) -> int:
        return self.node.gpus_per_node

    @property
    def nic_bytes_per_s(self) -> float:
        return self.nic_gbps * 1e9 / 8

    def for_stack(self, stack: str) -> "Cluster":
        """This cluster with its GPU's efficiencies as `stack` runs (`Efficiency.for_stack`): the
        one door through which a plan's kernel stack reaches the cost model."""
        eff = self.gpu.efficiency.for_stack(stack)
        if eff is self.gpu.efficiency:
            return self
        return self.model_copy(update={"gpu": self.gpu.model_copy(update={"efficiency": eff})})

    def resized(self, n_gpus: int) -> "Cluster":
        """This cluster with `n_gpus` GPUs: whole nodes of its kind, or one node of `n_gpus`."""
        per_node = self.gpus_per_node
        if n_gpus % per_node == 0:
            return self.model_copy(update={"n_nodes": n_gpus // per_node})
        if n_gpus < per_node:
            return self.model_copy(update={"n_nodes": 1, "node": self.node.model_copy(update={"gpus_per_node": n_gpus})})
        raise HardwareError("n_gpus", f"{n_gpus} GPUs do not fill whole nodes of {per_node}",
                            f"use a multiple of {per_node}")

    def guess_warning(self) -> str:
        """The line that heads every prediction made on a placeholder profile ("" otherwise)."""
        if not self.gpu.placeholder:
            return ""
        return (f"{self.spec()} is a catalog guess, not this machine: run parallax calibrate for predictions "
                "you can hold it to")

    def spec(self) -> str:
        """The spec string that `hardware.load` turns back into this cluster."""
        return f"{self.n_gpus}x{self.name}"
