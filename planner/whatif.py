"""What-if sweeps: the best plan per hardware x GPU count, in time and dollars.

Each target is planned from scratch: a layout that is best (or even fits) on
one machine rarely is on another, so carrying a layout over would compare
the wrong things. When nothing fits a target the row says so instead of
vanishing, so a sweep's table always has one row per target. Interconnect
what-ifs (`nic_gbps`, `intra_gbps`) go through `hardware.load`'s overrides and
show up in the row's hardware sources as user overrides.
"""
from __future__ import annotations

import functools
import inspect

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

import hardware
from layout.plan import Plan
from hardware.errors import HardwareError, InfeasibleError, ParallaxError
from hardware.schema import Cluster

PlanFn = Callable[..., Plan]


@dataclass
class WhatIfRow:
    hardware: str  # spec, e.g. "64xh100-sxm"
    gpu: str
    n_gpus: int
    plan: Plan | None
    price_per_gpu_hour: float | None
    tokens: float | None
    notes: list[str] = field(default_factory=list)
    scaling_efficiency: float | None = None  # throughput per GPU relative to this hardware's smallest count
    goodput: Any = None  # costmodel.goodput.Goodput: expected useful fraction under failures, Young interval

    @property
    def goodput_fraction(self) -> float | None:
        return None if self.goodput is None else self.goodput.goodput

    @property
    def checkpoint_interval_s(self) -> float | None:
        return None if self.goodput is None else self.goodput.optimal_interval_s

    @property
    def feasible(self) -> bool:
        return self.plan is not None and self.plan.estimate is not None

    @property
    def layout(self) -> str:
        if not self.feasible:
            return "-"
        p = self.plan
        policies = {pol for stage in p.stages for pol in stage.recompute}
        recompute = policies.pop() if len(policies) == 1 else "mixed"
        return f"{p.layout_tag} rc:{recompute}"

    def _est(self, name: str) -> float | None:
        return getattr(self.plan.estimate, name) if self.feasible else None

    @property
    def step_time_s(self) -> float | None:
        return self._est("step_time_s")

    @property
    def tokens_per_s(self) -> float | None:
        return self._est("tokens_per_s")

    @property
    def mfu(self) -> float | None:
        return self._est("mfu")

    @property
    def memory_headroom(self) -> float | None:
        """Fraction of usable GPU memory left at the peak."""
        if not self.feasible:
            return None
        est = self.plan.estimate
        return 1.0 - est.held_bytes / est.memory_capacity_bytes

    @property
    def usd_per_hour(self) -> float | None:
        return None if self.price_per_gpu_hour is None else self.price_per_gpu_hour * self.n_gpus

    @property
    def time_to_train_s(self) -> float | None:
        if self.tokens is None or not self.feasible:
            return None
        return self.tokens / self.tokens_per_s

    @property
    def usd_to_train(self) -> float | None:
        t = self.time_to_train_s
        return None if t is None or self.usd_per_hour is None else self.usd_per_hour * t / 3600

    @property
    def usd_per_million_tokens(self) -> float | None:
        if self.usd_per_hour is None or not self.feasible:
            return None
        return self.usd_per_hour / 3600 / self.tokens_per_s * 1e6


def _default_plan_fn() -> PlanFn:
    """`planner.plan`, looked up at call time so a sweep always uses the current planner."""
    import planner

    fn = getattr(planner, "plan", None)
    if fn is None:
        raise ParallaxError("planner", "planner.plan is not available in this build", "pass plan_fn=...")
    return fn


def target_clusters(spec: str, gpu_counts: list[int] | None, **overrides: Any) -> list[Cluster]:
    """One cluster per GPU count (or the spec's own count), with interconnect overrides applied."""
    base = hardware.load(spec)
    if not gpu_counts:
        return [hardware.load(base, **overrides)]
    out = []
    for n in gpu_counts:
        if not isinstance(n, int) or n <= 0:
            raise HardwareError("gpus", f"{n!r} is not a positive GPU count", "e.g. 64,128,256")
        out.append(hardware.load(f"{n}x{base.name}", **overrides))
    return out


def whatif(
    model: Any,
    hw_specs: list[str],
    gpu_counts: list[int] | None = None,
    *,
    global_batch: int,
    seq_len: int,
    tokens: float | None = None,
    price_per_gpu_hour: float | None = None,
    nic_gbps: float | None = None,
    intra_gbps: float | None = None,
    plan_fn: PlanFn | None = None,
    time_limit_s: float = 2.0,
    storage_gbps: float | None = None,
    restart_s: float | None = None,
    dtype: str = "bf16",
) -> list[WhatIfRow]:
    """Plan `model` on every hardware x GPU count; one row per target, infeasible ones included
    (an FP8 sweep lists the GPUs without an FP8 peak with the reason)."""
    if not hw_specs:
        raise HardwareError("hw", "no hardware given", "pass at least one spec, e.g. 64xh100-sxm")
    if tokens is not None and not tokens > 0:
        raise ParallaxError("tokens", f"{tokens!r} is not a positive token budget", "e.g. 2e12")
    fn = plan_fn or _default_plan_fn()
    if "time_limit_s" in inspect.signature(fn).parameters:
        # a sweep plans many targets: each gets a short solver budget (named
        # models are traced once, workload_for caches them)
        fn = functools.partial(fn, time_limit_s=time_limit_s)
    if dtype != "bf16":
        fn = functools.partial(fn, dtype=dtype)
    overrides = dict(nic_gbps=nic_gbps, intra_gbps=intra_gbps, price_per_gpu_hour=price_per_gpu_hour)
    rows = []
    for spec in hw_specs:
        clusters = target_clusters(spec, gpu_counts, **overrides)
        group = [_row(model, cluster, fn, global_batch, seq_len, tokens) for cluster in clusters]
        for row, cluster in zip(group, clusters):
            row.goodput = _goodput(model, cluster, storage_gbps, restart_s, seq_len)
        _scaling(group)
        rows += group
    return rows


def _row(model, cluster: Cluster, fn: PlanFn, global_batch: int, seq_len: int, tokens) -> WhatIfRow:
    row = WhatIfRow(hardware=cluster.spec(), gpu=cluster.gpu.name, n_gpus=cluster.n_gpus, plan=None,
                    price_per_gpu_hour=cluster.price_per_gpu_hour, tokens=tokens)
    for key in ("nic_gbps", "link_gbps"):
        source = cluster.sources.get(key) or cluster.node.sources.get(key)
        if source == "user override":
            row.notes.append(f"{key} overridden")
    if cluster.price_per_gpu_hour is None:
        row.notes.append("no price known: pass price_per_gpu_hour")
    try:
        plan = fn(model, cluster, global_batch=global_batch, seq_len=seq_len)
    except InfeasibleError as error:
        row.notes.append(f"nothing fits: {error}")
        return row
    except ParallaxError as error:  # e.g. global_batch not divisible on this many GPUs
        row.notes.append(f"no plan: {error}")
        return row
    if plan.estimate is not None and not plan.estimate.fits:
        row.notes.append("best layout does not fit in memory")
    row.plan = plan
    return row


def _goodput(model, cluster: Cluster, storage_gbps, restart_s, seq_len: int):
    """Expected goodput at Young's interval (costmodel/goodput.py), when the parameter count and MTBF are known."""
    from costmodel.goodput import goodput
    from costmodel.workload import Workload

    if cluster.gpu.mtbf_hours is None:
        return None
    if not isinstance(model, Workload):
        try:  # named models are traced once (workload_for caches them)
            from planner.resolve import resolve_workload

            model = resolve_workload(model, seq_len=seq_len, dtype="bf16")
        except ParallaxError:
            return None
    return goodput(model.params, cluster, storage_gbps=storage_gbps, restart_s=restart_s)


def _scaling(rows: list[WhatIfRow]) -> None:
    """Throughput per GPU relative to the smallest feasible count of the same hardware."""
    feasible = sorted((r for r in rows if r.feasible), key=lambda r: r.n_gpus)
    if not feasible:
        return
    base = feasible[0].tokens_per_s / feasible[0].n_gpus
    for r in feasible:
        r.scaling_efficiency = r.tokens_per_s / r.n_gpus / base


def amdahl_serial_fraction(gpus: list[int], throughput: list[float]) -> float | None:
    """Least-squares serial fraction s of Amdahl's law relative to the smallest count n0.

    Time per token T(n)/T(n0) = s + (1 - s) * n0/n, i.e. y = s * x with
    y = T(n)/T(n0) - n0/n and x = 1 - n0/n; fitted with numpy's lstsq.
    """
    if len(gpus) < 2:
        return None
    n = np.asarray(gpus, dtype=float)
    t = 1.0 / np.asarray(throughput, dtype=float)
    order = np.argsort(n)
    n, t = n[order], t[order]
    ratio = n[0] / n
    x = (1.0 - ratio)[:, None]
    y = t / t[0] - ratio
    if not np.any(x):
        return None
    s, *_ = np.linalg.lstsq(x, y, rcond=None)
    return float(min(1.0, max(0.0, s[0]))) + 0.0  # + 0.0: no "-0.000" in labels
