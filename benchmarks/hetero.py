"""Mixed-GPU cluster: the uniform plan that ignores the difference vs the heterogeneity-aware plan.

    .venv/bin/python benchmarks/hetero.py [--hw 16xa100-80g+8xh100-sxm] [--global-batch 256] [--seq-len 4096]

Prints, per model, the aware plan's step on the mixed cluster, the uniform plan's
(from the plan's notes), the best single group alone, and the per-group share of
the aware plan (cost model figures, not measurements).
"""
from __future__ import annotations

import argparse
import time

from rich.console import Console

from hardware.mixed import load_mixed
from planner.mixed.search import plan_mixed, uniform_baseline
from planner.request import PlanRequest
from planner.resolve import resolve_workload
from planner.summary import groups_table

# Llama-2-13B (HF meta-llama/Llama-2-13b-hf config): the "13B model" of the comparison.
LLAMA_2_13B = {"model_type": "llama", "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40,
               "num_key_value_heads": 40, "intermediate_size": 13824, "vocab_size": 32000,
               "max_position_embeddings": 4096, "tie_word_embeddings": False, "hidden_act": "silu"}
MODELS = {"llama-3-8b": "llama-3-8b", "llama-2-13b": LLAMA_2_13B, "llama-3-70b": "llama-3-70b"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hw", default="16xa100-80g+8xh100-sxm")
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    console = Console(width=140)
    rows, mixed = [], load_mixed(args.hw)
    for name in args.models.split(","):
        start = time.perf_counter()
        request = PlanRequest(global_batch=args.global_batch, seq_len=args.seq_len, dtype="bf16")
        plan = plan_mixed(MODELS[name], args.hw, request)
        wall = time.perf_counter() - start
        if plan.groups:
            console.print(groups_table(plan))
        baseline = uniform_baseline(resolve_workload(MODELS[name], seq_len=args.seq_len, dtype="bf16", cluster=mixed),
                                    mixed, request)
        uniform = baseline.estimate.step_time_s if baseline is not None else None
        alone = [a.estimate.step_time_s for a in [plan, *plan.alternatives] if not a.groups]
        rows.append((name, uniform, min(alone) if alone else None, plan, wall))
    console.print(f"\n{args.hw}, global batch {args.global_batch} x {args.seq_len} tokens, bf16 (predicted step times)")
    print("| model | uniform plan (slowest pace) | best single group | aware plan | split | speed-up vs uniform | plan wall s |")
    print("|---|---|---|---|---|---|---|")
    for name, uni, alone, plan, wall in rows:
        step = plan.estimate.step_time_s
        print(f"| {name} | {f'{uni:.2f} s' if uni else 'does not fit'} | {f'{alone:.2f} s' if alone else '-'} | "
              f"{step:.2f} s ({plan.layout_tag}) | {plan.split or plan.hardware + ' alone'} | "
              f"{(uni / step if uni else float('nan')):.2f}x | {wall:.1f} |")


if __name__ == "__main__":
    main()
