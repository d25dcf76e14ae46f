"""Planning speed and quality against exhaustive enumeration of uniform layouts.

    python benchmarks/plan_speed.py [--case NAME] [--time-limit S]

For each case: the wall time of the whole `parallax plan` call in a fresh
process (import, trace, search, print; targets for gpt3-175b on 1024 A100s:
4 s cold, 2 s as later calls run), first with an empty workload cache ("cold":
it traces) and then as every later call runs ("CLI": the traced workload read
from the cache), the planning
time in-process (trace + solve), the chosen layout, its predicted tokens/s,
the proven gap the search reports (target: at most 1-2%), and the gap against
the best uniform plan found by enumerating every
DP/TP/PP/ZeRO/SP/recompute/micro-batch/schedule combination with the same
cost model (negative: the solver's plan is faster), with the enumeration's own
wall time beside it.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hardware  # noqa: E402
import planner  # noqa: E402
from planner.request import PlanRequest  # noqa: E402
from planner.search.enumerate import best_uniform  # noqa: E402
from planner.trace.workload_for import workload_for  # noqa: E402

CASES = [
    ("gpt2", "2xcpu", 16, 1024),
    ("llama-3-8b", "8xh100-sxm", 256, 8192),
    ("llama-2-70b", "64xh100-sxm", 1024, 4096),
    ("llama-3-70b", "64xh100-sxm", 1024, 8192),
    ("gpt3-175b", "1024xa100-80g", 1536, 2048),
    ("llama-3-405b", "2048xh100-sxm", 2048, 8192),
    ("llama-3-405b", "8192xh100-sxm", 2048, 8192),
    ("gpt-1t", "3072xa100-80g", 3072, 2048),
]


def cli_seconds(name, hw, global_batch, seq_len, home: str) -> float:
    """Wall time of the whole CLI call as a user runs it (a fresh interpreter), with `home`
    holding the workload cache (~/.cache/parallax): an empty one times a first call."""
    import os

    started = time.perf_counter()
    subprocess.run([str(Path(sys.executable).parent / "parallax"), "plan", name, "--hw", hw, "--global-batch", str(global_batch),
                    "--seq-len", str(seq_len)], check=True, capture_output=True, cwd=Path(__file__).resolve().parents[1],
                   env={**os.environ, "HOME": home})
    return time.perf_counter() - started


def layout(plan) -> str:
    policies = sorted({p for s in plan.stages for p in s.recompute})
    return f"{plan.layout_tag} rc={'/'.join(policies)}"


def run_case(name, hw, global_batch, seq_len, time_limit):
    import tempfile

    with tempfile.TemporaryDirectory() as home:
        cold = cli_seconds(name, hw, global_batch, seq_len, home)  # traces the model and fills the cache
        cli = cli_seconds(name, hw, global_batch, seq_len, home)
    started = time.perf_counter()
    workload, _ = workload_for(name, seq_len=seq_len)
    traced = time.perf_counter()
    plan = planner.plan(workload, hw, global_batch=global_batch, seq_len=seq_len, time_limit_s=time_limit, top_k=1)
    solved = time.perf_counter()
    cluster = hardware.load(hw)
    uniform = best_uniform(workload, cluster, global_batch=global_batch)
    enumerated = time.perf_counter()
    gap = plan.estimate.step_time_s / uniform.estimate.step_time_s - 1 if uniform else float("nan")
    return {
        "case": f"{name} on {hw}",
        "cli_s": cli,
        "cold_s": cold,
        "plan_s": solved - started,
        "trace_s": traced - started,
        "layout": layout(plan),
        "tokens_per_s": plan.estimate.tokens_per_s,
        "mfu": plan.estimate.mfu,
        "gap": gap,
        "proven_gap": plan.solver.gap,
        "enum_s": enumerated - solved,
        "uniform": layout(uniform.plan) if uniform else "-",
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", help="only cases whose model name contains this")
    parser.add_argument("--time-limit", type=float, default=PlanRequest.model_fields["time_limit_s"].default)
    args = parser.parse_args(argv)
    print(f"{'case':30} {'cold s':>6} {'CLI s':>6} {'plan s':>7} {'trace s':>7} {'tokens/s':>11} {'MFU':>6} {'vs uniform':>10} {'bound gap':>9} {'enum s':>7}  layout | best uniform")
    for case in CASES:
        if args.case and args.case not in case[0]:
            continue
        r = run_case(*case, args.time_limit)
        proven = "-" if r["proven_gap"] is None else f"{r['proven_gap']:.1%}"  # None: the limit cut the enumeration
        print(f"{r['case']:30} {r['cold_s']:6.1f} {r['cli_s']:6.1f} {r['plan_s']:7.1f} {r['trace_s']:7.1f} {r['tokens_per_s']:11,.0f} {r['mfu']:6.1%} {r['gap']:+10.2%} "
              f"{proven:>9} {r['enum_s']:7.1f}  {r['layout']} | {r['uniform']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
