"""Goodput under failures as the cluster grows (costmodel/goodput.py).

Per-GPU MTBF from the hardware data (H100: ~50,700 h, from the Llama 3 paper's
419 interruptions in 54 days on 16,384 GPUs), checkpoint = bf16 weights + fp32
master weights and Adam moments (14 bytes/parameter) written at the storage
bandwidth (default 2 TB/s sustained, Llama 3 paper), restart 10 min (an
assumption). For each cluster size: the job's MTBF, failures per day, checkpoint
write time, Young's interval sqrt(2 delta M) (and Daly's higher-order one), the
expected goodput there, and the goodput of a naive fixed 1-hour interval.

    .venv/bin/python benchmarks/goodput.py [--params 70e9] [--storage-gbps 2000] [--restart-min 10]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def table(params: float, gpu: str, counts: list[int], storage_gbps: float | None, restart_s: float | None) -> list[str]:
    import hardware
    from costmodel.goodput import expected_goodput, goodput

    lines = [f"{params / 1e9:.0f}B parameters on {gpu}: checkpoint {params * 14 / 1e12:.2f} TB",
             "", "| GPUs | job MTBF (h) | failures/day | write (s) | Young interval (min) | Daly (min) | goodput | "
                 "goodput, 1 h interval |", "|---|---|---|---|---|---|---|---|"]
    for n in counts:
        g = goodput(params, hardware.load(f"{n}x{gpu}"), storage_gbps=storage_gbps, restart_s=restart_s)
        hourly = expected_goodput(3600.0, g.write_s, g.restart_s, g.job_mtbf_s)
        lines.append(f"| {n:,} | {g.job_mtbf_s / 3600:,.1f} | {g.failures_per_day:.2f} | {g.write_s:.2f} | "
                     f"{g.optimal_interval_s / 60:.1f} | {g.daly_interval_s / 60:.1f} | {g.goodput:.2%} | {hourly:.2%} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=70e9)
    parser.add_argument("--gpu", default="h100-sxm")
    parser.add_argument("--storage-gbps", type=float, default=None)
    parser.add_argument("--restart-min", type=float, default=None)
    args = parser.parse_args()
    restart = args.restart_min * 60 if args.restart_min is not None else None
    print("\n".join(table(args.params, args.gpu, [64, 256, 1024, 4096, 16384], args.storage_gbps, restart)))


if __name__ == "__main__":
    main()
