"""Fit one GPU type's achievable-efficiency constants to published runs.

    python benchmarks/fit_efficiency.py --gpu a100-80g [--csv FILE]

Coordinate descent on the `efficiency` fields of the hardware profile
(GEMM peak fraction and half-efficiency dimension, attention, memory-bound,
intra- and inter-node link efficiency), each kept inside a physically
plausible range, minimising the MAPE of `published_runs.py` over every row
of that GPU at once: one set of constants per GPU type, no per-row factors.
It prints the constants; copying them into hardware/catalog/<gpu>.json (with
the fit as their source) is a deliberate, reviewed step.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import published_runs  # noqa: E402

RANGES = {
    "matmul_max": [0.60, 0.65, 0.70, 0.75, 0.80, 0.85, 0.90],
    "matmul_half_dim": [0, 64, 128, 192, 256, 384, 512],
    "attention": [0.3, 0.4, 0.5, 0.6, 0.7],
    "memory_bound": [0.5, 0.6, 0.7, 0.8, 0.9],
    "intra_node_bw": [0.5, 0.6, 0.7, 0.8, 0.9],
    "inter_node_bw": [0.6, 0.7, 0.8, 0.9],
}


def mape(rows, values: dict) -> float:
    original = published_runs.row_cluster

    def patched(row):
        cluster = original(row)
        eff = cluster.gpu.efficiency.model_copy(update=values)
        return cluster.model_copy(update={"gpu": cluster.gpu.model_copy(update={"efficiency": eff})})

    published_runs.row_cluster = patched
    try:
        errors = [abs(published_runs.predict(row)[0] / float(row["value"]) - 1) for row in rows]
    finally:
        published_runs.row_cluster = original
    return 100 * sum(errors) / len(errors)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", required=True)
    parser.add_argument("--csv", type=Path, default=published_runs.DEFAULT_CSV)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with open(args.csv, newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r["gpu"].strip().lower() == args.gpu.lower()]
    cluster = published_runs.row_cluster(rows[0])
    values = {k: getattr(cluster.gpu.efficiency, k) for k in RANGES}
    best = mape(rows, values)
    print(f"start: MAPE {best:.2f}% with {values}")
    for _ in range(args.rounds):
        for key, choices in RANGES.items():
            for choice in choices:
                trial = {**values, key: choice}
                score = mape(rows, trial)
                if score < best - 1e-9:
                    best, values = score, trial
        print(f"round: MAPE {best:.2f}% with {values}")
    print(f"fitted on {len(rows)} rows of {args.gpu}: {values}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
