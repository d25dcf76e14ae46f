"""Fit one GPU type's achievable-efficiency constants to published runs.

    python benchmarks/fit_efficiency.py --gpu a100-80g [--stack fused] [--csv FILE]

Coordinate descent on the `efficiency` fields of the hardware profile
(GEMM peak fraction and half-efficiency dimension, FP8 GEMM peak fraction,
attention, memory-bound, intra- and inter-node link efficiency), each kept
inside a physically plausible range, minimising the MAPE of
`published_runs.py` over every row of that GPU and kernel stack at once: one
set of constants per GPU type and stack, no per-row factors. The fused stack
(Megatron-LM / Transformer Engine) fits the profile's base values, links
included; another stack fits only its own compute efficiencies
(`Efficiency.stacks`), the links being the hardware's. It prints the
constants; copying them into hardware/catalog/<gpu>.json (with the fit as
their source) is a deliberate, reviewed step.
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
    "matmul_max": [0.40, 0.45, 0.50, 0.55, 0.60, 0.65, 0.70, 0.75, 0.80, 0.85, 0.90],
    "fp8_matmul_max": [0.30, 0.35, 0.40, 0.45, 0.50, 0.55, 0.60, 0.65, 0.70, 0.75, 0.80],
    "matmul_half_dim": [0, 64, 128, 192, 256, 384, 512],
    "attention": [0.2, 0.3, 0.4, 0.5, 0.6, 0.7],
    "memory_bound": [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9],
    "intra_node_bw": [0.5, 0.6, 0.7, 0.8, 0.9],
    "inter_node_bw": [0.6, 0.7, 0.8, 0.9],
}


LINKS = ("intra_node_bw", "inter_node_bw")


def mape(rows, values: dict, stack: str = "fused") -> float:
    original = published_runs.row_cluster

    def patched(row):
        cluster = original(row).for_stack(stack)
        eff = cluster.gpu.efficiency.model_copy(update=values)
        return cluster.model_copy(update={"gpu": cluster.gpu.model_copy(update={"efficiency": eff})})

    published_runs.row_cluster = patched
    try:
        errors = [abs(published_runs.predict(row)[0] / float(row["value"]) - 1) for row in rows]
    except ValueError:  # a trial under which some row fits no layout is no fit
        return float("inf")
    finally:
        published_runs.row_cluster = original
    return 100 * sum(errors) / len(errors)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", required=True)
    parser.add_argument("--csv", type=Path, default=published_runs.DEFAULT_CSV)
    parser.add_argument("--stack", default="fused", choices=published_runs.STACKS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compute-only", action="store_true",
                        help="keep the link efficiencies as their sources give them (measured NCCL figures)")
    args = parser.parse_args(argv)
    with open(args.csv, newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r["gpu"].strip().lower() == args.gpu.lower()
                and published_runs.row_stack(r) == args.stack]
    if not rows:
        print(f"no {args.stack} rows of {args.gpu} in {args.csv}")
        return 1
    dtypes = {(r.get("dtype") or "").strip().lower() for r in rows}
    # FP8 rows run their blocks' GEMMs at fp8_matmul_max and only the head at matmul_max: rows that are all
    # FP8 fit the first and keep the second (a head alone does not pin a 16-bit GEMM speed)
    skipped = {"fp8_matmul_max"} if "fp8" not in dtypes else {"matmul_max"} if dtypes == {"fp8"} else set()
    fields = [k for k in RANGES if k not in skipped and (args.stack == "fused" and not args.compute_only or k not in LINKS)]
    efficiency = published_runs.row_cluster(rows[0]).for_stack(args.stack).gpu.efficiency
    values = {k: getattr(efficiency, k) if getattr(efficiency, k) is not None else RANGES[k][len(RANGES[k]) // 2]
              for k in fields}
    best = mape(rows, values, args.stack)
    print(f"start: MAPE {best:.2f}% with {values}")
    for _ in range(args.rounds):
        for key in fields:
            for choice in RANGES[key]:
                trial = {**values, key: choice}
                score = mape(rows, trial, args.stack)
                if score < best - 1e-9:
                    best, values = score, trial
        print(f"round: MAPE {best:.2f}% with {values}")
    print(f"fitted on {len(rows)} {args.stack} rows of {args.gpu}: {values}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
