"""Turn the engine's raw timeline into the numbers people read.

Exposed communication is measured, not assumed: for each kind of
asynchronous traffic (pipeline sends, gradient reductions) it is the time
that kind's link is busy while the rank's compute stream is not — an
interval measure, so it can never go negative however much overlap there is.
TP collectives and ZeRO-3 stalls sit inside ops on the critical path and are
exposed by construction.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .engine import Event


@dataclass
class RankSim:
    """One pipeline rank (all its virtual stages) over one step."""

    rank: int
    stages: list[int]
    busy_s: float
    idle_s: float  # compute-stream idle inside the pipeline span
    compute_s: float
    recompute_s: float
    tp_comm_s: float
    zero_wait_s: float
    compute_end_s: float
    end_s: float
    exposed_comm_s: dict[str, float]
    static_memory: dict[str, float]
    memory_timeline: list[tuple[float, float]] = field(repr=False)
    peak_memory_bytes: float = 0.0
    peak_memory_time_s: float = 0.0

    @property
    def peak_activation_bytes(self) -> float:
        return self.peak_memory_bytes - sum(self.static_memory.values())


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def uncovered(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Measure of union(intervals) minus union(cover); both lists merged first."""
    total = 0.0
    cover = merge(cover)
    k = 0
    for a, b in merge(intervals):
        length = b - a
        while k < len(cover) and cover[k][1] <= a:
            k += 1
        j = k
        while j < len(cover) and cover[j][0] < b:
            length -= min(b, cover[j][1]) - max(a, cover[j][0])
            j += 1
        total += max(0.0, length)
    return total


def exposed_by_kind(events: list[Event], rank: int, kinds: tuple[str, ...]) -> dict[str, float]:
    mine = [e for e in events if e.rank == rank]
    cover = [(e.start, e.start + e.duration) for e in mine if e.stream == "compute"]
    return {
        kind: uncovered([(e.start, e.start + e.duration) for e in mine if e.kind == kind and e.stream != "compute"], cover)
        for kind in kinds
    }


def memory_timeline(deltas: list[tuple[float, float]], static: float) -> tuple[list[tuple[float, float]], float, float]:
    """(timeline, peak, time of peak); frees at an instant apply before allocations."""
    level, peak, when = static, static, 0.0
    points = [(0.0, static)]
    for t, d in sorted(deltas):
        level += d
        points.append((t, level))
        if level > peak + 1e-6:
            peak, when = level, t
    return points, peak, when


def breakdown(rank: RankSim, step: float, optimizer: float) -> dict[str, float]:
    """Step time of the critical rank by cause; the parts sum to the step."""
    pp = min(rank.exposed_comm_s.get("pp", 0.0), rank.idle_s)
    tail = max(0.0, step - rank.compute_end_s - optimizer)
    return {
        "compute": rank.compute_s,
        "recompute": rank.recompute_s,
        "tp_comm": rank.tp_comm_s,
        "pp_comm": pp,
        "zero_comm": rank.zero_wait_s,
        "bubble": max(0.0, rank.idle_s - pp),
        "dp_comm": tail,
        "optimizer": optimizer,
    }
