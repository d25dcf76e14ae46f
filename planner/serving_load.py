"""Load on a serving deployment, simulated (`costmodel.simulate.serving`): TTFT and TPOT
percentiles against the request rate, and the highest rate each layout sustains under p99 SLOs.

`serve-plan` sizes a deployment by closed formulas at a mean operating point. This module answers
what an operator asks next: what p99 TTFT and TPOT does a given rate bring, how many requests/s
can this hardware take while p99 TTFT <= X and p99 TPOT <= Y, and how few GPUs take a target rate
under them. Poisson arrivals split evenly over the replicas (a split Poisson process is Poisson),
each replica simulated on its own.
"""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from costmodel.simulate.serving import Replica, ServingSimulation, highest_rate, simulate_rate
from hardware.engines import ServingEngine
from hardware.errors import PlanError
from hardware.limits import MAX_SEQ_LEN, check_count, check_positive
from hardware.untrusted import read_text
from planner.inference import expert_models, layouts, plan_inference, serving_model_for
from planner.resolve import model_name, resolve_hardware
from planner.serving_points import meets_pins

MAX_LENGTH_ROWS = 100_000


class EngineLoad(BaseModel):
    """The scheduler settings the simulation ran, as an engine is told them."""

    model_config = ConfigDict(extra="forbid")
    max_sequences: int
    max_batched_tokens: int
    block_size: int
    kv_cache_tokens: int


class TargetLoad(BaseModel):
    """The fewest replicas of one layout that take a target rate with the p99 SLOs met."""

    model_config = ConfigDict(extra="forbid")
    replicas: int = Field(ge=1)
    gpus: int = Field(ge=1)
    fits: bool = Field(description="within the GPUs the hardware gives")
    at: ServingSimulation = Field(description="one replica at its share of the rate")


class LayoutLoad(BaseModel):
    """One deployment layout under load: the replicas' simulated figures at each total rate."""

    model_config = ConfigDict(extra="forbid")
    tp: int
    pp: int
    replicas: int
    engine: EngineLoad
    points: list[ServingSimulation] = Field(description="per replica, at each total rate / replicas")
    highest_rate: float | None = Field(None, description="total requests/s meeting the p99 SLOs (SLO search only)")
    at_highest: ServingSimulation | None = Field(None, description="a replica's figures at that rate")
    at_target: TargetLoad | None = Field(None, description="the fewest replicas for the target rate (None: even one "
                                         "request misses the SLOs)")


class LoadReport(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    hardware: str
    prompt_len: float = Field(description="mean prompt tokens of the request mix")
    output_len: float = Field(description="mean output tokens")
    lengths: str = Field(description="fixed, or the file the lengths were drawn from")
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    target_rate: float | None = Field(None, description="total requests/s to serve with the fewest GPUs")
    gpus_available: int = Field(ge=1, description="the GPUs the hardware gives")
    engine: str = Field("generic", description="the engine family priced (hardware/engines.py)")
    quantization: str = Field("none", description="the weights' weight-only quantization")
    expert_parallel: bool = Field(False, description="whole experts on each TP rank (a mixture of experts)")
    layouts: list[LayoutLoad] = Field(description="best first")

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


def read_lengths(path: Path) -> list[tuple[int, int]]:
    """(prompt, output) token pairs from a CSV with columns `prompt_len,output_len` (or `isl,osl`)."""
    text = read_text(path, "--lengths", "request-lengths CSV")
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows or len(rows) > MAX_LENGTH_ROWS:
        raise PlanError("--lengths", f"{path} holds {len(rows)} requests", f"give 1 to {MAX_LENGTH_ROWS:,} rows under "
                        "a header prompt_len,output_len")
    names = next((pair for pair in (("prompt_len", "output_len"), ("isl", "osl")) if set(pair) <= set(rows[0])), None)
    if names is None:
        raise PlanError("--lengths", f"{path} has columns {', '.join(rows[0])}", "name them prompt_len,output_len "
                        "(or isl,osl)")
    out = []
    for i, row in enumerate(rows, start=2):
        pair = []
        for name in names:
            try:
                value = int(row[name])
            except (TypeError, ValueError):
                raise PlanError("--lengths", f"{path} line {i}: {name} {row[name]!r} is not a whole number",
                                "token counts, e.g. 512") from None
            check_count(name, value, MAX_SEQ_LEN, hint="token counts, e.g. 512")
            pair.append(value)
        out.append((pair[0], pair[1]))
    return out


def _model_and_layouts(model: Any, hw, lengths, dtype: str, kv_dtype: str, fixed: dict, engine: str, quantization: str,
                       expert_parallel: bool):
    cluster = resolve_hardware(hw)
    prompt = round(sum(p for p, _ in lengths) / len(lengths))
    output = round(sum(o for _, o in lengths) / len(lengths))
    sm, _ = serving_model_for(model, cluster, prompt_len=prompt, output_len=output, dtype=dtype, kv_dtype=kv_dtype,
                              engine=engine, quantization=quantization)
    sm = expert_models(sm, expert_parallel, cluster)[0]
    chosen = [(tp, pp) for tp, pp in layouts(sm.w, cluster, expert_parallel)
              if meets_pins(fixed, tp, pp, cluster.n_gpus) and sm.max_sequences(tp, pp) >= 1]
    if not chosen:
        raise PlanError("tp" if "tp" in fixed else "hw", f"no serving layout of {sm.w.name} fits {cluster.spec()}"
                        + (f" with {fixed}" if fixed else ""), "add GPUs, or pin a layout `serve-plan` lists")
    return cluster, sm, chosen


def _engine_load(replica: Replica) -> EngineLoad:
    return EngineLoad(max_sequences=replica.max_sequences, max_batched_tokens=replica.max_batched_tokens,
                      block_size=replica.block_size, kv_cache_tokens=replica.kv_blocks * replica.block_size)


def _check(rates, slo_ttft_ms, slo_tpot_ms, target_rate) -> None:
    for rate in rates:
        check_positive("rate", rate, "requests per second, e.g. 5")
    if target_rate is not None:
        check_positive("target_rate", target_rate, "requests per second, e.g. 20")
        if slo_ttft_ms is None and slo_tpot_ms is None:
            raise PlanError("target_rate", "the fewest GPUs for a rate are judged by p99 SLOs, and none is given",
                            "add --slo-ttft-ms and/or --slo-tpot-ms")
    for name, value in (("slo_ttft_ms", slo_ttft_ms), ("slo_tpot_ms", slo_tpot_ms)):
        if value is not None:
            check_positive(name, value, "milliseconds, e.g. 500")
    if not rates and slo_ttft_ms is None and slo_tpot_ms is None:
        raise PlanError("rates", "nothing to simulate", "give --rates, or an SLO (--slo-ttft-ms, --slo-tpot-ms) to "
                        "find the highest rate meeting it")


def load_report(model: Any, hw, *, lengths: list[tuple[int, int]], rates: list[float], lengths_source: str = "fixed",
                slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None, dtype: str = "bf16",
                kv_dtype: str = "auto", fixed: dict | None = None, requests: int = 600, seed: int = 0,
                top_k: int = 3, engine: "str | ServingEngine" = "generic", quantization: str = "none",
                expert_parallel: bool = False, target_rate: float | None = None) -> LoadReport:
    """Every fitting (tp, pp) layout, replicated over the GPUs, simulated at each total rate; with
    SLOs, each layout's highest total rate meeting the p99s too, and with a target rate the fewest
    replicas that take it. Best first: the fewest GPUs for the target, else the highest SLO rate,
    else the lowest p99 TTFT at the highest rate given."""
    _check(rates, slo_ttft_ms, slo_tpot_ms, target_rate)
    fixed = dict(fixed or {})
    cluster, sm, chosen = _model_and_layouts(model, hw, lengths, dtype, kv_dtype, fixed, engine, quantization,
                                             expert_parallel)
    out = []
    for tp, pp in chosen:
        replicas = fixed.get("replicas", cluster.n_gpus // (tp * pp))
        replica = Replica.of(sm, tp, pp)
        points = [simulate_rate(replica, rate / replicas, lengths, requests, seed, slo_ttft_ms, slo_tpot_ms)
                  for rate in rates]
        best, at, target = None, None, None
        if slo_ttft_ms is not None or slo_tpot_ms is not None:
            best, at = highest_rate(replica, lengths, slo_ttft_ms, slo_tpot_ms, requests, seed)
            if target_rate is not None and best > 0:
                need = math.ceil(target_rate / best)
                share = simulate_rate(replica, target_rate / need, lengths, requests, seed, slo_ttft_ms, slo_tpot_ms)
                target = TargetLoad(replicas=need, gpus=need * tp * pp, fits=need * tp * pp <= cluster.n_gpus, at=share)
            best *= replicas
        out.append(LayoutLoad(tp=tp, pp=pp, replicas=replicas, engine=_engine_load(replica), points=points,
                              highest_rate=best, at_highest=at, at_target=target))
    out.sort(key=lambda lay: (lay.at_target.gpus if lay.at_target else math.inf, -(lay.highest_rate or 0.0),
                              lay.points[-1].ttft_ms.p99 if lay.points else 0.0))
    return LoadReport(model=model_name(model, sm.w), hardware=cluster.spec(), prompt_len=sm.prompt_len,
                      output_len=sm.output_len, lengths=lengths_source, slo_ttft_ms=slo_ttft_ms, engine=sm.engine_name,
                      target_rate=target_rate, gpus_available=cluster.n_gpus,
                      quantization=quantization, expert_parallel=expert_parallel,
                      slo_tpot_ms=slo_tpot_ms, layouts=out[:top_k])


def plan_at_highest_rate(report: LoadReport, model: Any, hw, *, dtype: str = "bf16", kv_dtype: str = "auto",
                         engine: str = "generic"):
    """The best layout of an SLO search as a serving plan (`planner.inference.InferencePlan`) at its
    operating point: the target rate on its fewest replicas where the report has a target, else
    the highest rate it sustained; its degrees and replicas pinned, priced at the simulated mean
    batch and in the report's quantization, and stating the rate. That is what `parallax export`
    turns into an engine's command line. None when no layout met the SLOs on the GPUs given."""
    best = report.layouts[0] if report.layouts else None
    point = _operating_point(best, report) if best is not None else None
    if point is None:
        return None
    replicas, rate, simulated = point
    batch = max(1, round(simulated.mean_batch)) * replicas  # the simulated operating point
    plan = plan_inference(model, hw, prompt_len=round(report.prompt_len), output_len=round(report.output_len),
                          batch=batch, dtype=dtype, kv_dtype=kv_dtype, engine=engine, top_k=1,
                          quantization=report.quantization, expert_parallel=report.expert_parallel,
                          fixed={"tp": best.tp, "pp": best.pp, "replicas": replicas})
    note = (f"operating point from serve-load's simulation: {rate:.2f} requests/s, p99 TTFT "
            f"{simulated.ttft_ms.p99:,.0f} ms, p99 TPOT {simulated.tpot_ms.p99:.1f} ms (mean batch {simulated.mean_batch:.1f})")
    return plan.model_copy(update={"batch": None, "request_rate": rate, "slo_ttft_ms": report.slo_ttft_ms,
                                   "slo_tpot_ms": report.slo_tpot_ms, "tokens_per_s": rate * report.output_len,
                                   "capacity_requests_per_s": rate, "notes": [*plan.notes, note]})


def _operating_point(best: LayoutLoad, report: LoadReport) -> tuple[int, float, ServingSimulation] | None:
    """(replicas, total rate, one replica's figures) the plan is priced at."""
    if report.target_rate is not None:
        target = best.at_target
        return None if target is None or not target.fits else (target.replicas, report.target_rate, target.at)
    if not best.highest_rate or best.at_highest is None:
        return None
    return best.replicas, best.highest_rate, best.at_highest
