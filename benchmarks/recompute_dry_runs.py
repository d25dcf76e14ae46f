"""Each recompute policy on llama-3-8b, dry-run against its prediction, at tp1 and at tp2+sp.

    python benchmarks/recompute_dry_runs.py             # 8 x H100, 16 x 8,192 tokens, ZeRO-3, micro-batch 2
    python benchmarks/recompute_dry_runs.py --tp 2      # one TP degree only

Each layout is pinned (dp8, or dp4 tp2 with sequence parallelism; ZeRO-3, the plan's other
axes left to the planner) and run on fake tensors by the executor's own appliers
(`executor.measure.dry_run`), one rank per pipeline role. It prints the measured peak of
live tensors (what `max_memory_allocated` would read) beside the cost model's, and the
caching-allocator replay (`max_memory_reserved`, expandable segments) beside the predicted
reservation. Each dry run takes a minute or two on two cores.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import planner  # noqa: E402
from executor.measure.dry_run import dry_run  # noqa: E402
from layout.axes import RECOMPUTE  # noqa: E402
from planner.request import PlanRequest  # noqa: E402

GIB = 2**30
LAYOUTS = {1: {"dp": 8, "tp": 1, "pp": 1, "zero": 3}, 2: {"dp": 4, "tp": 2, "sp": True, "pp": 1, "zero": 3}}


def row(tp: int, policy: str, args) -> str:
    fixed = {**LAYOUTS[tp], "micro_batch": args.micro_batch, "recompute": policy}
    request = PlanRequest(global_batch=args.global_batch, seq_len=args.seq_len, dtype="bf16", fixed=fixed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = planner.plan(args.model, args.hw, request)
        started = time.perf_counter()
        rank = dry_run(plan).worst
    replayed = rank.allocator.get("reserved_expandable", float("nan"))
    predicted_reserved = rank.predicted_reserved or float("nan")
    return (f"{'tp' + str(tp) + ('+sp' if tp > 1 else ''):8} {policy:10} {rank.measured_peak / GIB:9.2f} "
            f"{rank.predicted_peak / GIB:9.2f} {rank.error:+7.1%} {replayed / GIB:9.2f} {predicted_reserved / GIB:9.2f} "
            f"{predicted_reserved / replayed - 1:+7.1%} {time.perf_counter() - started:6.0f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--hw", default="8xh100-sxm")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--tp", type=int, choices=sorted(LAYOUTS), default=None, help="one TP degree (default: both)")
    parser.add_argument("--policies", default=",".join(RECOMPUTE))
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",")]
    unknown = [p for p in policies if p not in RECOMPUTE]
    if unknown:
        parser.error(f"--policies: unknown {', '.join(unknown)} (use {', '.join(RECOMPUTE)})")
    print(f"{args.model} on {args.hw}, {args.global_batch} x {args.seq_len} tokens, micro-batch {args.micro_batch}, "
          f"ZeRO-3, bf16 (FSDP2 mixed precision)")
    print(f"{'layout':8} {'recompute':10} {'dry GiB':>9} {'pred GiB':>9} {'err':>7} {'replay':>9} {'pred resv':>9} "
          f"{'err':>7} {'secs':>6}")
    for tp in [args.tp] if args.tp else sorted(LAYOUTS):
        for policy in policies:
            print(row(tp, policy, args), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
