"""Time the step simulator on GPT-3 175B over 1024 H100s (tp 8, pp 8, dp 16, 192 micro-batches).

The simulator is meant for interactive what-ifs, so one step of the largest
published layout must simulate in well under two seconds on a laptop-class
CPU. Prints the wall time (best of a few runs), the event count and how far
the simulated step is from the analytic estimate.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hardware  # noqa: E402
from costmodel import TransformerDims, estimate, transformer_workload  # noqa: E402
from layout.plan import Plan
from layout.plan import uniform_stages  # noqa: E402
from costmodel.simulate.step import simulate  # noqa: E402

GPT3 = TransformerDims(n_layers=96, hidden=12288, heads=96, vocab=50257, seq_len=2048, name="gpt3-175b")


def main(repeats: int = 3) -> float:
    hw = hardware.load("1024xh100-sxm")
    w = transformer_workload(GPT3)
    plan = Plan(model="gpt3-175b", hardware=hw.spec(), global_batch=3072, seq_len=2048, dp=16, tp=8, pp=8,
                micro_batch=1, schedule="1f1b", stages=uniform_stages([l.kind for l in w.layers], 8, "selective"))
    assert plan.num_micro_batches == 192
    best, sim = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        sim = simulate(w, plan, hw)
        best = min(best, time.perf_counter() - t0)
    est = estimate(w, plan, hw)
    print(f"gpt3-175b on 1024xh100-sxm (dp16 tp8 pp8, 192 micro-batches): simulated in {best:.3f} s, "
          f"{len(sim.events)} events")
    print(f"step: simulated {sim.step_time_s:.3f} s, estimated {est.step_time_s:.3f} s "
          f"({sim.step_time_s / est.step_time_s - 1:+.2%}); bubble {sim.bubble_fraction:.3%}")
    return best


if __name__ == "__main__":
    sys.exit(0 if main() < 2.0 else 1)
