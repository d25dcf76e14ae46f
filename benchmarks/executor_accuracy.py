"""Predicted vs measured step time and peak memory on 4 CPU ranks.

Calibrates this machine (`parallax calibrate`, with 4 ranks measuring at once,
as the runs use it), then runs hand-written layouts of an ~85M-parameter GPT
(DP, ZeRO-3, TP, PP, DP x TP) for a few steps each with torchrun, and prints the
cost model's prediction beside each measurement.
Targets: |time error| <= 15%, |memory error| <= 10%.

On a shared machine the rate a rank gets changes with the load from other
processes, so by default the machine is re-calibrated right before each
layout runs (`--profile` reuses one profile for all layouts instead); the
1-minute load average before each run is printed beside it.

    .venv/bin/python benchmarks/executor_accuracy.py [--steps 5] [--profile profile.json] [--only tp4,pp4]
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from layout.plan import Plan
from executor.measure.calibrate import calibrate
from executor.runtime.config import RunConfig
from executor.runtime.launch import run
from hardware import load

MODEL = "gpt-85m"
N_LAYERS = 14  # embedding + 12 blocks + head
LAYOUTS = {
    "dp4": dict(dp=4), "zero3": dict(dp=4, zero=3), "tp4": dict(tp=4), "pp4": dict(pp=4),
    "dp2xtp2": dict(dp=2, tp=2),
}
TIME_TARGET, MEMORY_TARGET = 0.15, 0.10


def layout(dp=1, tp=1, pp=1, zero=0, global_batch=8, seq_len=256) -> Plan:
    """An fp32 plan with evenly cut stages; two micro-batches per pipeline stage."""
    bounds = [round(i * N_LAYERS / pp) for i in range(pp + 1)]
    stages = [{"start": a, "end": b, "recompute": ["none"] * (b - a)} for a, b in zip(bounds, bounds[1:])]
    micro = max(1, global_batch // (dp * 2 * pp)) if pp > 1 else global_batch // dp
    return Plan(model=MODEL, hardware="calibrated-cpu", global_batch=global_batch, seq_len=seq_len, dtype="fp32",
                dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=micro, schedule="1f1b", stages=stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile", type=Path, help="reuse this profile for every layout (written if missing)")
    parser.add_argument("--only", default="", help="comma-separated layouts to run")
    args = parser.parse_args()
    cluster = None
    if args.profile and args.profile.exists():
        cluster = load(str(args.profile))
    elif args.profile:
        cluster = calibrate("cpu", ranks=4)
        args.profile.write_text(cluster.model_dump_json(indent=2))
    names = [n for n in LAYOUTS if not args.only or n in args.only.split(",")]
    print(f"{'layout':10} {'meas ms':>9} {'pred ms':>9} {'err':>7} {'meas MiB':>9} {'pred MiB':>9} {'err':>7} {'load':>5}")
    failures = 0
    for name in names:
        profile = cluster or calibrate("cpu", ranks=4)
        load_avg = os.getloadavg()[0]
        report = run(layout(**LAYOUTS[name]), RunConfig(steps=args.steps), cluster=profile)
        failures += _print_row(name, report, load_avg)
    print(f"{failures} of {len(names)} layouts outside the targets (time {TIME_TARGET:.0%}, memory {MEMORY_TARGET:.0%}); "
          f"{os.cpu_count()} cores")


def _print_row(name: str, report, load_avg: float) -> int:
    mem = max(report.peak_memory_bytes) / 2 ** 20
    if report.predicted_step_time_s is None:
        print(f"{name:10} {report.step_time_s * 1e3:9.1f} {'-':>9} {'-':>7} {mem:9.1f} {'-':>9} {'-':>7} {load_avg:5.1f}  ({'; '.join(report.notes)})")
        return 1
    pred_mem = (report.predicted_peak_memory_bytes or 0) / 2 ** 20
    print(f"{name:10} {report.step_time_s * 1e3:9.1f} {report.predicted_step_time_s * 1e3:9.1f} "
          f"{report.step_time_error:+7.1%} {mem:9.1f} {pred_mem:9.1f} {report.memory_error:+7.1%} {load_avg:5.1f}")
    return int(abs(report.step_time_error) > TIME_TARGET or abs(report.memory_error or 0) > MEMORY_TARGET)


if __name__ == "__main__":  # calibrate spawns processes: keep the guard
    main()
