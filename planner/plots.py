"""PNG plots of plans, simulated steps and what-if sweeps (matplotlib, Agg backend).

Every function returns a matplotlib Figure; `save_png` writes it and
`png_bytes` embeds it (the HTML report). The Agg backend is forced so plots
work on headless machines and in CI.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from planner.whatif import WhatIfRow, amdahl_serial_fraction  # noqa: E402

if TYPE_CHECKING:
    from costmodel.simulate.playback import SimResult

GIB = 2**30
COLORS = {
    "compute": "#4C72B0", "recompute": "#8172B2", "tp_comm": "#DD8452", "ep_comm": "#DA8BC3", "pp_comm": "#C44E52",
    "zero_comm": "#937860", "bubble": "#CCCCCC", "dp_comm": "#55A868", "optimizer": "#DA8BC3",
    "weights": "#4C72B0", "gradients": "#55A868", "optimizer_state": "#DA8BC3", "buffers": "#937860",
    "activations": "#DD8452",
}


def save_png(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    fig.savefig(path, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def png_bytes(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def breakdown_bars(items: list[tuple[str, dict[str, float]]], title: str = "Step time breakdown") -> Figure:
    """Horizontal stacked bars, one per (label, breakdown_s) — estimate or simulation."""
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(items) + 1.6))
    keys = [k for k in COLORS if any(k in b for _, b in items)]
    for y, (_, parts) in enumerate(items):
        left = 0.0
        for key in keys:
            width = parts.get(key, 0.0)
            ax.barh(y, width, left=left, color=COLORS[key], label=key if y == 0 else None)
            left += width
    ax.set_yticks(range(len(items)), [label for label, _ in items])
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step")
    ax.set_title(title)
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.05 / max(1, len(items))))
    return fig


def pipeline_timeline(sim: "SimResult", max_ops: int = 4000) -> Figure:
    """Gantt chart: one row per rank's compute stream (forward blue, backward orange) and one for its links.

    Beyond `max_ops` compute ops per rank only the first and last ops are drawn
    (warm-up and drain are where the schedule differs); the title says so.
    """
    pp = len(sim.ranks)
    fig, ax = plt.subplots(figsize=(12, 0.8 * pp + 1.5))
    colors = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#DA8BC3"}
    clipped = False
    for r in range(pp):
        mine = [e for e in sim.events if e.rank == r]
        compute = [e for e in mine if e.stream == "compute"]
        if len(compute) > max_ops:
            compute = compute[: max_ops // 2] + compute[-max_ops // 2 :]
            clipped = True
        for kind, color in colors.items():
            bars = [(e.start, e.duration) for e in compute if e.kind == kind]
            ax.broken_barh(bars, (r * 2 + 0.15, 0.8), facecolors=color, edgecolors="white", linewidth=0.3,
                           label=kind if r == 0 else None)
        comm = [(e.start, e.duration) for e in mine if e.kind in ("pp", "dp", "zero_gather", "zero_scatter")]
        ax.broken_barh(comm, (r * 2 + 1.05, 0.5), facecolors="#55A868", label="pp/dp/zero comm" if r == 0 else None)
    ax.set_yticks([r * 2 + 0.55 for r in range(pp)], [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    plan = sim.plan
    note = " (middle ops omitted)" if clipped else ""
    ax.set_title(f"{plan.schedule} pp={plan.pp} vpp={plan.vpp} m={plan.num_micro_batches}: "
                 f"step {sim.step_time_s:.3f} s, bubble {sim.bubble_fraction:.1%}{note}")
    ax.legend(ncol=4, fontsize=8, loc="upper right")
    return fig


def memory_breakdown(sim: "SimResult", capacity_bytes: float | None = None) -> Figure:
    """Stacked per-rank peak memory: model states plus the simulated activation peak."""
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(sim.ranks) + 3), 4))
    for r, rank in enumerate(sim.ranks):
        parts = {("optimizer_state" if k == "optimizer" else k): v for k, v in rank.static_memory.items()}
        parts["activations"] = rank.peak_activation_bytes
        bottom = 0.0
        for key, value in parts.items():
            ax.bar(r, value / GIB, bottom=bottom, color=COLORS.get(key, "#999999"), label=key if r == 0 else None)
            bottom += value / GIB
    if capacity_bytes:
        ax.axhline(capacity_bytes / GIB, color="black", linestyle="--", label="usable capacity")
    ax.set_xticks(range(len(sim.ranks)), [f"rank {r}" for r in range(len(sim.ranks))])
    ax.set_ylabel("GiB at peak")
    ax.set_title("Peak memory per pipeline rank")
    ax.legend(fontsize=8)
    return fig


def scaling_curves(rows: list[WhatIfRow]) -> Figure:
    """Throughput and $/1M tokens against GPU count per hardware, with ideal linear scaling and Amdahl fit."""
    fig, (ax_t, ax_c) = plt.subplots(1, 2, figsize=(12, 4.5))
    for gpu in dict.fromkeys(r.gpu for r in rows):
        mine = sorted((r for r in rows if r.gpu == gpu and r.feasible), key=lambda r: r.n_gpus)
        if not mine:
            continue
        n = [r.n_gpus for r in mine]
        tps = [r.tokens_per_s for r in mine]
        serial = amdahl_serial_fraction(n, tps)
        label = gpu + (f" (Amdahl s={serial:.3f})" if serial is not None else "")
        line = ax_t.plot(n, tps, marker="o", label=label)[0]
        ax_t.plot(n, [tps[0] * k / n[0] for k in n], linestyle=":", color=line.get_color())
        for r in mine:
            ax_t.annotate(f"{r.scaling_efficiency:.0%}", (r.n_gpus, r.tokens_per_s), fontsize=7,
                          textcoords="offset points", xytext=(3, -10))
        cost = [(r.n_gpus, r.usd_per_million_tokens) for r in mine if r.usd_per_million_tokens is not None]
        if cost:
            ax_c.plot(*zip(*cost), marker="o", color=line.get_color(), label=gpu)
    for ax in (ax_t, ax_c):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    ax_t.set_ylabel("tokens/s (dotted: ideal linear; labels: parallel efficiency)")
    ax_c.set_ylabel("$ per 1M tokens")
    ax_t.set_title("Throughput")
    ax_c.set_title("Cost")
    return fig
