"""`parallax dry-run PLAN.json`: the plan's memory as the executor allocates it, on fake tensors."""
from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from parallax_cli import TRUST_MODULE_HELP, app, check_model, load_plan, wide_console

GIB = 2 ** 30
ORDER = ("weights", "gradients", "optimizer", "activations", "buffers")  # on the device; then the host's


@app.command("dry-run")
def dry_run_command(
    plan_path: Path = typer.Argument(..., help="plan JSON (hand-written or from `parallax plan`)"),
    model: str = typer.Option(None, "--model", help="model name; default: the plan's"),
    hardware: str = typer.Option(None, "--hardware", help="profile or spec to predict on; default: the plan's"),
    trust_module: bool = typer.Option(False, "--trust-module", help=TRUST_MODULE_HELP),
) -> None:
    """Run the executor's appliers for one rank of each pipeline role on fake tensors, under torch's
    fake process group at the plan's full world size, and print each memory category measured
    beside predicted. Nothing is allocated and no GPU is touched."""
    from executor.measure.dry_run import dry_run

    plan = load_plan(plan_path, trust_module)
    check_model(model, trust_module)
    cluster = None
    if hardware:
        from hardware import load

        cluster = load(hardware)
    result = dry_run(plan, model, cluster=cluster, trust_module=trust_module)
    console = wide_console()
    for rank in result.ranks:
        console.print(_table(rank))
        if rank.allocator:
            console.print(_allocator_table(rank))
        if not rank.fits:
            console.print(_does_not_fit(rank))
    for note in result.notes:
        typer.echo(f"note: {note}")
    worst = result.worst
    typer.echo(f"peak memory: {worst.measured_peak / GIB:.2f} GiB measured on fake tensors, predicted "
               f"{worst.predicted_peak / GIB:.2f} GiB (error {worst.error:+.1%})")
    if worst.allocator:
        typer.echo(_reserved_line(worst))


def _reserved_line(rank) -> str:
    replayed, reserved = rank.allocator, rank.reserved
    where = " on this GPU" if "reserved_on_device" in replayed else ""
    line = (f"reserved: {reserved / GIB:.2f} GiB{where} by the caching allocator's replay with expandable segments "
            f"({reserved / replayed['allocated'] - 1:+.1%} over allocated)")
    if where:
        line += f"; with no memory pressure {replayed['reserved_expandable'] / GIB:.2f}"
    if rank.predicted_reserved:
        line += f", predicted {rank.predicted_reserved / GIB:.2f} ({rank.predicted_reserved / replayed['reserved_expandable'] - 1:+.1%})"
    line += (f" ({replayed['reserved'] / GIB:.2f} without expandable segments); "
             f"{sum(rank.runtime.values()) / GIB:.2f} GiB more for the CUDA context, workspaces and NCCL")
    retries = replayed.get("allocation_retries", 0.0)
    if retries and not replayed.get("out_of_memory"):
        line += f"; to fit, the allocator gives its cache back {retries:.0f} time(s) a step, each a device synchronisation"
    return line


def _table(rank) -> Table:
    table = Table(title=f"rank {rank.rank} (pipeline rank {rank.pp_rank})")
    for column in ("category", "measured GiB", "at the peak", "predicted GiB", "error"):
        table.add_column(column, justify="left" if column == "category" else "right")
    names = [n for n in ORDER if n in rank.measured or n in rank.predicted]
    for name in names + ["peak"]:
        measured = rank.measured_peak if name == "peak" else rank.measured.get(name, 0.0)
        if name == "peak" and "host" in rank.measured:  # offloaded states: the host's, outside the device peak
            table.add_row(*_host_row(rank))
        at_peak = rank.measured_peak if name == "peak" else rank.at_peak.get(name, 0.0)
        predicted = rank.predicted_peak if name == "peak" else rank.predicted.get(name, 0.0)
        # the prediction is of the peak's moment; a category empty then has no relative error
        error = f"{predicted / at_peak - 1:+.1%}" if at_peak > 2 ** 20 else "-"
        table.add_row("device peak" if name == "peak" else name, f"{measured / GIB:.2f}", f"{at_peak / GIB:.2f}",
                      f"{predicted / GIB:.2f}", error)
    return table


def _allocator_table(rank) -> Table:
    """The rank's allocations replayed through torch's caching allocator, and the runtime's memory."""
    table = Table(title=f"rank {rank.rank}: as the GPU would hold it (torch's caching allocator replayed)")
    table.add_column("what", justify="left")
    table.add_column("GiB", justify="right")
    replayed = rank.allocator
    rows = [("max_memory_allocated", replayed["allocated"])]
    if "reserved_on_device" in replayed:
        rows.append(("max_memory_reserved (expandable_segments, as run on this GPU)", replayed["reserved_on_device"]))
    rows += [("max_memory_reserved with no memory pressure", replayed["reserved_expandable"]),
             ("  without expandable_segments", replayed["reserved"])]
    if rank.predicted_reserved is not None:
        rows.append(("  predicted (costmodel/reserved.py)", rank.predicted_reserved))
    rows += [(f"+ {name.replace('_', ' ')}", nbytes) for name, nbytes in rank.runtime.items()]
    if rank.device_total is not None:
        rows.append(("device total", rank.device_total))
    if rank.gpu_bytes is not None:
        rows.append(("the GPU's memory", rank.gpu_bytes))
    for name, nbytes in rows:
        table.add_row(name, f"{nbytes / GIB:.2f}")
    return table


def _does_not_fit(rank) -> str:
    if rank.allocator.get("out_of_memory"):
        return (f"rank {rank.rank} would not fit: out of memory in the caching allocator's replay with "
                f"{rank.allocator['reserved_on_device'] / GIB:.1f} GiB reserved of the "
                f"{(rank.gpu_bytes - sum(rank.runtime.values())) / GIB:.1f} GiB the runtime leaves, its cache given "
                f"back ({rank.measured_peak / GIB:.1f} GiB of live tensors at the peak)")
    if rank.device_total is not None and rank.gpu_bytes is not None:
        return (f"rank {rank.rank} would not fit: {rank.device_total / GIB:.1f} GiB reserved and held by the runtime > "
                f"{rank.gpu_bytes / GIB:.1f} GiB on the GPU")
    return (f"rank {rank.rank} would not fit: {rank.measured_peak / GIB:.1f} GiB measured on the device > "
            f"{rank.capacity / GIB:.1f} GiB usable")


def _host_row(rank) -> tuple[str, ...]:
    measured, predicted = rank.measured["host"], rank.predicted_host
    if predicted is None:
        return "host (offloaded)", f"{measured / GIB:.2f}", "-", "-", "-"
    return "host (offloaded)", f"{measured / GIB:.2f}", "-", f"{predicted / GIB:.2f}", f"{predicted / measured - 1:+.1%}"
