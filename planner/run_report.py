"""The run report as one HTML file: measured and predicted timelines drawn, and the phase table.

In the whatif report's style (planner/report.py): a self-contained page, plots as base64
PNGs. The measured picture has a lane per rank, the training thread's time coloured by
phase (costmodel/simulate/measured.py) over the profiled steps; the predicted picture
has a lane per pipeline rank, the simulator's step drawn at the start of each measured
step, in the same colours.
"""
from __future__ import annotations

import base64
import html
from pathlib import Path

from costmodel.simulate.measured import KIND_PHASE, PHASES, RankTrace, phase_segments
from costmodel.simulate.playback import SimResult
from planner.plots import plt, png_bytes
from planner.report import _STYLE

COLORS = dict(zip(PHASES, ("#4C72B0", "#DD8452", "#C44E52", "#8172B3", "#937860", "#55A868", "#64B5CD",
                           "#8C8C8C", "#DA8BC3", "#F0F0F0")))


def timelines(traces: list[RankTrace], sim: SimResult, cp: bool = False):
    """Measured (top) and predicted (bottom) timelines on one time axis, seconds from the first profiled step."""
    first = min(traces, key=lambda t: t.rank)
    starts = [(first.steps[s][0] - min(a for a, _ in first.steps.values())) / 1e6 for s in sorted(first.steps)]
    lanes = len(traces) + len(sim.ranks)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 1.2 + 0.45 * lanes), sharex=True,
                                      gridspec_kw={"height_ratios": [len(traces), max(1, len(sim.ranks))]})
    # one collection per lane and phase: a bar per segment is thousands of artists, minutes to draw
    for lane, trace in enumerate(traces):
        origin = min(a for a, _ in trace.steps.values())
        pieces: dict[str, list[tuple[float, float]]] = {}
        for step in sorted(trace.steps):
            for a, b, phase in phase_segments(trace, step, cp):
                pieces.setdefault(phase, []).append(((a - origin) / 1e6, (b - a) / 1e6))
        for phase, spans in pieces.items():
            top.broken_barh(spans, (lane, 0.8), facecolors=COLORS[phase], label=phase)
    top.set_yticks([i + 0.4 for i in range(len(traces))], [f"rank {t.rank}" for t in traces])
    top.set_title("measured (torch.profiler, training thread)")
    predicted: dict[tuple[float, str], list[tuple[float, float]]] = {}
    for start in starts:
        for e in sim.events:
            lane = e.rank + (0.0 if e.stream == "compute" else 0.45)
            predicted.setdefault((lane, KIND_PHASE.get(e.kind, "idle")), []).append((start + e.start, e.duration))
    for (lane, phase), spans in predicted.items():
        bottom.broken_barh(spans, (lane, 0.4), facecolors=COLORS[phase])
    bottom.set_yticks([r + 0.4 for r in range(len(sim.ranks))], [f"pp rank {r}" for r in range(len(sim.ranks))])
    bottom.set_title(f"predicted (simulator, {sim.step_time_s * 1e3:.1f} ms per step; links below compute)")
    bottom.set_xlabel("seconds from the first profiled step")
    for ax in (top, bottom):
        ax.invert_yaxis()
    handles, labels = top.get_legend_handles_labels()
    firsts = {label: handle for handle, label in zip(handles, labels)}  # one entry per phase, not per lane
    handles, labels = list(firsts.values()), list(firsts)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.legend(handles, labels, ncol=len(labels), fontsize=8, loc="lower center")
    return fig


def write_run_report(path: str | Path, title: str, rows: list[tuple[str, float, float]], last_line: str,
                     traces: list[RankTrace], sim: SimResult, lines: list[str], cp: bool = False) -> Path:
    """The page: its headline lines, the phase table, and the timelines."""
    image = base64.b64encode(png_bytes(timelines(traces, sim, cp))).decode()
    head = "".join(f"<th>{c}</th>" for c in ("phase", "measured ms", "predicted ms", "error"))
    body = "".join(f"<tr><td>{html.escape(p)}</td><td>{m * 1e3:.2f}</td><td>{q * 1e3:.2f}</td>"
                   f"<td>{(m - q) / q:+.0%}</td></tr>" if q else
                   f"<tr><td>{html.escape(p)}</td><td>{m * 1e3:.2f}</td><td>{q * 1e3:.2f}</td><td>-</td></tr>"
                   for p, m, q in rows)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            + "".join(f"<p>{html.escape(line)}</p>" for line in lines)
            + f"<h2>Phases per step</h2><table><tr>{head}</tr>{body}</table><p><b>{html.escape(last_line)}</b></p>"
            f"<h2>Timelines</h2><img alt='measured and predicted timelines' src='data:image/png;base64,{image}'>"
            "</body></html>")
    path = Path(path)
    path.write_text(page)
    return path
