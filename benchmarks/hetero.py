"""Mixed-GPU cluster: the uniform plan that ignores the difference vs the heterogeneity-aware plan.

    .venv/bin/python benchmarks/hetero.py [--hw 16xa100-80g+8xh100-sxm] [--global-batch 256] [--seq-len 4096]

Prints, per model, both step times on the same cluster, the best single-group
subsets, and the per-group balance of the aware plan (cost model figures,
not measurements).
"""
from __future__ import annotations

import argparse
import time

from rich.console import Console

from parallax_cli.hetero_cmd import balance_table
from planner.mixed.search import plan_hetero

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
    rows = []
    for name in args.models.split(","):
        start = time.perf_counter()
        plan = plan_hetero(MODELS[name], args.hw, global_batch=args.global_batch, seq_len=args.seq_len)
        wall = time.perf_counter() - start
        console.print(balance_table(plan.model_copy(update={"model": name})))
        best_subset = min(plan.subset_step_time_s.items(), key=lambda kv: kv[1]) if plan.subset_step_time_s else ("-", float("nan"))
        rows.append((name, plan.uniform_step_time_s, plan.uniform_layout, best_subset, plan.step_time_s, plan.mode, wall))
    console.print(f"\n{args.hw}, global batch {args.global_batch} x {args.seq_len} tokens, bf16 (predicted step times)")
    print("| model | uniform plan (slowest pace) | best single group | hetero-aware | mode | speed-up vs uniform | plan wall s |")
    print("|---|---|---|---|---|---|---|")
    for name, uni, lay, (sub, sub_t), het, mode, wall in rows:
        uni_s = f"{uni:.2f} s ({lay})" if uni else "does not fit"
        print(f"| {name} | {uni_s} | {sub_t:.2f} s ({sub}) | {het:.2f} s | {mode} | "
              f"{(uni / het if uni else float('nan')):.2f}x | {wall:.1f} |")


if __name__ == "__main__":
    main()
