"""Offload against published single-GPU runs (benchmarks/data/offload_runs.csv).

Three checks on one V100 32 GB (the catalog's DGX-1 host: 512 GB, PCIe 3.0):
- the largest GPT of width 4096 the planner fits with offload, against ZeRO-Offload's 13B;
- the largest it fits without, against PyTorch's 1.4B;
- the predicted TFLOP/s of a 10B GPT with offload, against ZeRO-Offload's 40.
The executor offloads with FSDP2's CPUOffloadPolicy (16 host bytes per parameter: fp32 weights,
gradients and both moments), ZeRO-Offload keeps fp16 weights on the GPU (12 host bytes), so the
sizes are not the same mechanism; the gap is printed, not fitted.

    .venv/bin/python benchmarks/offload.py
"""
from __future__ import annotations

import csv
from pathlib import Path

import hardware
import planner
from costmodel.transformer import TransformerDims, transformer_workload
from hardware.errors import InfeasibleError

ROWS = {r["id"]: r for r in csv.DictReader(open(Path(__file__).parent / "data" / "offload_runs.csv"))}
HW, SEQ, BATCH, DTYPE = "1xv100-32g", 1024, 16, "fp16"


def gpt(n_layers: int, hidden: int = 4096, heads: int = 32):
    return transformer_workload(TransformerDims(name=f"gpt-{n_layers}x{hidden}", n_layers=n_layers, hidden=hidden,
                                                heads=heads, vocab=50257, seq_len=SEQ))


def plan_or_none(workload, fixed: dict):
    try:
        return planner.plan(workload, HW, global_batch=BATCH, seq_len=SEQ, dtype=DTYPE, fixed=fixed, top_k=1)
    except InfeasibleError:
        return None


def largest(fixed: dict, hidden: int = 4096, heads: int = 32) -> float:
    """Parameters (billions) of the deepest GPT of this width that fits (bisection over layers)."""
    lo, hi = 0, 400
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plan_or_none(gpt(mid, hidden, heads), fixed) else (lo, mid)
    return gpt(max(lo, 1), hidden, heads).params / 1e9 if lo else 0.0


def main() -> None:
    cluster = hardware.load(HW)
    print(f"{HW}: host {cluster.node.host_memory_gb:.0f} GB, {cluster.node.host_link_gbps:.0f} GB/s link; "
          f"batch {BATCH} x {SEQ}, {DTYPE}")
    with_offload = largest({"offload": True})
    without = largest({"offload": False}, hidden=2048, heads=16)
    print(f"largest with offload   {with_offload:6.1f} B  (ZeRO-Offload: {ROWS['zero_offload_max_1xv100']['value']} B)")
    print(f"largest without        {without:6.1f} B  (PyTorch: {ROWS['pytorch_max_1xv100']['value']} B)")
    row = ROWS["zero_offload_10b_1xv100"]
    plan = plan_or_none(gpt(int(row["n_layers"])), {"offload": True})
    if plan is None:
        print("10B: does not fit")
        return
    est = plan.estimate
    published = float(row["value"])
    print(f"10B {plan.layout_tag}: {est.tflops_per_gpu_model:.1f} TFLOP/s predicted, {published:.0f} published "
          f"({est.tflops_per_gpu_model / published - 1:+.0%}); host copies {est.host_copy_s / est.step_time_s:.0%} "
          f"of the step, host AdamW {est.breakdown_s['optimizer']:.2f} s of {est.step_time_s:.2f} s")


if __name__ == "__main__":
    main()
