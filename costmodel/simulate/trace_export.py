"""Chrome trace (Perfetto, chrome://tracing) of a simulated step.

One process per pipeline rank, one thread per stream. Communicators that
share a link run concurrently in the simulator (see `engine`), so
each (link, communicator) gets its own thread — Chrome's viewer requires
events on one thread to nest, and overlapping siblings would be drawn wrong.
Times are microseconds, as the format requires.
"""
from __future__ import annotations

import json
from pathlib import Path

from .playback import SimResult

# Thread order inside a rank: compute first, then the links.
_THREADS = ("compute", "tp", "pp", "dp", "zero")


def _thread(stream: str, kind: str) -> str:
    if stream == "compute":
        return "compute"
    group = "zero" if kind.startswith("zero") else kind
    return f"{stream} {group}"


def _tid(name: str) -> int:
    head = name.split()[-1]
    return _THREADS.index(head) if head in _THREADS else len(_THREADS)


def trace_events(result: SimResult) -> list[dict]:
    """The `traceEvents` list: metadata records, then one complete ("X") event per simulated event."""
    plan = result.plan
    out: list[dict] = []
    threads: dict[tuple[int, str], int] = {}
    for r, rank in enumerate(result.ranks):
        stages = ",".join(str(s) for s in rank.stages)
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                    "args": {"name": f"pp rank {r} (stages {stages})"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
    for e in result.events:
        thread = _thread(e.stream, e.kind)
        key = (e.rank, thread)
        if key not in threads:
            tid = threads[key] = _tid(thread) * 2 + (1 if e.stream == "inter" else 0)
            out.append({"ph": "M", "name": "thread_name", "pid": e.rank, "tid": tid, "args": {"name": thread}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": e.rank, "tid": tid, "args": {"sort_index": tid}})
        out.append({"ph": "X", "name": e.name, "cat": e.kind, "pid": e.rank, "tid": threads[key],
                    "ts": e.start * 1e6, "dur": e.duration * 1e6})
    out.append({"ph": "M", "name": "process_labels", "pid": 0, "tid": 0,
                "args": {"labels": f"{plan.model} {plan.layout_tag}"}})
    return out


def chrome_trace(result: SimResult) -> dict:
    plan = result.plan
    return {
        "traceEvents": trace_events(result),
        "displayTimeUnit": "ms",
        "otherData": {
            "model": plan.model,
            "hardware": plan.hardware,
            "layout": plan.layout_tag,
            "step_time_s": result.step_time_s,
            "bubble_fraction": result.bubble_fraction,
        },
    }


def write_chrome_trace(result: SimResult, path: str | Path) -> Path:
    """Write the trace JSON; open it at https://ui.perfetto.dev or chrome://tracing."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(result), separators=(",", ":")))
    return path
