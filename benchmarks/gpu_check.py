"""One GPU, a few minutes: memory and step time as a plan predicts them, then measured.

    python benchmarks/gpu_check.py                # on the GPU: llama-3.2-1b at 2048 tokens
    python benchmarks/gpu_check.py --device cpu   # the same loop on a small Llama (llama-160m, 128 tokens)

It calibrates the device (`parallax calibrate` at one rank), plans a single-rank
layout of a 1B-class Llama under each recompute policy and once offloaded, runs
each with torchrun as `parallax run` does, and prints measured `max_memory_allocated`, `max_memory_reserved` and step time
beside the prediction. Reserved memory is what a GPU runs out of: the cost model
predicts both the tensors (allocated) and what the caching allocator holds beside
them (costmodel/reserved.py); on CPU ranks reserved reads the tensors' peak. A run
that does not fit says so and the loop goes on. Every run is bounded by --timeout.

ZeRO-3 over one rank shards nothing, and the executor wraps nothing there: bf16
runs under autocast on the fp32 weights (costmodel/autocast.py prices the copies
it casts). The offloaded plan runs under FSDP2 with its CPU offload policy.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor.measure.calibrate import calibrate  # noqa: E402
from executor.runtime.config import RunConfig  # noqa: E402
from executor.runtime.launch import run  # noqa: E402
from hardware import load  # noqa: E402
from hardware.errors import ParallaxError  # noqa: E402
from layout.axes import RECOMPUTE  # noqa: E402
from layout.layout import Layout  # noqa: E402
from planner.search.space import to_plan  # noqa: E402
from planner.trace.workload_for import workload_for  # noqa: E402

SETTINGS = {  # device -> (model, sequence length, global batch, micro-batch)
    "cuda": ("llama-3.2-1b", 2048, 4, 2),
    "cpu": ("llama-160m", 128, 2, 1),
}
MIB = 2**20


DTYPE = {"cuda": "bf16", "cpu": "fp32"}


def single_rank_plan(device: str, workload, profile, model: str, recompute: str, stack: str = "eager",
                     offload: bool = False):
    """The single-rank layout the check runs on `device` (its SETTINGS' batch and micro-batch)."""
    _, _, global_batch, micro_batch = SETTINGS[device]
    layout = Layout(dp=1, zero=3, micro_batch=micro_batch, offload=offload, stack=stack)
    return to_plan(layout, workload, profile, global_batch=global_batch, dtype=DTYPE[device], recompute=recompute,
                   model=model)


def plans(device: str, profile, wanted: tuple[str, ...], model: str, seq_len: int, stack: str = "eager"):
    """(name, plan): one per recompute policy, and the no-recompute layout offloaded (those `wanted`)."""
    workload, _ = workload_for(model, seq_len=seq_len, dtype=DTYPE[device])
    for policy in (p for p in RECOMPUTE if p in wanted):
        yield policy, single_rank_plan(device, workload, profile, model, policy, stack)
    if "offloaded" in wanted:
        yield "none, offloaded", single_rank_plan(device, workload, profile, model, "none", stack, offload=True)


def row(name: str, plan, profile, steps: int, timeout: float, reports: Path | None = None) -> str:
    try:
        report = run(plan, RunConfig(steps=steps), nproc=1, cluster=profile, timeout_s=timeout)
    except ParallaxError as error:
        return f"{name:16} did not run: {' '.join(str(error).split())[:200]}"
    if reports is not None:
        stem = name.replace(",", "").replace(" ", "_")
        (reports / f"{stem}.plan.json").write_text(plan.model_dump_json(indent=2))
        (reports / f"{stem}.report.json").write_text(report.model_dump_json(indent=2))
    allocated, reserved = max(report.peak_memory_bytes), max(report.peak_reserved_bytes or report.peak_memory_bytes)
    predicted_peak = report.predicted_peak_memory_bytes or float("nan")
    predicted_reserved = report.predicted_peak_reserved_bytes or float("nan")
    predicted_step = report.predicted_step_time_s or float("nan")
    return (f"{name:16} {allocated / MIB:10,.0f} {reserved / MIB:10,.0f} {predicted_peak / MIB:10,.0f} "
            f"{predicted_reserved / MIB:10,.0f} {allocated / predicted_peak - 1:+8.1%} "
            f"{reserved / predicted_reserved - 1:+8.1%} {report.step_time_s * 1e3:9,.1f} {predicted_step * 1e3:9,.1f} "
            f"{report.step_time_s / predicted_step - 1:+8.1%}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=sorted(SETTINGS), default=None, help="default: cuda when present")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds per run")
    parser.add_argument("--profile", default=None, help="a profile or spec to predict with instead of calibrating")
    parser.add_argument("--model", default=None, help="a catalog model in place of the device's default")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--save-profile", default=None, help="write the calibrated profile to this JSON file")
    parser.add_argument("--stack", default="eager", help="the layouts' stack: eager or compile")
    parser.add_argument("--reports", default=None, help="a folder to write each plan and its run report to")
    parser.add_argument("--plans", default=",".join((*RECOMPUTE, "offloaded")),
                        help="which plans to run: recompute policies and 'offloaded', comma-separated")
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    profile = load(args.profile) if args.profile else calibrate(device, ranks=1)
    if args.save_profile:
        Path(args.save_profile).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save_profile).write_text(profile.model_dump_json(indent=2))
    model, seq_len, global_batch, micro_batch = SETTINGS[device]
    model, seq_len = args.model or model, args.seq_len or seq_len
    how = f"profile {args.profile}" if args.profile else f"calibrated in {time.perf_counter() - started:.0f} s"
    print(f"{device}: {profile.gpu.name}, {how}; {model}, "
          f"{global_batch} x {seq_len} tokens, micro-batch {micro_batch}, one rank (ZeRO-3 over one rank: "
          f"unwrapped, FSDP2 when offloaded)")
    print(f"{'recompute':16} {'alloc MiB':>10} {'resv MiB':>10} {'pred MiB':>10} {'pred resv':>10} {'mem err':>8} "
          f"{'resv err':>8} "
          f"{'step ms':>9} {'pred ms':>9} {'time err':>8}")
    wanted = tuple(p.strip() for p in args.plans.split(","))
    unknown = [p for p in wanted if p not in (*RECOMPUTE, "offloaded")]
    if unknown:
        parser.error(f"--plans: unknown {', '.join(unknown)} (use {', '.join((*RECOMPUTE, 'offloaded'))})")
    for name, plan in plans(device, profile, wanted, model, seq_len, args.stack):
        reports = Path(args.reports) if args.reports else None
        if reports is not None:
            reports.mkdir(parents=True, exist_ok=True)
        print(row(name, plan, profile, args.steps, args.timeout, reports), flush=True)
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
