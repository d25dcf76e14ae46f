"""A measured step beside the simulated one: phases of torch.profiler traces, and one merged trace.

The executor's profiler (executor/measure/profiling.py) writes one Chrome trace per rank, each
profiled step a `parallax.step.N` range on the training thread. Every instant of that
thread inside a step is given to the innermost range that names a phase: the loop's own
marks (`parallax.forward` ...), torch's pipeline actions (`PP:0F1`, `Forward 3`), FSDP2's
and c10d's collectives, the optimizer; what no range names is idle (waiting, Python).
Collectives count where the training thread waits on or launches them; gloo runs them on
threads of its own, whose time overlaps compute and is not a phase. Inside a pipeline
action, time with no op running is waiting for the peer stage: idle, the bubble. The simulator's
phases are the critical rank's, from its breakdown (exposed communication, bubble) and
its forward and backward events. Pure data: reads JSON, imports no torch.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .playback import SimResult
from .trace_export import trace_events

STEP = re.compile(r"^parallax\.step\.(\d+)$")
PHASES = ("forward", "backward", "tp", "cp", "ep", "pp", "zero gather", "dp reduce", "optimizer", "idle")
# first match wins; a range's phase is that of the innermost range that has one
RULES: list[tuple[re.Pattern, str]] = [(re.compile(p), phase) for p, phase in (
    (r"all_to_all|alltoall", "ep"),
    (r"^PP:.*(SEND|RECV)|c10d::send|c10d::recv|batch_isend_irecv", "pp"),
    (r"FSDP::all_gather|allgather_into_tensor_coalesced|_allgather_base|c10d::broadcast_", "zero gather"),
    (r"FSDP::post_backward_reduce|reduce_scatter|c10d::allreduce_|^parallax\.sync$", "dp reduce"),
    (r"^_c10d_functional::", "tp"),
    (r"^parallax\.optimizer$|^Optimizer\.(step|zero_grad)", "optimizer"),
    (r"^parallax\.forward$|^Forward \d|^PP:\d+F\d", "forward"),
    (r"^parallax\.backward$|^Backward \d|^PP:\d+[BIW]\d", "backward"),
    (r"^parallax\.pipeline$", "backward"),  # a pipeline stage's time outside its forward marks
)]


# a pipeline schedule's action or the loop's pipeline mark: its bare time is waiting for a peer stage
PIPELINE_ACTION = re.compile(r"^PP:|^Forward \d|^Backward \d|^parallax\.pipeline$")


def phase_of(name: str, cp: bool = False) -> str | None:
    for pattern, phase in RULES:
        if pattern.search(name):
            return "cp" if phase == "tp" and cp and "all_gather" in name else phase
    return None


@dataclass
class RankTrace:
    rank: int
    steps: dict[int, tuple[float, float]]  # step -> (start us, end us)
    events: list[dict]  # complete events, as the profiler wrote them
    main_tid: object


def load_rank(path: Path) -> RankTrace:
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps, tid = {}, None
    for e in events:
        match = STEP.match(e["name"])
        if match:
            steps[int(match.group(1))] = (e["ts"], e["ts"] + e["dur"])
            tid = e["tid"]
    return RankTrace(int(path.stem[4:]), steps, events, tid)


def phase_segments(trace: RankTrace, step: int, cp: bool = False) -> list[tuple[float, float, str]]:
    """(start us, end us, phase) pieces of the training thread during `step`.

    A sweep over the thread's ranges (nested, as one thread's are): each instant belongs to
    the innermost range, which takes the phase its name gives or else its parent's. Bare
    time inside a pipeline action (no op running: waiting for a peer stage) is idle, as is
    time outside every range. gloo's own records (`gloo:*`) time its asynchronous work, not
    the thread's, and are left out."""
    lo, hi = trace.steps[step]
    ranges = sorted(((max(e["ts"], lo), min(e["ts"] + e["dur"], hi), e["name"]) for e in trace.events
                     if e["tid"] == trace.main_tid and e["ts"] < hi and e["ts"] + e["dur"] > lo
                     and not e["name"].startswith("gloo:")), key=lambda r: (r[0], -r[1]))
    out: list[tuple[float, float, str]] = []
    stack = [(hi, "idle", "idle")]  # (end, phase inherited by children, phase of its bare time)
    cursor = lo

    def emit(to: float) -> None:
        nonlocal cursor
        if to > cursor:
            phase = stack[-1][2]
            if out and out[-1][2] == phase and out[-1][1] == cursor:
                out[-1] = (out[-1][0], to, phase)
            else:
                out.append((cursor, to, phase))
            cursor = to

    for start, end, name in ranges:
        while len(stack) > 1 and stack[-1][0] <= start:
            emit(stack[-1][0])
            stack.pop()
        emit(start)
        phase = phase_of(name, cp) or stack[-1][1]
        stack.append((min(end, stack[-1][0]), phase, "idle" if PIPELINE_ACTION.search(name) else phase))
    while stack:
        emit(stack[-1][0])
        stack.pop()
    return out


def step_phases(trace: RankTrace, step: int, cp: bool = False) -> dict[str, float]:
    """Seconds of each phase on the training thread during `step`."""
    out = dict.fromkeys(PHASES, 0.0)
    for a, b, phase in phase_segments(trace, step, cp):
        out[phase] += (b - a) / 1e6
    return out


def measured_phases(traces: list[RankTrace], cp: bool = False) -> tuple[int, dict[str, float]]:
    """(the slowest rank, its phases averaged over the profiled steps)."""
    def mean_step(t: RankTrace) -> float:
        return sum(b - a for a, b in t.steps.values()) / max(1, len(t.steps))

    slow = max(traces, key=mean_step)
    per_step = [step_phases(slow, s, cp) for s in sorted(slow.steps)]
    return slow.rank, {p: sum(d[p] for d in per_step) / len(per_step) for p in PHASES}


# the simulator's event kinds as phases
KIND_PHASE = {"forward": "forward", "backward": "backward", "recompute": "backward", "tp": "tp", "pp": "pp",
              "dp": "dp reduce", "zero_gather": "zero gather", "zero_scatter": "dp reduce", "optimizer": "optimizer"}


def predicted_phases(sim: SimResult) -> dict[str, float]:
    """The simulated critical rank's step in the same phases."""
    rank, b = sim.critical_rank, sim.breakdown_s
    compute = {kind: sum(e.duration for e in sim.events if e.rank == rank and e.stream == "compute" and e.kind == kind)
               for kind in ("forward", "backward", "recompute")}
    return {"forward": compute["forward"], "backward": compute["backward"] + compute["recompute"],
            "tp": b.get("tp_comm", 0.0), "cp": 0.0, "ep": 0.0, "pp": b.get("pp_comm", 0.0),
            "zero gather": b.get("zero_comm", 0.0), "dp reduce": b.get("dp_comm", 0.0),
            "optimizer": b.get("optimizer", 0.0), "idle": b.get("bubble", 0.0)}


def phase_table(measured: dict[str, float], predicted: dict[str, float]) -> list[tuple[str, float, float]]:
    return [(p, measured[p], predicted[p]) for p in PHASES if measured[p] or predicted[p]]


def largest_miss(rows: list[tuple[str, float, float]]) -> str:
    phase, meas, pred = max(rows, key=lambda r: abs(r[1] - r[2]))
    return (f"largest miss: {phase}, measured {meas * 1e3:.1f} ms against {pred * 1e3:.1f} ms predicted "
            f"({(meas - pred) * 1e3:+.1f} ms)")


def merged_trace(traces: list[RankTrace], sim: SimResult, min_us: float = 10.0) -> dict:
    """One Chrome trace: each rank's measured steps as a process ("measured rank r"), and the
    simulated step as processes of their own ("predicted pp rank p"), repeated at the start of
    every measured step (rank 0's); times from the first profiled step's start."""
    out: list[dict] = []
    first = min(traces, key=lambda t: t.rank)
    origin = {t.rank: min(a for a, _ in t.steps.values()) for t in traces}
    for t in traces:
        out.append({"ph": "M", "name": "process_name", "pid": t.rank, "tid": 0, "args": {"name": f"measured rank {t.rank}"}})
        lo, hi = min(a for a, _ in t.steps.values()), max(b for _, b in t.steps.values())
        out += [{**e, "pid": t.rank, "ts": e["ts"] - origin[t.rank]} for e in t.events
                if e["dur"] >= min_us and e["ts"] >= lo and e["ts"] <= hi]
    offset_pid = 1 + max(t.rank for t in traces)
    predicted = trace_events(sim)
    for step in sorted(first.steps):
        start = first.steps[step][0] - origin[first.rank]
        for e in predicted:
            if e["ph"] == "M" and step != min(first.steps):
                continue
            shifted = {**e, "pid": offset_pid + e["pid"]}
            if e["ph"] == "M" and e["name"] == "process_name":
                shifted["args"] = {"name": "predicted " + e["args"]["name"]}
            if e["ph"] == "X":
                shifted["ts"] = e["ts"] + start
            out.append(shifted)
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"layout": sim.plan.layout_tag, "predicted_step_s": sim.step_time_s}}


def read_traces(folder: str | Path) -> list[RankTrace]:
    traces = [load_rank(p) for p in sorted(Path(folder).glob("rank*.json"))]
    return [t for t in traces if t.steps]
