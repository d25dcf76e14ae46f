"""Measure this machine and write a hardware profile (`hardware.schema.Cluster`).

Every number is measured here, and sourced as such: matmul throughput by size
(fitted to the cost model's `max * d / (d + half_dim)` curve), memory
bandwidth, attention and elementwise efficiency, the optimizer step's speed,
and collective bandwidth and latency between local ranks.

Measured the way a run uses the machine. `ranks` processes run every
microbenchmark at the same time, each with the thread count a run gives its
ranks (`threads_per_rank`: cores // ranks on CPU, as `parallax run` sets
OMP_NUM_THREADS), so that on a CPU whose ranks share cores the profile holds
the rate one rank gets while its peers compute too, not the rate of a lone
process. Collectives are timed between bursts of compute on every rank (as
they occur in training), so the latency includes waiting for peers to be
scheduled; and a collective is also timed while the ranks compute, which
gives the fraction of its time that overlaps compute (`comm_overlap`: near 1
with spare copy engines, near 0 when the collective needs the cores the
compute is using). The profile records the rank and thread counts it was
measured with: reuse it for runs with the same layout on the node.
"""
from __future__ import annotations

import datetime
import os
import statistics
import tempfile

import torch
import torch.multiprocessing as mp

from costmodel.memory import OPTIMIZER_TRAFFIC_BYTES  # the cost model's AdamW traffic per parameter
from executor.measure.microbench import (COLLECTIVE_SIZES, DTYPES, SLOW_DTYPE_FACTOR, TRAINING_DTYPE, _LOCKSTEP,
                                 attention_flops, collective_in_training, collective_passes, fit_half_dim,
                                 fresh_page_bytes_per_s, host_link_bandwidth, host_op_seconds, host_memory_bytes,
                                 link_from_all_reduce, matmul_curve,
                                 cuda_runtime_memory, memory_bandwidth, optimizer_seconds_per_param, overlap_fraction,
                                 storage_write_bytes_per_s)
from hardware.schema import GPU, Cluster, Collectives, Efficiency, Node, Protocol, RuntimeMemory

# ---------------------------------------------------------------- concurrent ranks


def threads_per_rank(device: str, ranks: int) -> int:
    """Threads each rank runs with: cores // ranks on CPU (what `parallax run` gives OMP_NUM_THREADS)."""
    env = os.environ.get("OMP_NUM_THREADS")
    if env:
        return max(1, int(env))
    return max(1, (os.cpu_count() or 1) // ranks) if device == "cpu" else torch.get_num_threads()


def _rank_worker(rank: int, world: int, device: str, threads: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dev = f"cuda:{rank % torch.cuda.device_count()}" if device == "cuda" else "cpu"
    res: dict = {}
    if device == "cuda":
        torch.cuda.set_device(dev)
        res["runtime_memory"] = cuda_runtime_memory(dev)  # before NCCL allocates its buffers
    # gloo beside NCCL: the ranks agree on their timings in CPU tensors, which NCCL refuses
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    _LOCKSTEP["sync"] = dist.barrier

    def agree(seconds: float) -> float:
        value = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value)

    _LOCKSTEP["agree"] = agree

    def lockstep(key, fn):
        dist.barrier()
        res[key] = fn()

    # First, while the heap holds no large free block that a new tensor could reuse, as a training
    # process's large tensors (beside its live states) mostly find none.
    lockstep("fresh_pages", lambda: fresh_page_bytes_per_s(device))
    for name, dt in DTYPES.items():
        lockstep(("matmul", name), lambda dt=dt: matmul_curve(dev, dt))
    lockstep("memory", lambda: memory_bandwidth(dev))
    lockstep("attention", lambda: attention_flops(dev, DTYPES[TRAINING_DTYPE[device]]))
    lockstep("optimizer", lambda: optimizer_seconds_per_param(dev))
    if device == "cuda":  # offload's figures: the host link, and the host's memory at this rank's threads
        lockstep("host_link", lambda: host_link_bandwidth(dev))
        lockstep("host_memory", lambda: memory_bandwidth("cpu")[0])
        lockstep("host_fresh_pages", lambda: fresh_page_bytes_per_s("cpu"))
        lockstep("host_op", lambda: host_op_seconds(dev, DTYPES[TRAINING_DTYPE[device]]))
    if world > 1:
        lockstep("all_reduce", lambda: collective_in_training(dev))
        lockstep("passes", lambda: collective_passes(dev, res["all_reduce"]))
        lockstep("overlap", lambda: overlap_fraction(dev))
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def measure_concurrently(device: str, ranks: int, threads: int) -> list[dict]:
    """Every rank's measurements, taken in lockstep by `ranks` processes of `threads` threads."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_worker, args=(ranks, device, threads, os.path.join(tmp, "rdzv"), tmp), nprocs=ranks, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(ranks)]


def _median(values):
    return statistics.median(values)


def _merge(results: list[dict], key) -> object:
    """The median over ranks of a scalar, a tuple of scalars, or a {size: value} curve."""
    values = [r[key] for r in results]
    if isinstance(values[0], dict):
        return {k: _median([v[k] for v in values]) for k in values[0]}
    if isinstance(values[0], tuple):
        return tuple(_median(col) for col in zip(*values))
    return _median(values)


def calibrate(device: str = "cpu", ranks: int = 2, threads: int | None = None) -> Cluster:
    """Measure and return a one-node cluster profile of this machine, as `ranks` ranks use it."""
    threads = threads or threads_per_rank(device, ranks)
    results = measure_concurrently(device, ranks, threads)
    cores = os.cpu_count() or 1
    setting = (f"{ranks} ranks x {threads} threads measuring at once on {cores} cores"
               if device == "cpu" else f"{ranks} ranks measuring at once")
    when = f"measured by parallax calibrate on {datetime.date.today().isoformat()} ({setting})"
    fits = {name: fit_half_dim(_merge(results, ("matmul", name))) for name in DTYPES}
    peak = {name: fit[0] / 1e12 for name, fit in fits.items()}
    copy_bw, elementwise = _merge(results, "memory")
    trained_in = TRAINING_DTYPE[device]
    attention = min(_merge(results, "attention") / fits[trained_in][0], 1.0)
    # The optimizer's speed relative to the cost model's fused-AdamW memory-bound estimate.
    ideal = OPTIMIZER_TRAFFIC_BYTES / (copy_bw * elementwise)
    optimizer = min(ideal / _merge(results, "optimizer"), 1.0)
    if ranks > 1:
        link_bw, latency = link_from_all_reduce(_merge(results, "all_reduce"), ranks)
        overlap = _merge(results, "overlap")
    else:
        link_bw, latency, overlap = copy_bw, 0.0, 1.0
    library = measured_library(device, results, latency, when) if ranks > 1 else None
    eff = Efficiency(matmul_max=1.0, matmul_half_dim=fits[trained_in][1], attention=attention, memory_bound=elementwise,
                     intra_node_bw=1.0, inter_node_bw=1.0, optimizer=optimizer, comm_overlap=overlap,
                     sources={k: when for k in ("matmul_max", "matmul_half_dim", "attention", "memory_bound",
                                                "intra_node_bw", "inter_node_bw")}
                     | {"optimizer": when + " (torch.optim.AdamW step)",
                        "comm_overlap": when + " (all-reduce beside matmuls)"})
    memory_gb = _device_memory_gb(device) / ranks
    fresh, fresh_sources = fresh_pages(device, results, when)
    runtime, runtime_sources = cuda_runtime(device, results, when)
    gpu = GPU(name=f"calibrated-{device}", device_type=device, peak_tflops=peak, hbm_gb=memory_gb, hbm_gbps=copy_bw / 1e9, efficiency=eff,
              sources={"peak_tflops": when + " (fitted matmul asymptote" + slow_dtype_notes(peak, results) + ")",
                       "hbm_gb": when + " (device memory / ranks)",
                       "hbm_gbps": when + " (tensor copy)"} | fresh_sources | runtime_sources, **fresh, **runtime)
    # CPU ranks whose threads outnumber the cores are time-sliced: the rates above are those with every rank
    # busy, and a rank computes faster while some of its peers wait (costmodel.estimate's pipeline).
    oversub = ranks * threads / cores if device == "cpu" and ranks * threads > cores else None
    host, host_sources = host_figures(device, results, copy_bw, memory_gb * ranks, when)
    node = Node(gpus_per_node=ranks, fabric="pcie", link_gbps=link_bw / 1e9, link_latency_us=latency * 1e6,
                oversubscription=oversub, **host,
                sources={"gpus_per_node": f"ranks used by parallax calibrate ({setting})",
                         "link_gbps": when + " (all-reduce between compute bursts, fitted)",
                         "link_latency_us": when + " (all-reduce between compute bursts, fitted)"}
                | ({"oversubscription": f"{ranks} ranks x {threads} threads / os.cpu_count() = {cores} cores"}
                   if oversub else {}) | host_sources)
    return Cluster(name=f"calibrated-{device}", gpu=gpu, node=node, n_nodes=1, nic_gbps=link_bw * 8 / 1e9,
                   nic_latency_us=latency * 1e6, inter_fabric="loopback", collectives=library,
                   storage_gbps_per_node=storage_write_bytes_per_s() / 1e9,
                   sources={"nic_gbps": when + " (single node: the local all-reduce link)",
                            "nic_latency_us": when + " (single node: the local all-reduce link)",
                            "storage_gbps_per_node": when + " (fsync'd 8 MiB writes in the working directory)"})


def host_figures(device: str, results: list[dict], copy_bw: float, memory_gb: float, when: str) -> tuple[dict, dict]:
    """The node's host figures (offload's) and their sources. On CPU ranks the device is the host,
    so a copy to it runs at the measured copy bandwidth (its fresh pages are the device's, and an
    optimizer's temporaries there are not priced, offloaded or not); a GPU's ranks measure a pinned
    copy each way, the host memory's copy bandwidth at their own threads (the node's ranks add
    them) and the host's fresh pages, which an offloaded AdamW's temporaries pay every step."""
    ranks = len(results)
    if device == "cpu":
        how = {"host_link_gbps": (copy_bw / 1e9, "CPU ranks: the host is the device; tensor copy"),
               "host_memory_gb": (memory_gb, "CPU ranks: the host is the device; the machine's memory"),
               "host_memory_gbps": (copy_bw * ranks / 1e9, "CPU ranks: the host is the device; tensor copy x ranks")}
    else:
        how = {"host_link_gbps": (_merge(results, "host_link") / 1e9, "pinned copies to and from the device, "
                                  "the slower way"),
               "host_memory_gb": (host_memory_bytes() / 1e9, "physical pages, as the OS counts them"),
               "host_memory_gbps": (sum(r["host_memory"] for r in results) / 1e9,
                                    "host tensor copy at each rank's threads, summed over ranks"),
               "host_fresh_page_gbps": (_merge(results, "host_fresh_pages") / 1e9,
                                        "first write of a new 64 MiB host tensor beyond a reused one's")}
    return ({k: v for k, (v, _) in how.items()}, {k: f"{when} ({text})" for k, (_, text) in how.items()})


def measured_library(device: str, results: list[dict], latency: float, when: str) -> Collectives:
    """The collective library as measured: one protocol of the fitted link latency, and the
    passes over the data its all-gather and reduce-scatter make beside its all-reduce."""
    link = Protocol(name="link", launch_us=0.0, intra_step_us=latency * 1e6, inter_step_us=latency * 1e6,
                    bandwidth_fraction=1.0, sources={k: when + " (all-reduce between compute bursts, fitted)" for k in
                                                     ("launch_us", "intra_step_us", "inter_step_us",
                                                      "bandwidth_fraction")})
    passes = _merge(results, "passes")
    return Collectives(library="nccl" if device == "cuda" else "gloo", ring=[link], passes=passes,
                       sources={"passes": when + " (all-gather and reduce-scatter beside an all-reduce of "
                                f"{COLLECTIVE_SIZES[-1] // 2**20} MiB between compute bursts)"})


def cuda_runtime(device: str, results: list[dict], when: str) -> tuple[dict, dict]:
    """The GPU's `arch` (which attention kernel torch dispatches) and `runtime_memory` as measured,
    with sources; nothing on CPU."""
    if device != "cuda":
        return {}, {}
    if torch.version.hip:  # ROCm names its target, e.g. gfx942:sramecc+:xnack-
        arch, read = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0], "gcnArchName"
    else:
        arch, read = "sm{}{}".format(*torch.cuda.get_device_capability(0)), "get_device_capability()"
    context, workspace = _merge(results, "runtime_memory")
    runtime = RuntimeMemory(
        cuda_context_mib=context / 2**20, cublas_workspace_mib=workspace / 2**20, cublas_workspaces=2,
        sources={"cuda_context_mib": when + " (device memory used beyond torch's reserve after a GEMM and an "
                                            "attention call, before NCCL)",
                 "cublas_workspace_mib": when + " (a first GEMM's allocation beyond its output)",
                 "cublas_workspaces": "torch keeps one workspace per thread and stream that runs a GEMM; autograd "
                                      "runs a CUDA device's backward on its own thread (torch/csrc/autograd/engine.cpp)"})
    host_op_us = _merge(results, "host_op") * 1e6
    return ({"arch": arch, "runtime_memory": runtime, "host_op_us": host_op_us},
            {"arch": f"torch.cuda {read}, read by parallax calibrate",
             "host_op_us": when + " (forward and backward of two llama-160m blocks at 8 tokens under autocast: "
                                  "host time over the aten ops a dispatch mode counted)"})


GLIBC_MMAP_THRESHOLD_MAX = 32 * 2 ** 20  # glibc mallopt(3): DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems


def fresh_pages(device: str, results: list[dict], when: str) -> tuple[dict, dict]:
    """The GPU's fresh-page fields and their sources: measured on CPU, absent on CUDA (a caching allocator)."""
    if device != "cpu":
        return {}, {}
    return ({"fresh_page_gbps": _merge(results, "fresh_pages") / 1e9, "fresh_page_min_bytes": GLIBC_MMAP_THRESHOLD_MAX},
            {"fresh_page_gbps": when + " (first write of a new 64 MiB tensor beyond a reused one's)",
             "fresh_page_min_bytes": "glibc mallopt(3): the dynamic mmap threshold stops at "
                                     "DEFAULT_MMAP_THRESHOLD_MAX, 32 MiB on 64-bit systems"})


def slow_dtype_notes(peak: dict[str, float], results: list[dict]) -> str:
    """"; bf16: no native units here, 54x slower than fp32, measured at d <= 512 only" for each dtype
    at least SLOW_DTYPE_FACTOR times slower than fp32 ("" when none is)."""
    notes = []
    for name, tflops in peak.items():
        if name != "fp32" and tflops * SLOW_DTYPE_FACTOR <= peak["fp32"]:
            largest = max(results[0][("matmul", name)])
            notes.append(f"{name}: no native units here, {peak['fp32'] / tflops:.0f}x slower than fp32, "
                         f"measured at d <= {largest} only")
    return "".join(f"; {n}" for n in notes)


def _device_memory_gb(device: str) -> float:
    if device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory / 1e9
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
