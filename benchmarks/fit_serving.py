"""Fit each serving engine family's HBM efficiency and per-iteration overhead on published rows.

    python benchmarks/fit_serving.py --csv benchmarks/data/serving_runs.csv [--write]

For every (engine family, GPU type) with at least MIN_ROWS predicted rows, a grid search, then a
finer one around its best point, finds the (hbm_efficiency, step_overhead_ms) pair that
minimises the rows' mean absolute percentage error. The two act apart: the overhead is a larger
share of a small batch's iteration, the bandwidth of a large one's. Every row of a group is
priced through `plan_inference`, as `published_serving.py` prices it. `--write` stores the fits
in hardware/catalog/serving_engines.json, each with its source: the file, the rows and the date.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import datetime
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from published_serving import METRICS, engine_family, plan_of, predicted, row_workload, rows  # noqa: E402

from hardware.engines import ENGINES_FILE, EngineFit, ServingEngine, resolve_engine  # noqa: E402

MIN_ROWS = 8  # a family on a GPU with fewer rows keeps the generic roofline
COARSE = ([0.30 + 0.05 * i for i in range(15)], [0.5 * i for i in range(17)])


def _fit(family: str, eff: float, overhead_ms: float, gpu: str) -> ServingEngine:
    """The family on `gpu` with a trial fit (and its catalog cap on running sequences)."""
    trial = EngineFit(gpu=gpu, hbm_efficiency=eff, step_overhead_ms=overhead_ms,
                      sources={"hbm_efficiency": "trial", "step_overhead_ms": "trial"})
    return replace(resolve_engine(family, gpu)[0], fit=trial)


def group_rows(path: Path) -> dict[tuple[str, str], list[tuple[dict, object]]]:
    """(family, gpu) -> [(row, its traced workload)] for the rows the model predicts at a fixed
    load (a batch, a concurrency or the engine's maximum). A request rate's rows stay out: their
    throughput is the rate offered, whatever the engine, and their latencies are set by how near
    the rate sits to the replica's capacity (MLPerf's server runs sit at the edge of their SLOs),
    which the maximum-load rows already measure; `published_serving.py` prices them as checks."""
    groups: dict[tuple[str, str], list] = defaultdict(list)
    for row in rows(path):
        family = engine_family(row)
        if (family == "generic" or row["metric"].strip() not in METRICS or row["mode"].strip() == "rate"
                or plan_of(row)[0] is None):
            continue
        groups[(family, row["gpu"].strip())].append((row, row_workload(row)))
    return groups


def mape(members, family: str, eff: float, overhead_ms: float, gpu: str) -> float:
    errors = []
    engine = _fit(family, eff, overhead_ms, gpu)
    for row, workload in members:
        plan, _ = plan_of(row, engine, workload)
        errors.append(abs(predicted(plan, row["metric"].strip(), int(row["osl"]), row, engine, workload)
                          / float(row["value"]) - 1))
    return statistics.mean(errors)


def search(members, family: str, gpu: str) -> tuple[float, float, float]:
    """(MAPE, efficiency, overhead ms) at the best point of a coarse grid, then of a fine one around it."""
    best = min((mape(members, family, e, o, gpu), e, o) for e in COARSE[0] for o in COARSE[1])
    _, eff, ovh = best
    fine = [(round(eff + 0.01 * i, 3), round(ovh + 0.1 * j, 2)) for i in range(-4, 5) for j in range(-4, 5)]
    return min([best] + [(mape(members, family, e, o, gpu), e, o) for e, o in fine if 0 < e <= 1 and o >= 0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", required=True)
    parser.add_argument("--write", action="store_true", help="store the fits in " + str(ENGINES_FILE.name))
    args = parser.parse_args(argv)
    catalog = json.loads(ENGINES_FILE.read_text())
    today = datetime.date.today().isoformat()
    for (family, gpu), members in sorted(group_rows(Path(args.csv)).items()):
        unfitted = replace(resolve_engine(family, gpu)[0], fit=None, host_overhead_ms=0.0)  # the roofline, the cap
        generic = statistics.mean(abs(predicted(plan_of(r, unfitted, w)[0], r["metric"].strip(), int(r["osl"]), r,
                                                unfitted, w) / float(r["value"]) - 1) for r, w in members)
        if len(members) < MIN_ROWS:
            print(f"{family:9} {gpu:10} {len(members):3} rows: too few to fit (generic MAPE {generic:.1%})")
            continue
        error, eff, ovh = search(members, family, gpu)
        print(f"{family:9} {gpu:10} {len(members):3} rows: hbm_efficiency {eff:.2f}, step_overhead_ms {ovh:.2f}: "
              f"MAPE {error:.1%} (generic roofline {generic:.1%})")
        source = (f"fitted by benchmarks/fit_serving.py on {today} over the {len(members)} predicted {family} rows on "
                  f"{gpu} of {Path(args.csv).name} (MAPE {error:.1%}; the generic roofline's {generic:.1%})")
        fit = {"gpu": gpu, "hbm_efficiency": eff, "step_overhead_ms": ovh,
               "sources": {"hbm_efficiency": source, "step_overhead_ms": source}}
        engine = next(e for e in catalog["engines"] if e["name"] == family)
        engine["fits"] = [f for f in engine["fits"] if f["gpu"] != gpu] + [fit]
    if args.write:
        ENGINES_FILE.write_text(json.dumps(catalog, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
