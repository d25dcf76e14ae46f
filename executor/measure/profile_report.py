"""After a profiled run: the phase table, the merged trace and the HTML report, from the
ranks' traces and the simulation of the plan that ran (its hardware, or the one named)."""
from __future__ import annotations

import json
from pathlib import Path

from layout.plan import Plan
from costmodel.simulate.measured import (largest_miss, measured_phases, merged_trace, phase_table, predicted_phases,
                                         read_traces)
from hardware.errors import ParallaxError


def profile_report(folder: str | Path, plan: Plan, model_name: str, cluster=None, trust_module: bool = False) -> list[str]:
    """Write `folder`/trace.json and `folder`/report.html; return the lines to print."""
    from costmodel.simulate.step import simulate
    from executor.runtime.predict import workload_of
    from planner.run_report import write_run_report

    folder = Path(folder)
    traces = read_traces(folder)
    if not traces:
        return [f"profile: no profiled step was recorded in {folder}"]
    try:
        hardware = cluster if cluster is not None else plan.cluster()
        sim = simulate(workload_of(plan, model_name, hardware, trust_module), plan, hardware)
    except ParallaxError as error:
        return [f"profile: rank traces in {folder}; no predicted timeline: {error}"]
    cp = plan.cp > 1
    rank, measured = measured_phases(traces, cp)
    rows = phase_table(measured, predicted_phases(sim))
    last = largest_miss(rows)
    (folder / "trace.json").write_text(json.dumps(merged_trace(traces, sim), separators=(",", ":")))
    header = f"{'phase':12} {'measured ms':>12} {'predicted ms':>13}"
    table = [header] + [f"{p:12} {m * 1e3:12.2f} {q * 1e3:13.2f}" for p, m, q in rows]
    intro = (f"phases per step of rank {rank} (the slowest), over {len(traces[0].steps)} profiled steps, "
             f"beside the simulator's critical rank")
    write_run_report(folder / "report.html", f"{plan.model}: {plan.layout_tag}", rows, last, traces, sim,
                     [intro, f"predicted step {sim.step_time_s * 1e3:.1f} ms"], cp)
    return [intro, *table, last, f"profile: merged trace {folder / 'trace.json'} (Perfetto), report {folder / 'report.html'}"]
