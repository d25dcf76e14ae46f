"""Measure this machine and write a hardware profile (`hardware.schema.Cluster`).

Every number is measured here, and sourced as such: matmul throughput by size
(fitted to the cost model's `max * d / (d + half_dim)` curve), memory
bandwidth, attention and elementwise efficiency, and all-reduce bandwidth and
latency between local ranks (two gloo processes on CPU, NCCL on GPUs).
"""
from __future__ import annotations

import datetime
import os
import tempfile
import time

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from hardware.schema import GPU, Cluster, Efficiency, Node

MATMUL_SIZES = (128, 256, 512, 1024)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _timeit(fn, device: str, repeat: int = 5) -> float:
    """Median seconds per call after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def matmul_curve(device: str, dtype: torch.dtype, sizes=MATMUL_SIZES) -> dict[int, float]:
    """FLOP/s of a square d x d x d matmul, by d."""
    out = {}
    for d in sizes:
        a, b = (torch.randn(d, d, device=device, dtype=dtype) for _ in range(2))
        out[d] = 2 * d ** 3 / _timeit(lambda: a @ b, device)
    return out


def fit_half_dim(curve: dict[int, float]) -> tuple[float, float]:
    """Least-squares fit of 1/flops = 1/M + (h/M)/d: returns (asymptote M, half_dim h)."""
    xs = [1 / d for d in curve]
    ys = [1 / f for f in curve.values()]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-30)
    intercept = my - slope * mx
    if intercept <= 0:  # no saturation seen: the best point is the asymptote
        return max(curve.values()), 0.0
    return 1 / intercept, max(slope / intercept, 0.0)


def memory_bandwidth(device: str, mbytes: int = 128) -> tuple[float, float]:
    """(copy bandwidth B/s, elementwise-add bandwidth / copy bandwidth)."""
    n = mbytes * 2 ** 20 // 4
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    copy_bw = 2 * n * 4 / _timeit(lambda: dst.copy_(src), device)
    add_bw = 3 * n * 4 / _timeit(lambda: torch.add(src, src, out=dst), device)
    return copy_bw, min(add_bw / copy_bw, 1.0)


def attention_flops(device: str, dtype: torch.dtype) -> float:
    """FLOP/s of causal scaled-dot-product attention (forward), 4*b*h*s^2*d FLOPs / 2 for causality."""
    b, h, s, d = 2, 8, 512, 64
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(3))
    return 2 * b * h * s * s * d / _timeit(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device)


def _collective_worker(rank: int, world: int, init_file: str, out_file: str, sizes) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    for nbytes in sizes:
        tensor = torch.ones(nbytes // 4)
        results[nbytes] = _timeit(lambda: dist.all_reduce(tensor), "cpu")
    if rank == 0:
        torch.save(results, out_file)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def all_reduce_curve(world: int = 2, sizes=(4096, 2 ** 20, 16 * 2 ** 20)) -> dict[int, float]:
    """Seconds per all-reduce of `nbytes` among `world` local gloo ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pt")
        mp.spawn(_collective_worker, args=(world, os.path.join(tmp, "rdzv"), out, sizes), nprocs=world, join=True)
        return torch.load(out)


def link_from_all_reduce(curve: dict[int, float], world: int) -> tuple[float, float]:
    """(bus bandwidth B/s from the largest message, latency s from the smallest), ring model."""
    small, large = min(curve), max(curve)
    bus = 2 * (world - 1) / world
    return bus * large / max(curve[large] - curve[small], 1e-9), curve[small]


def calibrate(device: str = "cpu", ranks: int = 2) -> Cluster:
    """Measure and return a one-node cluster profile of this machine."""
    when = f"measured by parallax calibrate on {datetime.date.today().isoformat()}"
    curves = {name: matmul_curve(device, dt) for name, dt in DTYPES.items()}
    fits = {name: fit_half_dim(c) for name, c in curves.items()}
    peak = {name: fit[0] / 1e12 for name, fit in fits.items()}
    copy_bw, elementwise = memory_bandwidth(device)
    attention = min(attention_flops(device, torch.float32) / fits["fp32"][0], 1.0)
    link_bw, latency = link_from_all_reduce(all_reduce_curve(ranks), ranks)
    eff = Efficiency(matmul_max=1.0, matmul_half_dim=fits["fp32"][1], attention=attention, memory_bound=elementwise,
                     intra_node_bw=1.0, inter_node_bw=1.0,
                     sources={k: when for k in ("matmul_max", "matmul_half_dim", "attention", "memory_bound",
                                                "intra_node_bw", "inter_node_bw")})
    memory_gb = _device_memory_gb(device) / ranks
    gpu = GPU(name=f"calibrated-{device}", peak_tflops=peak, hbm_gb=memory_gb, hbm_gbps=copy_bw / 1e9, efficiency=eff,
              sources={"peak_tflops": when + " (fitted matmul asymptote)", "hbm_gb": when + " (device memory / ranks)",
                       "hbm_gbps": when + " (tensor copy)"})
    node = Node(gpus_per_node=ranks, fabric="pcie", link_gbps=link_bw / 1e9, link_latency_us=latency * 1e6,
                sources={"gpus_per_node": "ranks used by parallax calibrate", "link_gbps": when + " (all-reduce)",
                         "link_latency_us": when + " (smallest all-reduce)"})
    return Cluster(name=f"calibrated-{device}", gpu=gpu, node=node, n_nodes=1, nic_gbps=link_bw * 8 / 1e9,
                   nic_latency_us=latency * 1e6, inter_fabric="loopback",
                   sources={"nic_gbps": when + " (single node: the local all-reduce link)",
                            "nic_latency_us": when + " (single node: the local all-reduce link)"})


def _device_memory_gb(device: str) -> float:
    if device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory / 1e9
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
