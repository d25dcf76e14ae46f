"""Serving: a plan for llama-3-70b on 8xh100-sxm, and measured vs predicted decode steps on CPU ranks.

    .venv/bin/python benchmarks/serving.py [--model reference-tiny] [--tp 2]

The CPU part runs greedy generation with the TP layout on gloo ranks
(executor/inference/generate.py), checks the tokens equal one process's, and compares
the median decode step with the serving cost model on the `cpu` profile,
first as catalogued, then with the all-reduce latency measured on the ranks
(a user override, printed as such). The errors are reported as they are.
"""
from __future__ import annotations

import argparse

from executor.inference.generate import predicted_decode_step, run_generation
from planner.inference import plan_inference


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="reference-tiny")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--skip-plan", action="store_true")
    args = parser.parse_args()
    if not args.skip_plan:
        plan = plan_inference("llama-3-70b", "8xh100-sxm", prompt_len=2048, output_len=256, slo_tpot_ms=50, slo_ttft_ms=500)
        e = plan.estimate
        print(f"llama-3-70b on 8xh100-sxm, 2048 in / 256 out, SLO TPOT 50 ms TTFT 500 ms: tp={plan.tp} pp={plan.pp} "
              f"x{plan.replicas} replicas, batch {plan.batch_per_replica:.0f}/replica, TTFT {e.ttft_s * 1e3:.0f} ms, "
              f"TPOT {e.tpot_s * 1e3:.1f} ms, {plan.tokens_per_s:,.0f} tok/s ({e.tokens_per_s_per_gpu:.0f}/GPU), "
              f"${e.usd_per_million_output_tokens:.2f}/1M output tokens, feasible={plan.feasible}")
    kw = dict(prompt_len=args.prompt_len, new_tokens=args.new_tokens, batch=args.batch)
    r = run_generation(args.model, tp=args.tp, **kw)
    pred = predicted_decode_step(args.model, tp=args.tp, **kw)
    pred1 = predicted_decode_step(args.model, tp=1, **kw)
    pred_meas = predicted_decode_step(args.model, tp=args.tp, intra_latency_us=r.all_reduce_s * 1e6 / 2, **kw)
    print(f"{args.model}, tp={args.tp} on gloo, batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens")
    print(f"tokens equal to one process (cached and full-recompute): {r.equal}")
    print("| layout | measured decode step ms | predicted (cpu profile) ms | error |")
    print("|---|---|---|---|")
    print(f"| 1 process | {r.decode_step_s_single * 1e3:.3f} | {pred1 * 1e3:.3f} | {pred1 / r.decode_step_s_single - 1:+.0%} |")
    print(f"| tp={args.tp} | {r.decode_step_s * 1e3:.3f} | {pred * 1e3:.3f} | {pred / r.decode_step_s - 1:+.0%} |")
    print(f"| tp={args.tp}, measured all-reduce latency {r.all_reduce_s * 1e6:.0f} us (override) | {r.decode_step_s * 1e3:.3f} | "
          f"{pred_meas * 1e3:.3f} | {pred_meas / r.decode_step_s - 1:+.0%} |")


if __name__ == "__main__":
    main()
