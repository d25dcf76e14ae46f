"""`parallax simulate PLAN.json`: play one training step of a plan, event by event.

On other hardware (`--hw`) a plan that no longer fits — wrong GPU count or
out of memory — is re-planned for the target, and the output says so: a
simulation of a layout that cannot run would be a confident wrong answer.
On its own hardware a plan whose degrees miss the GPU count is refused: that
file is broken, and re-planning it would answer a question nobody asked.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from costmodel.estimate import estimate
from layout.plan import Plan
from layout.rules import check_world
from hardware.errors import ModelError, ParallaxError
from parallax_cli import TRUST_MODULE_HELP, app, load_plan, wide_console
from planner.resolve import resolve_hardware


def load_workload(plan: Plan, cluster):
    """The plan's model as a Workload, through the planner's tracing front end, its attention
    as `cluster` runs it; a module factory (trusted by `load_plan`'s caller) built on the meta device."""
    from planner.factory import names_factory

    if names_factory(plan.model):
        import torch

        from planner.factory import build_on_meta
        from planner.resolve import resolve_workload

        return resolve_workload(build_on_meta(plan.model), seq_len=plan.seq_len, dtype=plan.dtype, cluster=cluster,
                                example_inputs=(torch.zeros(1, plan.seq_len, dtype=torch.long),))
    try:
        from planner.trace.workload_for import workload_for
    except ImportError as error:
        raise ModelError("model", f"cannot build the workload of {plan.model!r}: planner.trace.workload_for is unavailable ({error})",
                         "install the full planner") from None
    from planner.resolve import for_hardware

    return for_hardware(workload_for(plan.model, seq_len=plan.seq_len, dtype=plan.dtype)[0], cluster)


def fit_plan(plan: Plan, workload, cluster) -> tuple[Plan, list[str]]:
    """Keep the plan if it runs on `cluster`, else re-plan there; returns (plan, notes)."""
    import planner

    reason = None
    if plan.n_gpus != cluster.n_gpus:
        reason = f"the plan uses {plan.n_gpus} GPUs, {cluster.spec()} has {cluster.n_gpus}"
    else:
        try:
            est = estimate(workload, plan, cluster)
        except ParallaxError as error:
            reason = str(error)
        else:
            if not est.fits:
                reason = f"it needs {est.held_bytes / 2**30:.1f} GiB of {est.memory_capacity_bytes / 2**30:.1f} GiB usable"
            else:
                return plan.model_copy(update={"estimate": est}), []
    new = planner.plan(workload, cluster, global_batch=plan.global_batch, seq_len=plan.seq_len, dtype=plan.dtype)
    new = new.model_copy(update={"model": plan.model})
    return new, [f"re-planned for {cluster.spec()}: {reason}"]


def sim_table(sim, est) -> Table:
    table = Table(title=f"{sim.plan.model} on {sim.plan.hardware}: {sim.plan.layout_tag} (m={sim.plan.num_micro_batches})")
    for col in ("", "simulated", "estimate"):
        table.add_column(col, justify="left" if not col else "right")
    table.add_row("step time (s)", f"{sim.step_time_s:.4g}", f"{est.step_time_s:.4g}")
    for key, value in sim.breakdown_s.items():
        table.add_row(f"  {key}", f"{value:.4g}", f"{est.breakdown_s.get(key, 0.0):.4g}")
    table.add_row("bubble fraction", f"{sim.bubble_fraction:.2%}", "")
    for key, value in sim.exposed_comm_s.items():
        table.add_row(f"exposed {key} comm (s, worst rank)", f"{value:.4g}", "")
    table.add_row("tokens/s", f"{sim.tokens_per_s:,.0f}", f"{est.tokens_per_s:,.0f}")
    table.add_row("MFU", f"{sim.mfu:.1%}", f"{est.mfu:.1%}")
    table.add_row("peak memory (GiB)", f"{sim.peak_memory_bytes / 2**30:.2f} (rank {sim.peak_memory_rank} "
                  f"at {sim.peak_memory_time_s:.3g} s)", f"{est.peak_memory_bytes / 2**30:.2f}")
    if sim.plan.offload:
        table.add_row("offload: host memory per node (GB)", "", f"{est.host_memory_bytes / 1e9:,.0f}")
        table.add_row("offload: host<->device copies (s)", "", f"{est.host_copy_s:.3g}")
    return table


def groups_table(sim) -> Table:
    """A mixed-cluster plan's simulated step per GPU group: the pipeline ranks it holds, when
    they finish, and (data split) its own replica's step."""
    table = Table(title=f"GPU groups ({sim.plan.split} split)")
    for col in ("group", "pipeline ranks", "busy s", "ends s", "own step s", "peak GiB"):
        table.add_column(col, justify="left" if col in ("group", "pipeline ranks") else "right")
    for g in sim.groups:
        played = g.own or sim
        ranks = [played.ranks[r] for r in g.pipeline_ranks]
        table.add_row(g.group, ",".join(map(str, g.pipeline_ranks)), f"{max(r.busy_s for r in ranks):.4g}",
                      f"{max(r.end_s for r in ranks):.4g}", f"{g.own.step_time_s:.4g}" if g.own else "-",
                      f"{max(r.peak_memory_bytes for r in ranks) / 2**30:.2f}")
    return table


@app.command("simulate")
def simulate_command(
    plan_path: Path = typer.Argument(..., help="plan JSON (from `parallax plan` or hand-written)"),
    hw: Optional[str] = typer.Option(None, "--hw", help="simulate on this hardware instead of the plan's"),
    trace: Optional[Path] = typer.Option(None, "--trace", help="write a Chrome/Perfetto trace JSON here"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="write the pipeline timeline PNG here"),
    report: Optional[Path] = typer.Option(None, "--report", help="write a self-contained HTML report here"),
    trust_module: bool = typer.Option(False, "--trust-module", help=TRUST_MODULE_HELP),
) -> None:
    """Simulate one training step of PLAN and compare it with the analytic estimate."""
    from costmodel.simulate.step import simulate

    plan = load_plan(plan_path, trust_module)
    cluster = resolve_hardware(hw) if hw else plan.cluster()
    if not hw:  # on its own hardware a plan whose degrees miss its GPU count is broken, not a what-if
        check_world(plan, cluster.n_gpus, "GPUs on the plan's hardware", "fix the degrees, or pass --hw to re-plan")
    workload = load_workload(plan, cluster)
    plan, notes = fit_plan(plan, workload, cluster)
    sim = simulate(workload, plan, cluster)
    console = wide_console()
    if sim.played_micro_batches:
        notes.append(f"played {sim.played_micro_batches} of the {plan.num_micro_batches:,} micro-batches; the rest "
                     "repeat the steady state and are counted (the trace and plots show the played ones)")
    for note in notes + list(plan.notes):
        console.print(f"note: {note}")
    console.print(sim_table(sim, plan.estimate or estimate(workload, plan, cluster)))
    if sim.groups:
        console.print(groups_table(sim))
    _write_outputs(sim, plan, cluster, notes, trace, plot, report, console)


def _write_outputs(sim, plan, cluster, notes, trace, plot, report, console) -> None:
    if trace:
        from costmodel.simulate.trace_export import write_chrome_trace

        console.print(f"trace written to {write_chrome_trace(sim, trace)} (open in https://ui.perfetto.dev)")
    if plot:
        from planner.plots import pipeline_timeline, save_png

        console.print(f"timeline written to {save_png(pipeline_timeline(sim), plot)}")
    if report:
        from planner.plots import breakdown_bars, memory_breakdown, pipeline_timeline, png_bytes
        from planner.report import html_report, write_report

        est = plan.estimate
        plots = {
            "Pipeline timeline": png_bytes(pipeline_timeline(sim)),
            "Step-time breakdown": png_bytes(breakdown_bars([("simulated", sim.breakdown_s), ("estimate", est.breakdown_s)])),
            "Memory per rank": png_bytes(memory_breakdown(sim, est.memory_capacity_bytes)),
        }
        for group in sim.groups:  # a data split plays each group's replica on its own GPUs
            if group.own is not None:
                plots[f"Pipeline timeline: {group.group}"] = png_bytes(pipeline_timeline(group.own))
        text = html_report(f"Parallax simulation: {plan.model} on {cluster.spec()}", sim=sim, plots=plots, notes=notes)
        console.print(f"report written to {write_report(report, text)}")
