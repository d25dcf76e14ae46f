"""Inference deployment planning: TP, PP and replica count for serving a model.

`plan_inference` prices every (tp, pp, replicas) that fits the GPUs with the
serving cost model (`costmodel.inference`), at an operating point set by the
request:

* `batch`: total concurrent sequences, spread evenly over the replicas;
* `request_rate`: requests/s; each replica's mean concurrency B solves
  Little's law B = rate/replicas * (TTFT(B) + output_len * TPOT(B)) (a replica
  whose capacity is below its share is overloaded, i.e. infeasible);
* neither: each replica runs the largest batch that fits and meets the SLO.

Objective "throughput": the most output tokens/s meeting the SLO (with a
request rate, which fixes the throughput, the lowest TPOT). Objective
"cost": the fewest $ per 1M output tokens (GPU-hours when no price is known).
When no layout meets the SLO the plan is flagged `feasible=False` and carries
the best achievable TPOT and TTFT; when nothing fits in memory at all an
`InfeasibleError` says by how much.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from costmodel.inference import SERVING_MEMORY_RESERVE, ServingEstimate, ServingModel
from costmodel.serving_memory import KV_DTYPE_BYTES
from costmodel.validate import check_dtype, check_fp8
from costmodel.workload import Workload
from hardware.engines import ServingEngine, quantization_names, resolve_engine, weight_quantization
from hardware.errors import InfeasibleError, ModelError, ParallaxError, PlanError
from hardware.limits import MAX_GPUS, MAX_REQUESTS, MAX_SEQ_LEN, check_count, check_positive
from hardware.schema import Cluster
from hardware.untrusted import SafeName

from layout.plan import DTYPES
from planner.resolve import model_name, resolve_hardware, resolve_workload
from planner.search.space import divisors
from planner.serving_points import (Point, distinct, layouts, priced_points, rank_key, rate_capacity, slo_ratio,
                                    total_tps)

GIB = 2**30
SCHEMA_VERSION = 5  # 2: kv_dtype; 3: engine; 4: quantization; 5: expert_parallel


class InferencePlan(BaseModel):
    """A serving deployment: `replicas` copies of a tp x pp model-parallel group."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1, 2, 3, 4, 5] = SCHEMA_VERSION
    model: SafeName
    hardware: SafeName
    dtype: str = "bf16"
    kv_dtype: Literal["auto", "bf16", "fp16", "fp8"] = Field(
        "auto", description="the KV cache's element type; auto: the activations' 16-bit type")
    engine: str = Field("generic", description="the serving engine family priced (hardware/engines.py): its fitted "
                        "HBM efficiency and per-iteration overhead; generic: the roofline alone")
    quantization: str = Field("none", description="weight-only quantization, none or a method of "
                              "hardware/catalog/engines/weight_quantization.json; fp8 weights are dtype fp8")
    expert_parallel: bool = Field(False, description="a mixture of experts: each TP rank holds whole experts "
                                  "(vLLM's --enable-expert-parallel, --ep-size tp), not a slice of every one")
    prompt_len: int = Field(gt=0)
    output_len: int = Field(gt=0)
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    replicas: int = Field(ge=1)
    gpus_used: int = Field(ge=1)
    gpus_available: int = Field(ge=1)
    batch_per_replica: float = Field(gt=0, description="mean concurrent sequences per replica")
    objective: Literal["throughput", "cost"] = "throughput"
    batch: int | None = None
    request_rate: float | None = None
    slo_tpot_ms: float | None = None
    slo_ttft_ms: float | None = None
    feasible: bool = True
    memory_reserve: float = Field(SERVING_MEMORY_RESERVE, ge=0, lt=1, description="share of GPU memory kept free")
    estimate: ServingEstimate
    tokens_per_s: float = Field(description="output tokens/s of the whole deployment")
    capacity_requests_per_s: float = Field(description="requests/s the deployment sustains at this operating point")
    usd_per_hour: float | None = None
    best_achievable: dict[str, float] = Field(default_factory=dict, description="lowest TPOT/TTFT of any layout (ms)")
    alternatives: list["InferencePlan"] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)

    @field_validator("quantization")
    @classmethod
    def _known_quantization(cls, value: str) -> str:
        if value != "none" and value not in quantization_names():
            raise ValueError(f"unknown weight quantization {value!r}; use none, {', '.join(quantization_names())}")
        return value

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str) -> "InferencePlan":
        return cls.model_validate_json(text)


def _check(prompt_len, output_len, batch, request_rate, slo_tpot_ms, slo_ttft_ms, objective, dtype) -> None:
    for name, value in (("prompt_len", prompt_len), ("output_len", output_len)):
        check_count(name, value, MAX_SEQ_LEN, hint="e.g. 2048")
    if batch is not None and request_rate is not None:
        raise PlanError("batch/request_rate", "give one of them, not both", "--batch N or --rate R")
    if batch is not None:
        check_count("batch", batch, MAX_REQUESTS, hint="concurrent sequences, e.g. 64")
    if request_rate is not None:
        check_positive("request_rate", request_rate, "requests per second, e.g. 5")
    for name, value in (("slo_tpot_ms", slo_tpot_ms), ("slo_ttft_ms", slo_ttft_ms)):
        if value is not None:
            check_positive(name, value, "milliseconds, e.g. 50")
    if objective not in ("throughput", "cost"):
        raise PlanError("objective", f"unknown objective {objective!r}", "use 'throughput' or 'cost'")
    if dtype not in DTYPES:
        raise PlanError("dtype", f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPES)}")


def expert_models(sm: ServingModel, expert_parallel: bool | None, cluster: Cluster) -> list[ServingModel]:
    """The expert placements to price: a pinned one, else both for a mixture of experts."""
    if expert_parallel is None:
        return [sm, sm.with_expert_parallel(True)] if sm.w.n_experts else [sm]
    if expert_parallel and not sm.w.n_experts:
        raise PlanError("expert_parallel", f"{sm.w.name} has no experts to place", "leave --expert-parallel off")
    if expert_parallel and not layouts(sm.w, cluster, expert_parallel=True):
        raise PlanError("expert_parallel", f"the {sm.w.n_experts} experts of {sm.w.name} split evenly over no TP "
                        f"degree of 2 or more that {cluster.spec()} offers", "add GPUs, or leave --expert-parallel off")
    return [sm.with_expert_parallel(expert_parallel)]


PINNED = ("tp", "pp", "replicas")


def check_kv_dtype(kv_dtype: str, cluster: Cluster) -> None:
    """A KV dtype the engines take; an FP8 cache only where the GPU has FP8 (its profile's fp8 peak)."""
    if kv_dtype not in ("auto", *KV_DTYPE_BYTES):
        raise PlanError("kv_dtype", f"unknown KV cache dtype {kv_dtype!r}", f"use auto, {', '.join(KV_DTYPE_BYTES)}")
    if kv_dtype == "fp8":
        check_fp8(cluster, "kv_dtype", "an fp8 KV cache needs FP8 support", "auto (16-bit)")


def _check_pins(fixed: dict) -> dict[str, int]:
    for key, value in fixed.items():
        if key not in PINNED:
            raise PlanError(key, "is not a serving pin", f"pin any of {', '.join(PINNED)}")
        check_count(key, value, MAX_GPUS, hint="e.g. 4")
    return dict(fixed)


def _pins_fit_nothing(fixed: dict, workload: Workload, cluster: Cluster) -> PlanError:
    pins = " ".join(f"{k}={v}" for k, v in fixed.items())
    valid = ", ".join(f"tp={tp} pp={pp}" for tp, pp in layouts(workload, cluster)[:8])
    return PlanError(next(iter(fixed)), f"{pins}: no such deployment of {workload.name} fits {cluster.spec()} "
                     "(tp x pp divides the heads and the GPUs, tp x pp x replicas fits the GPUs, the weights fit)",
                     f"valid layouts: {valid}")


def _pins_take_nothing(fixed: dict, floor: list[Point], sm: ServingModel, cluster: Cluster, batch: int | None,
                       rate: float | None) -> ParallaxError:
    """The pinned deployment fits, but not the load asked of it: a rate beyond its replicas'
    capacity, or a batch of fewer sequences than the replicas pinned."""
    pins = " ".join(f"{k}={v}" for k, v in fixed.items())
    if rate is None and "replicas" not in fixed:
        return _pins_fit_nothing(fixed, sm.w, cluster)
    if rate is None:
        return PlanError("replicas", f"{pins}: a batch of {batch} sequences leaves some of the {fixed['replicas']} "
                         "replicas pinned without one", f"a batch of at least {fixed['replicas']}, or --replicas {batch} "
                         "or fewer")
    def capacity_of(p: Point) -> tuple[float, int]:
        replicas = fixed.get("replicas", cluster.n_gpus // (p.tp * p.pp))
        return rate_capacity(sm.with_expert_parallel(p.expert_parallel), p.tp, p.pp) * replicas, replicas

    best = max(floor, key=lambda p: capacity_of(p)[0])
    capacity, replicas = capacity_of(best)
    return InfeasibleError(
        "request_rate", f"{pins}: {rate:g} requests/s overloads it: {replicas} replica(s) of tp={best.tp} pp={best.pp} "
        f"take at most {capacity:.3g} requests/s of {sm.prompt_len} + {sm.output_len} tokens on {cluster.spec()}",
        f"a rate below {capacity:.3g}, more replicas or GPUs, or `parallax serve-load --rates {rate:g}` to see the "
        "queue it builds", report={"capacity_requests_per_s": capacity, "tp": best.tp, "pp": best.pp,
                                   "replicas": replicas})


def plan_inference(
    model: Any,
    hw: str | Cluster,
    *,
    prompt_len: int,
    output_len: int,
    batch: int | None = None,
    request_rate: float | None = None,
    slo_tpot_ms: float | None = None,
    slo_ttft_ms: float | None = None,
    objective: str = "throughput",
    dtype: str = "bf16",
    top_k: int = 3,
    price_per_gpu_hour: float | None = None,
    memory_reserve: float = SERVING_MEMORY_RESERVE,
    fixed: dict[str, int] | None = None,
    kv_dtype: str = "auto",
    engine: str | ServingEngine = "generic",
    quantization: str = "none",
    expert_parallel: bool | None = None,
) -> InferencePlan:
    """The best serving layout of `model` on `hw` for the request mix and SLO; `fixed` pins any of
    tp, pp and replicas (an operator's deployment, priced as it stands), `expert_parallel` the
    experts' placement of a mixture of experts (None: both are priced)."""
    _check(prompt_len, output_len, batch, request_rate, slo_tpot_ms, slo_ttft_ms, objective, dtype)
    fixed = _check_pins(fixed or {})
    cluster = resolve_hardware(hw, price_per_gpu_hour=price_per_gpu_hour)
    sm, engine_note = serving_model_for(model, cluster, prompt_len=prompt_len, output_len=output_len, dtype=dtype,
                                        kv_dtype=kv_dtype, engine=engine, memory_reserve=memory_reserve,
                                        quantization=quantization)
    workload = sm.w
    points, floor = [], []
    for model_of in expert_models(sm, expert_parallel, cluster):
        priced, lowest = priced_points(model_of, workload, cluster, batch, request_rate, slo_tpot_ms, slo_ttft_ms, fixed)
        points, floor = points + priced, floor + lowest
    if not floor:
        raise _nothing_fits(sm, workload, cluster) if not fixed else _pins_fit_nothing(fixed, workload, cluster)
    if fixed and not points:
        raise _pins_take_nothing(fixed, floor, sm, cluster, batch, request_rate)
    notes = [engine_note] if engine_note else []
    price = cluster.price_per_gpu_hour
    if price is None:
        notes.append(f"no price is known for {cluster.gpu.name}: $ figures are omitted"
                     + ("; cost ranked by GPU-hours per 1M tokens" if objective == "cost" else ""))
    best_tpot = min(floor, key=lambda p: p.est.tpot_s)
    best_ttft = min(floor, key=lambda p: p.est.ttft_s)
    achievable = {"tpot_ms": best_tpot.est.tpot_s * 1e3, "tpot_tp": best_tpot.tp, "tpot_pp": best_tpot.pp,
                  "ttft_ms": best_ttft.est.ttft_s * 1e3, "ttft_tp": best_ttft.tp, "ttft_pp": best_ttft.pp}
    feasible = [p for p in points if p.feasible]
    if feasible:
        ranked = sorted(feasible, key=lambda p: rank_key(p, objective, request_rate, output_len, price))
    else:
        if not points:
            raise InfeasibleError("request_rate", f"{request_rate:g} requests/s overload every layout on {cluster.spec()}",
                                  "lower the rate or add GPUs", report={"best_achievable": achievable})
        ranked = sorted(points, key=lambda p: slo_ratio(p.est, slo_tpot_ms, slo_ttft_ms))
        notes.append("SLO cannot be met: " + ranked[0].why + f"; best achievable TPOT {achievable['tpot_ms']:.1f} ms "
                     f"(tp={best_tpot.tp} pp={best_tpot.pp}, batch 1), TTFT {achievable['ttft_ms']:.1f} ms "
                     f"(tp={best_ttft.tp} pp={best_ttft.pp})")
    name = model_name(model, workload)
    plans = [_to_plan(p, name, cluster, prompt_len, output_len, dtype, objective, batch, request_rate,
                      slo_tpot_ms, slo_ttft_ms, bool(feasible), achievable, notes) for p in distinct(ranked, top_k)]
    plans = [p.model_copy(update={"memory_reserve": memory_reserve, "kv_dtype": kv_dtype, "engine": sm.engine_name,
                                  "quantization": quantization}) for p in plans]
    return plans[0].model_copy(update={"alternatives": plans[1:]})


def serving_model_for(model: Any, cluster: Cluster, *, prompt_len: int, output_len: int, dtype: str = "bf16",
                      kv_dtype: str = "auto", engine: str | ServingEngine = "generic",
                      memory_reserve: float = SERVING_MEMORY_RESERVE, quantization: str = "none",
                      ) -> tuple[ServingModel, str]:
    """The serving model of `model` on `cluster`, its dtypes checked against the GPU, and a note
    when the named engine family has no fit for it (the one door `plan_inference` and
    `planner.serving_load` price by)."""
    check_dtype(dtype, cluster)
    check_kv_dtype(kv_dtype, cluster)
    method = weight_quantization(quantization, cluster.gpu)
    if method is not None and dtype == "fp8":
        raise PlanError("quantization", f"{quantization} weights with dtype fp8: FP8 is itself the weights' format",
                        "use dtype bf16 or fp16 with it, or quantization none")
    workload = resolve_workload(model, seq_len=prompt_len, dtype=dtype, cluster=cluster)
    _check_generates(workload)
    served_by, note = resolve_engine(engine, cluster.gpu)
    sm = ServingModel(workload, cluster, prompt_len=prompt_len, output_len=output_len, dtype=dtype,
                      memory_reserve=memory_reserve, kv_dtype=None if kv_dtype == "auto" else kv_dtype,
                      engine=served_by, quantization=method)
    return sm, note


def _check_generates(workload: Workload) -> None:
    """Serving decodes token by token, each attending to the ones before it: a model whose blocks
    attend both ways (an encoder) generates nothing to decode."""
    if any(seg.layer.kind == "block" and seg.layer.attention is not None and seg.layer.attention.mask == "none"
           for seg in workload.segments):
        raise ModelError("model", f"{workload.name}'s blocks attend both ways (an encoder, as BERT's): it generates no "
                         "tokens, so there is no decode to serve", "serve a decoder, such as llama-3-8b")


def _to_plan(p: Point, name, cluster, prompt_len, output_len, dtype, objective, batch, rate, tpot_ms, ttft_ms,
             feasible, achievable, notes) -> InferencePlan:
    gpus = p.tp * p.pp * p.replicas
    tps = total_tps(p, rate, output_len)
    price = cluster.price_per_gpu_hour
    return InferencePlan(
        model=name, hardware=cluster.spec(), dtype=dtype, prompt_len=prompt_len, output_len=output_len, tp=p.tp, pp=p.pp,
        replicas=p.replicas, gpus_used=gpus, gpus_available=cluster.n_gpus, batch_per_replica=p.est.batch,
        objective=objective, batch=batch, request_rate=rate, slo_tpot_ms=tpot_ms, slo_ttft_ms=ttft_ms,
        feasible=feasible and p.feasible, estimate=p.est, tokens_per_s=tps,
        capacity_requests_per_s=p.est.tokens_per_s_replica * p.replicas / output_len,
        usd_per_hour=price * gpus if price is not None else None, best_achievable=achievable, notes=list(notes),
        expert_parallel=p.expert_parallel,
    )


def _nothing_fits(sm: ServingModel, workload: Workload, cluster: Cluster) -> InfeasibleError:
    n = cluster.n_gpus
    tp = max(d for d in divisors(n) if workload.tp_divides(d))
    pp = max(1, min(workload.n_blocks, n // tp))
    weights = sm.weights_per_gpu(tp, pp)
    per_seq = sm.prompt_len + sm.output_len
    return InfeasibleError(
        "hw", f"{workload.name} does not fit on {cluster.spec()} for serving: even at tp={tp} pp={pp} the weights "
        f"({weights / GIB:.1f} GiB per GPU) and one {per_seq}-token sequence's KV cache exceed the "
        f"{sm.capacity / GIB:.1f} GiB usable per GPU",
        "add GPUs, use GPUs with more memory, or shorten prompt_len + output_len",
        report={"weights_gib_per_gpu": weights / GIB, "capacity_gib": sm.capacity / GIB, "tp": tp, "pp": pp})
