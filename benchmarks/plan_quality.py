"""Does the planner pick what is fastest here, and does the run measure what was priced?

Calibrates this machine once (`parallax calibrate` with the runs' rank count),
plans gpt2 and a small HF Llama config on that profile, and runs each layout
of the set below for a few steps with `parallax run`'s launcher: the
planner's own pick, then pinned layouts (DP, ZeRO-3, TP, PP, interleaved PP,
2-D meshes), each planned by the same planner with the pin, so that its
stage partition and checkpointing are the planner's and its prediction is the
plan's own estimate. A layout the planner does not offer (the executor cannot
run it on that model) is listed as such. The 3-D mesh needs 8 ranks and gets
its own 8-rank calibration.

Printed per layout: measured and predicted step time and peak memory with
signed errors (measured - predicted) / predicted, and the 1-minute load
average before the run. Then, per model: whether the pick is within 5% of the
measured-fastest layout, and the share of layout pairs the prediction orders
as the measurement does.

Targets: pick within 5% of the fastest; >= 90% of pairs in order; |time
error| <= 15% and |memory error| <= 10% on every layout.

    .venv/bin/python benchmarks/plan_quality.py [--steps 4] [--profile cpu4.json] [--models gpt2,llama-160m]
"""
from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path

import hardware
import planner
from executor.measure.calibrate import calibrate
from executor.runtime.config import RunConfig
from executor.runtime.launch import run
from hardware.errors import ParallaxError

GLOBAL_BATCH, SEQ_LEN, DTYPE = 8, 128, "fp32"
LAYOUTS = {
    "dp4": dict(dp=4, zero=0), "zero3": dict(dp=4, zero=3), "tp4": dict(tp=4), "pp4": dict(pp=4, schedule="1f1b"),
    "pp4-interleaved": dict(pp=4, schedule="interleaved"), "dp2xtp2": dict(dp=2, tp=2),
    "dp2xpp2": dict(dp=2, pp=2), "dp2xtp2xpp2": dict(dp=2, tp=2, pp=2),
}
TARGETS = dict(pick=0.05, order=0.90, time=0.15, memory=0.10)


def profile_for(ranks: int, path: Path | None):
    """A calibrated profile for `ranks` ranks, reused from `path` when it exists."""
    if path is not None and path.exists():
        return hardware.load(str(path))
    cluster = calibrate("cpu", ranks=ranks)
    if path is not None:
        path.write_text(cluster.model_dump_json(indent=2))
    return cluster


def plan_layout(model: str, cluster, pins: dict):
    try:
        return planner.plan(model, cluster, global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, dtype=DTYPE, fixed=pins,
                            top_k=1, time_limit_s=4.0)
    except ParallaxError as error:
        return str(error)


def describe(plan) -> str:
    return plan.layout_tag


def measure(model: str, cluster, name: str, pins: dict | None, steps: int) -> dict | None:
    plan = plan_layout(model, cluster, pins or {})
    if isinstance(plan, str):
        print(f"  {name:16} not offered: {plan}")
        return None
    load = os.getloadavg()[0]
    report = run(plan, RunConfig(steps=steps))
    row = dict(name=name, layout=describe(plan), load=load, meas=report.step_time_s,
               pred=report.predicted_step_time_s, mem=max(report.peak_memory_bytes),
               pred_mem=report.predicted_peak_memory_bytes, terr=report.step_time_error, merr=report.memory_error)
    print(f"  {name:16} {row['layout']:28} {row['meas']:8.2f} {row['pred']:8.2f} {row['terr']:+7.1%} "
          f"{row['mem'] / 2**20:8.0f} {row['pred_mem'] / 2**20:8.0f} {row['merr']:+7.1%} {load:5.1f}")
    return row


def order_agreement(rows: list[dict]) -> tuple[int, int]:
    pairs = list(itertools.combinations(rows, 2))
    right = sum((a["meas"] < b["meas"]) == (a["pred"] < b["pred"]) for a, b in pairs)
    return right, len(pairs)


def summarise(model: str, rows: list[dict]) -> list[str]:
    misses = []
    fastest = min(rows, key=lambda r: r["meas"])
    pick = next(r for r in rows if r["name"] == "pick")
    behind = pick["meas"] / fastest["meas"] - 1
    right, total = order_agreement(rows)
    print(f"  pick {pick['layout']} measured {behind:+.1%} vs the fastest ({fastest['name']}: {fastest['layout']}); "
          f"pairwise order {right}/{total} = {right / max(1, total):.0%}")
    if behind > TARGETS["pick"]:
        misses.append(f"{model}: pick {behind:+.1%} behind the fastest")
    if total and right / total < TARGETS["order"]:
        misses.append(f"{model}: order {right / total:.0%}")
    misses += [f"{model} {r['name']}: time {r['terr']:+.1%}" for r in rows if abs(r["terr"]) > TARGETS["time"]]
    misses += [f"{model} {r['name']}: memory {r['merr']:+.1%}" for r in rows if abs(r["merr"]) > TARGETS["memory"]]
    return misses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--profile", type=Path, help="4-rank profile to reuse (written if missing)")
    parser.add_argument("--profile8", type=Path, help="8-rank profile to reuse (written if missing)")
    parser.add_argument("--models", default="gpt2,llama-160m")
    parser.add_argument("--only", default="", help="comma-separated layout names (the pick always runs)")
    args = parser.parse_args()
    profiles = {4: profile_for(4, args.profile)}
    misses = []
    for model in args.models.split(","):
        print(f"{model}: global batch {GLOBAL_BATCH} x {SEQ_LEN} tokens, {DTYPE}, {os.cpu_count()} cores")
        print(f"  {'layout':16} {'plan':28} {'meas s':>8} {'pred s':>8} {'err':>7} {'meas MiB':>8} {'pred MiB':>8} {'err':>7} {'load':>5}")
        rows = [measure(model, profiles[4], "pick", None, args.steps)]
        for name, pins in LAYOUTS.items():
            if args.only and name not in args.only.split(","):
                continue
            ranks = pins.get("dp", 1) * pins.get("tp", 1) * pins.get("pp", 1)
            if ranks not in profiles:
                profiles[ranks] = profile_for(ranks, args.profile8 if ranks == 8 else None)
            rows.append(measure(model, profiles[ranks], name, pins, args.steps))
        four = [r for r in rows if r is not None and r["name"] != "dp2xtp2xpp2"]
        misses += summarise(model, four)
    print(f"{len(misses)} misses of the targets (pick {TARGETS['pick']:.0%}, order {TARGETS['order']:.0%}, "
          f"time {TARGETS['time']:.0%}, memory {TARGETS['memory']:.0%})" + (": " + "; ".join(misses) if misses else ""))


if __name__ == "__main__":  # calibrate spawns processes: keep the guard
    main()
