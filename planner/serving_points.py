"""Operating points of serving layouts: each (tp, pp, replicas) a cluster offers, priced by the
serving cost model (`costmodel.inference`) at the request's load, judged against the SLOs and
ranked by the objective. `planner.inference` turns the best into a plan.

* a batch: total concurrent sequences spread evenly over the replicas, those beyond what a
  replica's KV cache holds queued (their wait is in TTFT);
* a request rate: each replica's mean concurrency solves Little's law;
* neither: each replica runs the largest batch that meets the SLOs.
"""
from __future__ import annotations

from dataclasses import dataclass

from costmodel.inference import ServingEstimate, ServingModel
from costmodel.workload import Workload
from hardware.schema import Cluster
from planner.search.space import divisors


@dataclass
class Point:
    tp: int
    pp: int
    replicas: int
    est: ServingEstimate
    feasible: bool
    why: str = ""
    expert_parallel: bool = False


def layouts(workload: Workload, cluster: Cluster, expert_parallel: bool = False) -> list[tuple[int, int]]:
    """(tp, pp) pairs: TP dividing the heads, PP at most the blocks, tp*pp dividing the GPU count;
    with `expert_parallel`, only the TP degrees the experts split over whole (`expert_parallel_fits`)."""
    n = cluster.n_gpus
    out = []
    for tp in (d for d in divisors(n) if workload.tp_divides(d)):
        if expert_parallel and not expert_parallel_fits(workload, tp):
            continue
        for pp in range(1, min(workload.n_blocks, n // tp) + 1):
            if (n // tp) % pp == 0:
                out.append((tp, pp))
    return out


def meets_pins(fixed: dict, tp: int, pp: int, n_gpus: int) -> bool:
    """Whether a (tp, pp) replica is the one `fixed` pins, its pinned replicas within the GPUs."""
    return (fixed.get("tp", tp) == tp and fixed.get("pp", pp) == pp
            and fixed.get("replicas", 1) * tp * pp <= n_gpus)


def meets(est: ServingEstimate, tpot_ms, ttft_ms) -> str:
    why = []
    if tpot_ms is not None and est.tpot_s * 1e3 > tpot_ms * (1 + 1e-9):
        why.append(f"TPOT {est.tpot_s * 1e3:.1f} ms > {tpot_ms:g}")
    if ttft_ms is not None and est.ttft_s * 1e3 > ttft_ms * (1 + 1e-9):
        why.append(f"TTFT {est.ttft_s * 1e3:.1f} ms > {ttft_ms:g}")
    return "; ".join(why)


def largest_batch(sm: ServingModel, tp: int, pp: int, cap: int, tpot_ms, ttft_ms) -> int:
    """Largest batch <= cap meeting the SLO (TPOT and TTFT grow with the batch); 0 if even 1 fails."""
    if meets(sm.estimate(tp, pp, 1), tpot_ms, ttft_ms):
        return 0
    lo, hi = 1, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if meets(sm.estimate(tp, pp, mid), tpot_ms, ttft_ms):
            hi = mid - 1
        else:
            lo = mid
    return lo


def little(sm: ServingModel, tp: int, pp: int, rate: float, cap: int) -> float | None:
    """Mean concurrency B with B = rate * (TTFT + N * TPOT); None when the replica is overloaded."""
    def excess(b: float) -> float:
        return rate * request_lifetime(sm.estimate(tp, pp, b), sm.output_len) - b
    if cap < 1 or excess(cap) > 0:
        return None
    lo, hi = 1e-6, float(cap)
    if excess(lo) <= 0:
        return lo
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    return hi


def request_lifetime(est: ServingEstimate, output_len: int) -> float:
    """Seconds a request lives at `est`'s operating point: its TTFT plus output_len TPOTs."""
    return est.ttft_s + output_len * est.tpot_s


def rate_capacity(sm: ServingModel, tp: int, pp: int) -> float:
    """The most requests/s one replica takes (`little`'s bound): the sequences its KV cache holds
    over a request's lifetime at that batch."""
    cap = sm.max_sequences(tp, pp)
    return cap / request_lifetime(sm.estimate(tp, pp, cap), sm.output_len) if cap >= 1 else 0.0


def queued(sm: ServingModel, tp: int, pp: int, concurrency: int, cap: int) -> ServingEstimate:
    """A replica serving `concurrency` requests in a closed loop: an engine admits as many as
    their KV cache fits (`cap`) and queues the rest, so the batch is the smaller of the two and
    a queued request waits, by Little's law, (concurrency / cap - 1) request lifetimes (its
    TTFT plus output_len TPOTs) before its own prefill."""
    running = min(concurrency, cap)
    est = sm.estimate(tp, pp, running)
    if concurrency <= cap:
        return est
    lifetime = request_lifetime(est, sm.output_len)
    wait = (concurrency / cap - 1) * lifetime
    return est.model_copy(update={"ttft_s": est.ttft_s + wait, "queued_sequences": float(concurrency - cap)})


def priced_points(sm: ServingModel, workload: Workload, cluster: Cluster, batch, rate, tpot_ms, ttft_ms,
            fixed: dict) -> tuple[list[Point], list[Point]]:
    """(every priced point, the points at batch 1 per replica for the best-achievable figures)."""
    points, floor = [], []
    for tp, pp in layouts(workload, cluster, sm.expert_parallel):
        cap = sm.max_sequences(tp, pp)
        if cap < 1 or not meets_pins(fixed, tp, pp, cluster.n_gpus):
            continue
        floor.append(Point(tp, pp, 1, sm.estimate(tp, pp, 1), True))
        max_replicas = min(cluster.n_gpus // (tp * pp), fixed.get("replicas", cluster.n_gpus))
        if batch is None and rate is None:
            b = largest_batch(sm, tp, pp, cap, tpot_ms, ttft_ms)
            est = sm.estimate(tp, pp, max(b, 1))
            points.append(Point(tp, pp, max_replicas, est, b >= 1, "" if b else meets(est, tpot_ms, ttft_ms)))
            continue
        for r in range(fixed.get("replicas", 1), max_replicas + 1):
            if batch is not None:
                if r > batch:
                    break
                est = queued(sm, tp, pp, -(-batch // r), cap)
                why = meets(est, tpot_ms, ttft_ms)
            else:
                b = little(sm, tp, pp, rate / r, cap)
                if b is None:
                    continue
                est = sm.estimate(tp, pp, b)
                why = meets(est, tpot_ms, ttft_ms)
            points.append(Point(tp, pp, r, est, not why, why))
    for point in points + floor:
        point.expert_parallel = sm.expert_parallel
    return points, floor


def expert_parallel_fits(workload: Workload, tp: int) -> bool:
    """Expert parallelism over a replica's TP ranks: more than one rank, each holding as many whole experts."""
    return tp > 1 and workload.n_experts > 0 and workload.n_experts % tp == 0


def total_tps(p: Point, rate, output_len) -> float:
    return rate * output_len if rate is not None else p.est.tokens_per_s_replica * p.replicas


def rank_key(p: Point, objective: str, rate, output_len, price):
    gpus = p.tp * p.pp * p.replicas
    tps = total_tps(p, rate, output_len)
    if objective == "cost":
        per_token = gpus / tps  # GPU-seconds per token; times the price when there is one
        return (per_token * (price or 1.0), -tps, p.est.tpot_s)
    if rate is not None:
        return (p.est.tpot_s, gpus)
    return (-tps, p.est.tpot_s, gpus)


def distinct(ranked: list[Point], k: int) -> list[Point]:
    """The best point of each of the first k distinct (tp, pp, expert placement) layouts."""
    seen, out = set(), []
    for p in ranked:
        if (p.tp, p.pp, p.expert_parallel) not in seen:
            seen.add((p.tp, p.pp, p.expert_parallel))
            out.append(p)
        if len(out) == k:
            break
    return out


def slo_ratio(est: ServingEstimate, tpot_ms, ttft_ms) -> float:
    ratios = [1.0]
    if tpot_ms:
        ratios.append(est.tpot_s * 1e3 / tpot_ms)
    if ttft_ms:
        ratios.append(est.ttft_s * 1e3 / ttft_ms)
    return max(ratios)
