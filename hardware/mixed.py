"""A validated mixed-GPU cluster: several homogeneous `Cluster` groups of different GPU types.

`load_mixed("16xa100-80g+8xh100-sxm")` loads each part with `hardware.load`
(so every group is a validated, sourced Cluster of whole or partial nodes)
and joins them with a network no faster than the slowest group's: the
inter-group NIC bandwidth is the minimum of the groups' and its latency the
maximum, both cited in `sources`.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hardware.errors import HardwareError
from hardware.loader import load
from hardware.schema import GPU, Cluster

__all__ = ["MixedCluster", "load_mixed", "gpu_speed"]

_EXAMPLE = "e.g. 16xa100-80g+8xh100-sxm"


def gpu_speed(gpu: GPU, dtype: str = "bf16") -> float:
    """Achievable dense GEMM FLOP/s: the figure layer counts are balanced against first."""
    return gpu.peak_flops(dtype) * gpu.efficiency.matmul_max


class MixedCluster(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    groups: list[Cluster] = Field(min_length=1)
    nic_gbps: float = Field(gt=0, description="inter-group per-GPU bandwidth, Gb/s: min of the groups'")
    nic_latency_us: float = Field(ge=0, description="inter-group latency: max of the groups'")
    sources: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _network_no_faster_than_groups(self):
        slowest = min(g.nic_gbps for g in self.groups)
        if self.nic_gbps > slowest:
            raise ValueError(f"inter-group NIC {self.nic_gbps} Gb/s exceeds the slowest group's {slowest} Gb/s")
        return self

    @property
    def n_gpus(self) -> int:
        return sum(g.n_gpus for g in self.groups)

    def spec(self) -> str:
        return "+".join(g.spec() for g in self.groups)

    def peak_flops(self, dtype: str) -> float:
        """The whole cluster's peak FLOP/s at `dtype`: every GPU's, summed (MFU's denominator)."""
        return sum(g.n_gpus * g.gpu.peak_flops(dtype) for g in self.groups)

    def guess_warning(self) -> str:
        """The groups' placeholder warnings, one line ("" when every group is measured or sourced)."""
        return " ".join(w for w in (g.guess_warning() for g in self.groups) if w)

    def slowest(self, dtype: str = "bf16") -> Cluster:
        return min(self.groups, key=lambda g: gpu_speed(g.gpu, dtype))

    def with_network(self, group: Cluster) -> Cluster:
        """`group` with its NIC replaced by the inter-group network (for traffic that crosses groups)."""
        sources = {**group.sources, "nic_gbps": self.sources["nic_gbps"], "nic_latency_us": self.sources["nic_latency_us"]}
        return group.model_copy(update={"nic_gbps": self.nic_gbps, "nic_latency_us": self.nic_latency_us, "sources": sources})

    def as_uniform(self, dtype: str = "bf16") -> Cluster:
        """The whole cluster seen as `n_gpus` GPUs of the slowest type with the smallest memory and the
        inter-group network: what a planner that ignores the difference sees (everyone runs at the slowest pace)."""
        slow = self.slowest(dtype)
        per_node = slow.gpus_per_node
        if self.n_gpus % per_node:
            raise HardwareError("hw", f"{self.n_gpus} GPUs do not fill whole nodes of {per_node} {slow.name}",
                                "use whole nodes in every group")
        hbm = min(g.gpu.hbm_gb for g in self.groups)
        gpu = slow.gpu.model_copy(update={"hbm_gb": hbm})
        return self.with_network(slow).model_copy(update={"gpu": gpu, "n_nodes": self.n_gpus // per_node,
                                                          "name": f"uniform-{slow.name}"})


def load_mixed(spec: str | list[str] | list[Cluster] | MixedCluster) -> MixedCluster:
    """Parse "COUNTxGPU+COUNTxGPU..." (or a list of specs / Clusters) into a MixedCluster."""
    if isinstance(spec, MixedCluster):
        return spec
    if isinstance(spec, str):
        parts = [p.strip() for p in spec.split("+")]
        if not spec.strip() or any(not p for p in parts):
            raise HardwareError("hw", f"empty group in mixed spec {spec!r}", _EXAMPLE)
    elif isinstance(spec, (list, tuple)) and spec:
        parts = list(spec)
    else:
        raise HardwareError("hw", f"expected a mixed spec string or a list of groups, not {spec!r}", _EXAMPLE)
    groups = [p if isinstance(p, Cluster) else load(p) for p in parts]
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise HardwareError("hw", f"GPU type {dup} appears in two groups", f"merge them into one count, {_EXAMPLE}")
    nic = min(groups, key=lambda g: g.nic_gbps)
    lat = max(groups, key=lambda g: g.nic_latency_us)
    sources = {"nic_gbps": f"min of the groups' NICs ({nic.spec()}: {nic.sources.get('nic_gbps', 'profile')})",
               "nic_latency_us": f"max of the groups' NIC latencies ({lat.spec()}: {lat.sources.get('nic_latency_us', 'profile')})"}
    return MixedCluster(groups=groups, nic_gbps=nic.nic_gbps, nic_latency_us=lat.nic_latency_us, sources=sources)
