"""A self-contained HTML report: one table plus plots embedded as base64 PNGs.

One file that can be mailed or attached to a ticket: no external CSS, scripts
or images, so it renders the same anywhere and years later.
"""
from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import TYPE_CHECKING

from planner.whatif import WhatIfRow

if TYPE_CHECKING:
    from costmodel.simulate.playback import SimResult

COLUMNS = ("hardware", "GPUs", "layout", "step s", "tokens/s", "MFU", "mem headroom", "scaling eff",
           "time to train", "$ to train", "$/1M tok", "notes")

_STYLE = """body{font-family:sans-serif;margin:2em;color:#222}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td:first-child,td:nth-child(3),td:last-child{text-align:left}
th{background:#f0f0f0}img{max-width:100%;margin:1em 0;display:block}"""


def _fmt(value, kind: str = "g") -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{value:.1%}"
    if kind == "usd":
        return f"${value:,.2f}" if value < 1e4 else f"${value:,.0f}"
    if kind == "dur":
        days = value / 86400
        return f"{days:.1f} d" if days >= 1 else f"{value / 3600:.1f} h"
    if kind == "int":
        return f"{value:,.0f}"
    return f"{value:.3g}"


def row_cells(row: WhatIfRow) -> list[str]:
    """The table cells of one what-if row, formatted (shared with the CLI table)."""
    return [row.hardware, str(row.n_gpus), row.layout, _fmt(row.step_time_s), _fmt(row.tokens_per_s, "int"),
            _fmt(row.mfu, "pct"), _fmt(row.memory_headroom, "pct"), _fmt(row.scaling_efficiency, "pct"),
            _fmt(row.time_to_train_s, "dur"), _fmt(row.usd_to_train, "usd"), _fmt(row.usd_per_million_tokens, "usd"),
            "; ".join(row.notes)]


def _table(rows: list[WhatIfRow]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row_cells(r)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _sim_table(sim: "SimResult") -> str:
    cells = [("step time", f"{sim.step_time_s:.4g} s"), ("bubble", f"{sim.bubble_fraction:.2%}"),
             ("tokens/s", f"{sim.tokens_per_s:,.0f}"), ("MFU", f"{sim.mfu:.1%}"),
             ("peak memory", f"{sim.peak_memory_bytes / 2**30:.1f} GiB on rank {sim.peak_memory_rank} "
                             f"at {sim.peak_memory_time_s:.3g} s")]
    cells += [(f"exposed {k}", f"{v:.4g} s") for k, v in sim.exposed_comm_s.items()]
    cells.insert(0, ("layout", sim.plan.layout_tag))
    if sim.plan.offload and sim.plan.estimate is not None:
        est = sim.plan.estimate
        cells.append(("offload", f"{est.host_memory_bytes / 1e9:,.0f} GB host memory per node; host<->device copies "
                                 f"{est.host_copy_s:.3g} s per step before overlap; AdamW on the host "
                                 f"{sim.breakdown_s.get('optimizer', 0.0):.3g} s"))
    for g in sim.groups:  # a mixed-cluster plan: where each GPU group's share went
        played = g.own or sim
        ends = max(played.ranks[r].end_s for r in g.pipeline_ranks)
        cells.append((f"group {g.group}", f"pipeline ranks {','.join(map(str, g.pipeline_ranks))}, done at {ends:.4g} s"
                                          + (f" (its own replica's step {g.own.step_time_s:.4g} s)" if g.own else "")))
    return "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in cells) + "</table>"


def _img(name: str, png: bytes) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<h3>{html.escape(name)}</h3><img alt="{html.escape(name)}" src="data:image/png;base64,{data}"/>'


def html_report(title: str, rows: list[WhatIfRow] | None = None, sim: "SimResult | None" = None,
                plots: dict[str, bytes] | None = None, notes: list[str] | None = None) -> str:
    """The whole page as a string; `plots` maps a caption to PNG bytes."""
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"]
    for note in notes or []:
        parts.append(f"<p>{html.escape(note)}</p>")
    if rows:
        parts.append(_table(rows))
    if sim is not None:
        parts.append("<h2>Simulated step</h2>" + _sim_table(sim))
    for name, png in (plots or {}).items():
        parts.append(_img(name, png))
    parts.append("</body></html>")
    return "".join(parts)


def whatif_report(rows: list[WhatIfRow], title: str = "Parallax what-if") -> str:
    """Table plus scaling curves and a breakdown of every feasible row."""
    from planner.plots import breakdown_bars, png_bytes, scaling_curves

    plots = {"Scaling": png_bytes(scaling_curves(rows))}
    feasible = [(f"{r.hardware} {r.layout}", r.plan.estimate.breakdown_s) for r in rows if r.feasible]
    if feasible:
        plots["Step-time breakdown (estimate)"] = png_bytes(breakdown_bars(feasible))
    return html_report(title, rows=rows, plots=plots)


def write_report(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.write_text(text, encoding="utf-8")
    return path
