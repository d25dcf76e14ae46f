"""The GPU runs kept in benchmarks/data/h200_gpu_runs.csv, priced again here without a GPU.

    python benchmarks/gpu_runs.py             # cost model: step time and peak tensors against measured
    python benchmarks/gpu_runs.py --dry-run   # also the dry run's allocated and replayed reserved memory

Each row is a run of benchmarks/gpu_check.py on one H200, with the calibration of that machine
(benchmarks/data/h200_calibrated_run*.json). The plan is rebuilt from the row by gpu_check's own
`single_rank_plan` and priced on that profile; the memory columns compare the predicted tensors with
`max_memory_allocated`, the predicted reservation (costmodel/reserved.py) with `max_memory_reserved`
and, with --dry-run, the dry run on fake tensors with `max_memory_allocated` and its
caching-allocator replay with `max_memory_reserved`.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import MIB, SETTINGS, single_rank_plan  # noqa: E402

from costmodel.estimate import estimate  # noqa: E402
from hardware import load  # noqa: E402
from planner.trace.workload_for import workload_for  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
MODEL, SEQ_LEN, _, _ = SETTINGS["cuda"]  # the runs are gpu_check's on the GPU


def rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def plan_of(row: dict, workload):
    profile = load(DATA / row["profile"])
    return single_rank_plan("cuda", workload, profile, MODEL, row["recompute"], row["stack"],
                            offload=row.get("offload") == "true"), profile


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", default=str(DATA / "h200_gpu_runs.csv"))
    parser.add_argument("--dry-run", action="store_true", help="also dry-run each plan (about 20 s each)")
    args = parser.parse_args(argv)
    workload, _ = workload_for(MODEL, seq_len=SEQ_LEN, dtype="bf16")
    print(f"{'run':13} {'step ms':>8} {'pred':>8} {'err':>7} {'alloc MiB':>10} {'pred':>8} {'err':>7} "
          f"{'resv MiB':>9} {'pred':>8} {'err':>7}"
          + (f" {'dry':>8} {'err':>7} {'replay':>8} {'err':>7}" if args.dry_run else ""))
    errors = {"time": [], "memory": [], "reserved": [], "dry": [], "replayed": []}
    for row in rows(Path(args.csv)):
        plan, profile = plan_of(row, workload)
        priced = estimate(workload, plan, profile)
        step, allocated = float(row["step_ms"]) / 1e3, float(row["allocated_mib"]) * MIB
        reserved = float(row["reserved_mib"]) * MIB
        errors["time"].append(priced.step_time_s / step - 1)
        errors["memory"].append(priced.peak_memory_bytes / allocated - 1)
        errors["reserved"].append(priced.peak_reserved_bytes / reserved - 1)
        line = (f"{row['name']:13} {step * 1e3:8.1f} {priced.step_time_s * 1e3:8.1f} {errors['time'][-1]:+7.1%} "
                f"{allocated / MIB:10,.0f} {priced.peak_memory_bytes / MIB:8,.0f} {errors['memory'][-1]:+7.1%} "
                f"{reserved / MIB:9,.0f} {priced.peak_reserved_bytes / MIB:8,.0f} {errors['reserved'][-1]:+7.1%}")
        if args.dry_run:
            line += dry_run_columns(plan, row, errors)
        print(line, flush=True)
    for name, values in errors.items():
        if values:
            print(f"{name} MAPE: {statistics.mean(abs(v) for v in values):.1%} over {len(values)} runs")
    return 0


def dry_run_columns(plan, row: dict, errors: dict) -> str:
    from executor.measure.dry_run import dry_run

    rank = dry_run(plan).worst
    allocated, reserved = float(row["allocated_mib"]) * MIB, float(row["reserved_mib"]) * MIB
    replayed = rank.allocator.get("reserved_expandable", float("nan"))
    errors["dry"].append(rank.measured_peak / allocated - 1)
    errors["replayed"].append(replayed / reserved - 1)
    return f" {rank.measured_peak / MIB:8,.0f} {errors['dry'][-1]:+7.1%} {replayed / MIB:8,.0f} {errors['replayed'][-1]:+7.1%}"


if __name__ == "__main__":
    raise SystemExit(main())
