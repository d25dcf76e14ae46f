"""The microbenchmarks `parallax calibrate` runs on every rank, and the fits of their results.

Matmul throughput by size (each size grown only while one call stays within its budget),
copy and elementwise bandwidth, the cost of a freshly mapped large tensor, attention, the
optimizer step, all-reduce between compute bursts and beside compute, the passes all-gather
and reduce-scatter make beside it, and the storage write bandwidth. In lockstep (executor/
calibrate.py sets `_LOCKSTEP`) every rank times the same thing over the same window.
"""
from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

MATMUL_SIZES = (64, 128, 256, 512, 1024, 2048)  # the GEMM's smallest dimension
MATMUL_WIDE = 1024  # its other two dimensions on cpu (4x on cuda, which a 1024-wide GEMM does not fill)
# A matmul size is not grown to when one call of it would take longer than this (predicted from the
# size below, time ~ d): on a CPU without native bf16 units a 2048^3 bf16 matmul takes ~28 s; the
# curve is fitted from what was measured.
MATMUL_CALL_BUDGET_S = 1.0
SLOW_DTYPE_FACTOR = 10  # a dtype this many times slower than fp32 is flagged in the profile's sources
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The dtype a device trains in, whose GEMM curve and attention kernels the profile's efficiencies describe
TRAINING_DTYPE = {"cpu": "fp32", "cuda": "bf16"}
COLLECTIVE_SIZES = (2 ** 16, 2 ** 20, 8 * 2 ** 20, 32 * 2 ** 20)
OPTIMIZER_PARAMS = 4 * 2 ** 20  # per tensor, four tensors


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
    """FLOP/s of a (d x D) @ (D x D) matmul by its smallest dimension d, from the smallest up:
    the cost model sizes a GEMM by its smallest dimension (a micro-batch's tokens, or a
    TP-split weight's), the other two large (D: MATMUL_WIDE on cpu, 4x on cuda). The next
    size is skipped (and every larger one) when one call would exceed `call_budget_s` on
    the slowest rank."""
    wide = MATMUL_WIDE * (4 if device.startswith("cuda") else 1)
    out: dict[int, float] = {}
    ordered = sorted(sizes)
    for d, bigger in zip(ordered, [*ordered[1:], None]):
        a = torch.randn(d, wide, device=device, dtype=dtype)
        b = torch.randn(wide, wide, device=device, dtype=dtype)
        call = _agree(_timeit(lambda: a @ b, device))
        out[d] = 2 * d * wide * wide / call
        if bigger is not None and call * bigger / d > call_budget_s:
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


def host_link_bandwidth(device: str, mbytes: int = 256) -> float:
    """Bytes/s of one copy between pinned host memory and the device, the slower direction:
    an offloaded shard crosses both ways (FSDP2's CPU offload pins its host states)."""
    n = mbytes * 2 ** 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(n, dtype=torch.uint8, device=device)
    to_device = n / _timeit(lambda: on_device.copy_(host, non_blocking=True), device)
    to_host = n / _timeit(lambda: host.copy_(on_device, non_blocking=True), device)
    return min(to_device, to_host)


HOST_OP_MODEL = "llama-160m"  # a catalog Llama: its blocks' ops are the mix most runs issue


class CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active (forward and backward alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def host_op_seconds(device: str, dtype: torch.dtype, budget_s: float = 1.0) -> float:
    """Host seconds eager PyTorch spends issuing one aten op, forward and backward of a catalog
    Llama's two blocks under autocast, at 8 tokens: kernels that short finish before the host has
    issued the next, so the host's time is the issue's. The ops are counted by a dispatch mode in
    one step and timed without it over steps that fill `budget_s`."""
    from planner.trace.models.build import build_module

    model = build_module(HOST_OP_MODEL, depth=2).to(device)
    tokens = torch.randint(0, 100, (1, 8), device=device)

    def step():
        with torch.autocast(torch.device(device).type, dtype=dtype):
            out = model(tokens)
            logits = out.logits if hasattr(out, "logits") else out
            loss = logits.float().mean()
        loss.backward()

    step()
    _sync(device)
    counter = CountOps()
    with counter:
        step()
    _sync(device)
    started, steps = time.perf_counter(), 0
    while time.perf_counter() - started < budget_s or steps < 2:
        step()
        steps += 1
    issued = time.perf_counter() - started
    _sync(device)
    return issued / steps / counter.ops


def host_memory_bytes() -> float:
    """The machine's physical memory, as the OS counts its pages."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def attention_flops(device: str, dtype: torch.dtype) -> float:
    """FLOP/s of causal scaled-dot-product attention (forward), 4*b*h*s^2*d FLOPs / 2 for causality;
    on a GPU at a training shape, since a small one measures kernel launches."""
    b, h, s, d = (4, 16, 2048, 128) if device.startswith("cuda") else (2, 8, 512, 64)
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


def collective_in_training(device: str, sizes=COLLECTIVE_SIZES, repeat: int = 7,
                           kind: str = "all_reduce") -> dict[int, float]:
    """Seconds a collective adds to a compute burst on every rank, by message bytes.

    Each iteration computes for ~20 ms on every rank and then runs the collective
    (`kind`: all_reduce, all_gather or reduce_scatter of a full tensor of that many
    bytes); the cost is the iteration time minus the burst alone, so it includes
    waiting for peers that share the cores to be scheduled, as in a training step.
    """
    import torch.distributed as dist

    burst = _busy(device, 0.02)
    dist.barrier()
    alone = _timeit(burst, device, repeat, window=False)  # timed as the bursts with collectives are
    world = dist.get_world_size()
    # torch 2.13 renamed the single-tensor forms (the old names warn)
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    out = {}
    for nbytes in sizes:
        full = torch.ones(nbytes // 4 // world * world, device=device)
        shard = torch.ones(full.numel() // world, device=device)
        run = {"all_reduce": lambda: dist.all_reduce(full),
               "all_gather": lambda: gather(full, shard),
               "reduce_scatter": lambda: scatter(shard, full)}[kind]

        def step():
            burst()
            run()
            _sync(device)

        dist.barrier()
        out[nbytes] = max(_timeit(step, device, repeat, window=False) - alone, 1e-7)
    return out


def collective_passes(device: str, all_reduce: dict[int, float]) -> dict[str, float]:
    """The passes over the data all-gather and reduce-scatter make as the library runs them,
    from their cost beside the all-reduce's (2 passes) of the same full tensor in training
    (`all_reduce`: `collective_in_training`'s curve; its largest size is used)."""
    nbytes = max(all_reduce)
    return {kind: 2.0 * collective_in_training(device, (nbytes,), repeat=5, kind=kind)[nbytes] / all_reduce[nbytes]
            for kind in ("all_gather", "reduce_scatter")}


def fresh_page_bytes_per_s(device: str, mbytes: int = 64) -> float | None:
    """Bytes/s at which a freshly allocated host tensor above the host allocator's mmap threshold
    is first written, beyond a write of a reused one: the page faults and zeroing every step pays
    for such tensors on CPU (the host's, for a GPU's offloaded optimizer). None for a CUDA
    device's own memory: its caching allocator reuses blocks."""
    if device != "cpu":
        return None
    n = mbytes * 2 ** 20 // 4
    kept = torch.empty(n)
    reused = _timeit(lambda: kept.fill_(1.0), device, repeat=3)
    fresh = _timeit(lambda: torch.empty(n).fill_(1.0), device, repeat=3)
    return n * 4 / max(fresh - reused, 1e-6)


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


def storage_write_bytes_per_s(folder: str = ".", mbytes: int = 256, budget_s: float = 5.0) -> float:
    """Sustained write bandwidth of the storage under `folder` (where checkpoints would go): 8 MiB
    blocks written and fsync'd, stopping after `mbytes` or `budget_s`, whichever comes first."""
    block = os.urandom(8 * 2 ** 20)
    written, start = 0, time.perf_counter()
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".parallax-calibrate-") as fh:
        while written < mbytes * 2 ** 20 and time.perf_counter() - start < budget_s:
            fh.write(block)
            written += len(block)
        fh.flush()
        os.fsync(fh.fileno())
        return written / (time.perf_counter() - start)


def cuda_runtime_memory(device: str) -> tuple[float, float]:
    """(bytes the process holds on the GPU outside torch's allocator, bytes one cuBLAS workspace
    takes inside it), before any collective library starts: the CUDA context, with the GEMM and
    attention kernels' modules loaded as a training step loads them, is what the device's free
    memory lost beyond what torch reserved; the workspace is what a first GEMM on this thread
    allocated beyond its output."""
    a, b = (torch.randn(1024, 1024, device=device, dtype=torch.bfloat16) for _ in range(2))
    before = torch.cuda.memory_allocated(device)
    c = a @ b
    torch.cuda.synchronize(device)
    workspace = torch.cuda.memory_allocated(device) - before - c.numel() * c.element_size()
    q = torch.randn(1, 8, 256, 128, device=device, dtype=torch.bfloat16)
    F.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return float(total - free - torch.cuda.memory_reserved(device)), float(max(workspace, 0))
