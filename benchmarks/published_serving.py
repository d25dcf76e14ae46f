"""Published serving measurements against `parallax serve-plan`'s prediction.

    python benchmarks/published_serving.py --csv benchmarks/data/serving_runs.csv

One measurement per row (issue 32's columns): the model by its dimensions (n_layers, hidden,
heads, kv_heads, ffn_hidden, gated_mlp, vocab, n_experts, top_k), the deployment (gpu, n_gpus,
tp, pp, weights_dtype, kv_dtype), the workload (isl, osl, mode, load, engine) and the
measurement (metric, value, source). Each row is priced as the deployment stood: its tp, pp
and n_gpus / (tp x pp) replicas pinned, a mixture of experts' experts split over TP (the
engines' default) unless an optional `expert_parallel` column says yes, at its load:
- batch: `load` sequences per replica, a static batch;
- concurrency: `load` requests in flight over the deployment (closed loop), priced as that many
  concurrent sequences;
- max: the engine's maximum load, the most sequences that fit;
- rate: `load` requests per second, Poisson arrivals, through `serve-load`'s event simulation of
  the engine's scheduler (`planner.serving_load.load_report`), its warm-up left out.
Latencies are means, or the optional `statistic` column's (mean, median, p90, p99) where the
source gives another.
`weights_dtype` is bf16, fp16 or fp8, or a quantized method priced as `serve-plan
--quantization` prices it: int8 or int4 (weight-only, W8A16/W4A16: GPTQ, AWQ) and w8a8 (INT8
GEMMs, SmoothQuant); w4a16 and w8a16 are read as int4 and int8. Rows of any other precision
(FP4, for one) or whose deployment the model refuses are listed as not predicted, with the
reason. Prints each row's signed error and, per metric and in all, `MAPE: X% over N rows (K
not predicted)`, and per mode: a rate row's latencies sit on how near the rate is to the replica's
capacity (MLPerf's server runs at 88-97% of their offline throughput), so a few percent of error in
that capacity is many times that in their TTFT and TPOT.
"""
from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from published_runs import _yes, row_dims  # noqa: E402

from hardware.errors import ParallaxError  # noqa: E402
from hardware.engines import engine_aliases  # noqa: E402
from planner.inference import plan_inference  # noqa: E402
from planner.serving_load import load_report  # noqa: E402
from planner.resolve import resolve_workload  # noqa: E402

METRICS = ("out_tok_s_per_gpu", "out_tok_s_total", "ttft_ms", "tpot_ms", "e2e_latency_ms")
PRICED_WEIGHTS = {"bf16": "bf16", "fp16": "fp16", "fp8": "fp8"}
# a quantized method's name in hardware/catalog/engines/weight_quantization.json, its activations in fp16
QUANTIZED_WEIGHTS = {"int8": "int8", "w8a16": "int8", "int4": "int4", "w4a16": "int4", "w8a8": "w8a8"}
# a latency row's statistic -> the simulation's percentile field
STATISTICS = {"mean": "mean", "median": "p50", "p50": "p50", "p90": "p90", "p99": "p99"}


def _statistic(row: dict) -> str:
    """The statistic a latency row states (the optional `statistic` column; blank: mean)."""
    return (row.get("statistic") or "mean").strip().lower()


def precision(row: dict) -> tuple[str, str] | None:
    """The (dtype, quantization) `serve-plan` prices the row's weights at, or None if it does not."""
    weights = (row.get("weights_dtype") or "bf16").strip().lower()
    if weights in PRICED_WEIGHTS:
        return PRICED_WEIGHTS[weights], "none"
    if weights in QUANTIZED_WEIGHTS:
        return "fp16", QUANTIZED_WEIGHTS[weights]
    return None


def rows(path: Path) -> list[dict]:
    with path.open() as f:
        return [row for row in csv.DictReader(line for line in f if not line.startswith("#")) if row.get("metric")]


def engine_family(row: dict) -> str:
    """The row's engine family (`trtllm-0.16.0` -> trtllm, `NIM 1.3` -> trtllm), by the longest
    name or alias of hardware/engines.py it starts with; a vLLM release before 0.8 (by its
    version, or a date before 2025-03) ran the V0 engine."""
    name = (row.get("engine") or "").strip().lower()
    aliases = engine_aliases()
    alias = max((a for a in aliases if name.startswith(a)), key=len, default=None)
    family = aliases[alias] if alias is not None else "generic"
    if family == "vllm" and _before_v1(name):
        return "vllm-v0"
    return family


def _before_v1(engine: str) -> bool:
    """Whether a vLLM engine string (`vllm-0.6.7.dev(...)`, `vllm 0.6.0`, `vllm-pr3240(2024-03)`)
    predates V1."""
    version = re.match(r"vllm[-_ v]*(\d+)\.(\d+)", engine)
    if version:
        return (int(version[1]), int(version[2])) < (0, 8)
    date = re.search(r"\((\d{4})-(\d{2})\)", engine)
    return bool(date) and (int(date[1]), int(date[2])) < (2025, 3)


def row_workload(row: dict):
    """The row's model at its prompt length, traced once (the fit prices each row many times)."""
    dims = {**row, "seq_len": row["isl"]}
    dtype = (precision(row) or ("bf16", "none"))[0]
    return resolve_workload(row_dims(dims, f"{row['n_layers']}L-{row['hidden']}"), seq_len=int(row["isl"]),
                            dtype="bf16" if dtype == "fp8" else dtype)


def plan_of(row: dict, engine="generic", workload=None):
    """The row's deployment priced at its load, or the reason it is not predicted; `engine`: a
    family name or a `ServingEngine` (hardware/engines.py), `workload`: the row's, already traced."""
    priced = precision(row)
    if priced is None:
        return None, f"{row['weights_dtype'].strip()} weights are not priced"
    dtype, quantization = priced
    n_gpus, tp, pp = int(row["n_gpus"]), int(row["tp"]), int(row.get("pp") or 1)
    if n_gpus % (tp * pp):
        return None, f"{n_gpus} GPUs are not replicas of tp{tp} x pp{pp}"
    replicas = n_gpus // (tp * pp)
    mode, load = row["mode"].strip(), (row.get("load") or "").strip()
    batch = rate = None
    if mode == "batch":
        batch = int(float(load)) * replicas
    elif mode == "concurrency":
        batch = int(float(load))
    elif mode == "rate":
        rate = float(load)
    elif mode != "max":
        return None, f"unknown mode {mode!r}"
    if not (row.get("isl") or "").strip() or not (row.get("osl") or "").strip():
        return None, "the request lengths are not stated (a dataset's varying lengths)"
    statistic = _statistic(row)
    if statistic not in STATISTICS:
        return None, f"unknown statistic {statistic!r} (use {', '.join(STATISTICS)})"
    isl = int(row["isl"])
    try:
        plan = plan_inference(workload if workload is not None else row_workload(row), f"{n_gpus}x{row['gpu'].strip()}",
                              prompt_len=isl, output_len=int(row["osl"]), batch=batch, request_rate=rate,
                              dtype=dtype, quantization=quantization, top_k=1,
                              kv_dtype=(row.get("kv_dtype") or "").strip() or "auto",
                              fixed={"tp": tp, "pp": pp, "replicas": replicas}, engine=engine,
                              expert_parallel=bool(_yes(row, "expert_parallel")))
    except ParallaxError as error:
        return None, " ".join(str(error).split())[:140]
    return plan, ""


def predicted(plan, metric: str, osl: int, row: dict | None = None, engine="generic", workload=None) -> float:
    """The row's metric as `plan` (its deployment at the row's load) predicts it; a rate row's
    from the event simulation of its replicas at that rate, by `engine` (as `plan_of` takes it)."""
    if row is not None and row["mode"].strip() == "rate":
        return simulated(plan, row, metric, engine, workload if workload is not None else row_workload(row))
    e = plan.estimate
    return {"out_tok_s_per_gpu": plan.tokens_per_s / plan.gpus_used, "out_tok_s_total": plan.tokens_per_s,
            "ttft_ms": e.ttft_s * 1e3, "tpot_ms": e.tpot_s * 1e3,
            "e2e_latency_ms": (e.ttft_s + e.tpot_s * (osl - 1)) * 1e3}[metric]


def simulated(plan, row: dict, metric: str, engine, workload) -> float:
    """A rate row's metric from `serve-load`'s simulation of one of `plan`'s replicas at its share
    of the rate (the same workload, engine, precision and layout `plan` priced)."""
    report = load_report(workload, plan.hardware, lengths=[(plan.prompt_len, plan.output_len)],
                         rates=[float(row["load"])], dtype=plan.dtype, kv_dtype=plan.kv_dtype, engine=engine,
                         quantization=plan.quantization, expert_parallel=plan.expert_parallel, top_k=1,
                         fixed={"tp": plan.tp, "pp": plan.pp, "replicas": plan.replicas})
    sim = report.layouts[0].points[0]
    if metric in ("out_tok_s_total", "out_tok_s_per_gpu"):
        total = sim.output_tokens_per_s * plan.replicas
        return total if metric == "out_tok_s_total" else total / plan.gpus_used
    figures = {"ttft_ms": sim.ttft_ms, "tpot_ms": sim.tpot_ms, "e2e_latency_ms": sim.e2e_ms}[metric]
    return getattr(figures, STATISTICS[_statistic(row)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", required=True, help="one published serving measurement per row")
    parser.add_argument("--generic", action="store_true", help="price every row by the generic roofline, not its "
                        "engine family's fit")
    args = parser.parse_args(argv)
    errors: dict[str, list[float]] = defaultdict(list)
    missed: dict[str, int] = defaultdict(int)
    by_mode: dict[str, list[float]] = defaultdict(list)  # a rate near capacity multiplies a small error in it
    for i, row in enumerate(rows(Path(args.csv)), 1):
        metric = row["metric"].strip()
        where = (f"{i:3} {row['n_layers']}L/{row['hidden']} {row['n_gpus']}x{row['gpu']} tp{row['tp']} "
                 f"{row['weights_dtype'] or 'bf16'} {row['isl']}/{row['osl']} {row['mode']} {row.get('load') or '-'}")
        engine = "generic" if args.generic else engine_family(row)
        plan, why = plan_of(row, engine) if metric in METRICS else (None, f"unknown metric {metric!r}")
        if plan is None:
            missed[metric] += 1
            print(f"{where:62} {metric:18} {float(row['value']):>10,.1f}  not predicted: {why}")
            continue
        value, guess = float(row["value"]), predicted(plan, metric, int(row["osl"]), row, engine)
        errors[metric].append(guess / value - 1)
        by_mode[row["mode"].strip()].append(errors[metric][-1])
        print(f"{where:62} {metric:18} {value:>10,.1f} {guess:>10,.1f} {errors[metric][-1]:+7.1%}  {row['engine']}")
    for metric in METRICS:
        if errors[metric] or missed[metric]:
            print(f"  {metric}: " + _mape(errors[metric], missed[metric]))
    for mode, values in sorted(by_mode.items()):
        print(f"  mode {mode}: {statistics.mean(abs(v) for v in values):.1%} over {len(values)} rows")
    print("MAPE: " + _mape([e for v in errors.values() for e in v], sum(missed.values())))
    return 0


def _mape(values: list[float], missed: int) -> str:
    mape = statistics.mean(abs(v) for v in values) if values else float("nan")
    return f"{mape:.1%} over {len(values)} rows ({missed} not predicted)"


if __name__ == "__main__":
    raise SystemExit(main())
