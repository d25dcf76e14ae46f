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
import time

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from hardware.schema import GPU, Cluster, Efficiency, Node

MATMUL_SIZES = (256, 512, 1024, 2048)
# A matmul size is not grown to when one call of it would take longer than this (predicted from the
# size below, time ~ d^3): on a CPU without native bf16 units a 2048^3 bf16 matmul takes ~28 s; the
# curve is fitted from what was measured.
MATMUL_CALL_BUDGET_S = 1.0
SLOW_DTYPE_FACTOR = 10  # a dtype this many times slower than fp32 is flagged in the profile's sources
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COLLECTIVE_SIZES = (2 ** 16, 2 ** 20, 8 * 2 ** 20, 32 * 2 ** 20)
OPTIMIZER_PARAMS = 4 * 2 ** 20  # per tensor, four tensors
OPTIMIZER_TRAFFIC_BYTES = 28  # the cost model's fused-AdamW traffic per parameter (costmodel.estimate)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# Set by the concurrent workers: a barrier, so that every rank times the same
# thing over the same wall-clock window (ranks that shared cores but finished
# at different moments would otherwise each see an idle machine part of the time).
_LOCKSTEP = {"sync": None, "window_s": 0.5, "agree": None}


def _agree(seconds: float) -> float:
    """The largest of every rank's `seconds` (in lockstep), so that all ranks take the same branch."""
    agree = _LOCKSTEP["agree"]
    return agree(seconds) if agree is not None else seconds


def _timeit(fn, device: str, repeat: int = 5, window: bool = True) -> float:
    """Seconds per call after one warm-up: the median of `repeat` calls, or, in lockstep, the
    mean over a window that every rank spends calling its `fn` at the same time (`window=False`
    for collectives, which need the same number of calls on every rank)."""
    fn()
    sync = _LOCKSTEP["sync"]
    if sync is not None and window:
        sync()
        _sync(device)
        start, calls = time.perf_counter(), 0
        while True:
            fn()
            calls += 1
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= _LOCKSTEP["window_s"] and calls >= 2:
                return elapsed / calls
    times = []
    for _ in range(repeat):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def matmul_curve(device: str, dtype: torch.dtype, sizes=MATMUL_SIZES,
                 call_budget_s: float = MATMUL_CALL_BUDGET_S) -> dict[int, float]:
    """FLOP/s of a square d x d x d matmul, by d, from the smallest size up; the next size is
    skipped (and every larger one) when one call of it would exceed `call_budget_s` on the
    slowest rank."""
    out: dict[int, float] = {}
    ordered = sorted(sizes)
    for d, bigger in zip(ordered, [*ordered[1:], None]):
        a, b = (torch.randn(d, d, device=device, dtype=dtype) for _ in range(2))
        call = _agree(_timeit(lambda: a @ b, device))
        out[d] = 2 * d ** 3 / call
        if bigger is not None and call * (bigger / d) ** 3 > call_budget_s:
            break
    return out


def fit_half_dim(curve: dict[int, float]) -> tuple[float, float]:
    """Least-squares fit of 1/flops = 1/M + (h/M)/d: returns (asymptote M, half_dim h)."""
    xs = [1 / d for d in curve]
    ys = [1 / f for f in curve.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-30)
    intercept = my - slope * mx
    if intercept <= 0 or slope < 0:  # no saturation seen, or faster at small sizes: flat at the best point
        return max(curve.values()), 0.0
    return 1 / intercept, slope / intercept


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


def optimizer_seconds_per_param(device: str, dtype: torch.dtype = torch.float32) -> float:
    """Seconds per parameter of one torch.optim.AdamW step (the executor's optimizer, default settings)."""
    params = [torch.nn.Parameter(torch.randn(OPTIMIZER_PARAMS, device=device, dtype=dtype)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    return _timeit(opt.step, device, repeat=3) / (4 * OPTIMIZER_PARAMS)


# ---------------------------------------------------------------- collectives


def _busy(device: str, seconds: float):
    """A compute burst of about `seconds`: fp32 matmuls of d=512."""
    a = torch.randn(512, 512, device=device)
    one = _timeit(lambda: a @ a, device, repeat=3)
    reps = max(1, round(seconds / max(one, 1e-6)))

    def burst():
        for _ in range(reps):
            a @ a
        _sync(device)

    return burst


def collective_in_training(device: str, sizes=COLLECTIVE_SIZES, repeat: int = 7) -> dict[int, float]:
    """Seconds an all-reduce adds to a compute burst on every rank, by message bytes.

    Each iteration computes for ~20 ms on every rank and then all-reduces; the
    cost is the iteration time minus the burst alone, so it includes waiting
    for peers that share the cores to be scheduled, as in a training step.
    """
    import torch.distributed as dist

    burst = _busy(device, 0.02)
    dist.barrier()
    alone = _timeit(burst, device, repeat, window=False)  # timed as the bursts with collectives are
    out = {}
    for nbytes in sizes:
        tensor = torch.ones(nbytes // 4, device=device)

        def step():
            burst()
            dist.all_reduce(tensor)
            _sync(device)

        dist.barrier()
        out[nbytes] = max(_timeit(step, device, repeat, window=False) - alone, 1e-7)
    return out


def overlap_fraction(device: str, nbytes: int = 32 * 2 ** 20) -> float:
    """Fraction of an all-reduce's time that hides behind compute running at the same time."""
    import torch.distributed as dist

    tensor = torch.ones(nbytes // 4, device=device)

    def comm():
        dist.all_reduce(tensor)
        _sync(device)

    dist.barrier()
    t_comm = _timeit(comm, device, 3, window=False)
    burst = _busy(device, t_comm)
    dist.barrier()
    t_compute = _timeit(burst, device, 3)

    def both():
        work = dist.all_reduce(tensor, async_op=True)
        burst()
        work.wait()
        _sync(device)

    dist.barrier()
    t_both = _timeit(both, device, 3, window=False)
    hidden = t_comm + t_compute - t_both
    return min(max(hidden / min(t_comm, t_compute), 0.0), 1.0)


def link_from_all_reduce(curve: dict[int, float], world: int) -> tuple[float, float]:
    """(bandwidth B/s, per-hop latency s) with which the cost model's all-reduce best reproduces `curve`.

    A profile without a collective library's protocols (what calibrate writes)
    has the cost model price an all-reduce of S bytes on n ranks as one ring,
    2*((n-1)/n*S/bw + (n-1)*a) (costmodel/collectives.py); (bw, a) minimise the
    squared relative error over the measured sizes.
    """
    steps_ring = 2 * (world - 1)
    frac = 2 * (world - 1) / world

    def model(nbytes: int, bw: float, a: float) -> float:
        return frac * nbytes / bw + steps_ring * a

    small, large = min(curve), max(curve)
    bw0 = frac * (large - small) / max(curve[large] - curve[small], 1e-9)
    a0 = max(curve[small] / steps_ring, 1e-7)
    best = (float("inf"), bw0, a0)
    for i in range(-20, 21):
        for j in range(-20, 21):
            bw, a = bw0 * 1.15 ** i, a0 * 1.15 ** j
            err = sum((model(s, bw, a) / t - 1) ** 2 for s, t in curve.items())
            best = min(best, (err, bw, a))
    return best[1], best[2]


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
    if device == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    res: dict = {}
    _LOCKSTEP["sync"] = dist.barrier

    def agree(seconds: float) -> float:
        value = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value)

    _LOCKSTEP["agree"] = agree

    def lockstep(key, fn):
        dist.barrier()
        res[key] = fn()

    for name, dt in DTYPES.items():
        lockstep(("matmul", name), lambda dt=dt: matmul_curve(dev, dt))
    lockstep("memory", lambda: memory_bandwidth(dev))
    lockstep("attention", lambda: attention_flops(dev, torch.float32))
    lockstep("optimizer", lambda: optimizer_seconds_per_param(dev))
    if world > 1:
        lockstep("all_reduce", lambda: collective_in_training(dev))
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
    attention = min(_merge(results, "attention") / fits["fp32"][0], 1.0)
    # The optimizer's speed relative to the cost model's fused-AdamW memory-bound estimate.
    ideal = OPTIMIZER_TRAFFIC_BYTES / (copy_bw * elementwise)
    optimizer = min(ideal / _merge(results, "optimizer"), 1.0)
    if ranks > 1:
        link_bw, latency = link_from_all_reduce(_merge(results, "all_reduce"), ranks)
        overlap = _merge(results, "overlap")
    else:
        link_bw, latency, overlap = copy_bw, 0.0, 1.0
    eff = Efficiency(matmul_max=1.0, matmul_half_dim=fits["fp32"][1], attention=attention, memory_bound=elementwise,
                     intra_node_bw=1.0, inter_node_bw=1.0, optimizer=optimizer, comm_overlap=overlap,
                     sources={k: when for k in ("matmul_max", "matmul_half_dim", "attention", "memory_bound",
                                                "intra_node_bw", "inter_node_bw")}
                     | {"optimizer": when + " (torch.optim.AdamW step)",
                        "comm_overlap": when + " (all-reduce beside matmuls)"})
    memory_gb = _device_memory_gb(device) / ranks
    gpu = GPU(name=f"calibrated-{device}", peak_tflops=peak, hbm_gb=memory_gb, hbm_gbps=copy_bw / 1e9, efficiency=eff,
              sources={"peak_tflops": when + " (fitted matmul asymptote" + slow_dtype_notes(peak, results) + ")",
                       "hbm_gb": when + " (device memory / ranks)",
                       "hbm_gbps": when + " (tensor copy)"})
    # CPU ranks whose threads outnumber the cores are time-sliced: the rates above are those with every rank
    # busy, and a rank computes faster while some of its peers wait (costmodel.estimate's pipeline).
    oversub = ranks * threads / cores if device == "cpu" and ranks * threads > cores else None
    node = Node(gpus_per_node=ranks, fabric="pcie", link_gbps=link_bw / 1e9, link_latency_us=latency * 1e6,
                oversubscription=oversub,
                sources={"gpus_per_node": f"ranks used by parallax calibrate ({setting})",
                         "link_gbps": when + " (all-reduce between compute bursts, fitted)",
                         "link_latency_us": when + " (all-reduce between compute bursts, fitted)"}
                | ({"oversubscription": f"{ranks} ranks x {threads} threads / os.cpu_count() = {cores} cores"}
                   if oversub else {}))
    return Cluster(name=f"calibrated-{device}", gpu=gpu, node=node, n_nodes=1, nic_gbps=link_bw * 8 / 1e9,
                   nic_latency_us=latency * 1e6, inter_fabric="loopback",
                   storage_gbps_per_node=storage_write_bytes_per_s() / 1e9,
                   sources={"nic_gbps": when + " (single node: the local all-reduce link)",
                            "nic_latency_us": when + " (single node: the local all-reduce link)",
                            "storage_gbps_per_node": when + " (fsync'd 8 MiB writes in the working directory)"})


def storage_write_bytes_per_s(folder: str = ".", mbytes: int = 256, budget_s: float = 5.0) -> float:
    """Sustained write bandwidth of the storage under `folder` (where checkpoints would go): 8 MiB
    blocks written and fsync'd, stopping after `mbytes` or `budget_s`, whichever comes first."""
    import tempfile
    import time

    block = os.urandom(8 * 2 ** 20)
    written, start = 0, time.perf_counter()
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".parallax-calibrate-") as fh:
        while written < mbytes * 2 ** 20 and time.perf_counter() - start < budget_s:
            fh.write(block)
            written += len(block)
        fh.flush()
        os.fsync(fh.fileno())
        return written / (time.perf_counter() - start)


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
