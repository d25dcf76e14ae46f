"""`parallax hetero-plan`: a training plan for a mixed-GPU cluster, against the uniform baseline."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from parallax_cli import app, emit
from planner.mixed.search import HeteroPlan, plan_hetero

console = Console()
if console.width < 130:
    console = Console(width=130)


def balance_table(plan: HeteroPlan) -> Table:
    table = Table(title=f"{plan.model} on {plan.hardware}: {plan.mode}, tp={plan.tp} pp={plan.pp} dp={plan.dp} "
                        f"mb={plan.micro_batch} zero={plan.zero} recompute={plan.recompute}")
    for col in ("group", "GPUs", "stages", "blocks/stage", "replicas", "micro-batches", "per-mb s", "busy s", "idle",
                "mem GiB"):
        table.add_column(col, justify="left" if col in ("group", "stages", "blocks/stage") else "right")
    for b in plan.balance:
        table.add_row(b.group, str(b.gpus), b.stages, ",".join(map(str, b.blocks_per_stage)) or "-", str(b.replicas),
                      str(b.micro_batches), f"{b.per_micro_batch_s:.3f}", f"{b.busy_s:.2f}", f"{b.idle_fraction:.0%}",
                      f"{b.peak_memory_gib:.1f}/{b.capacity_gib:.0f}")
    return table


def comparison_table(plan: HeteroPlan) -> Table:
    table = Table(title="Step time on the same cluster")
    table.add_column("plan")
    table.add_column("step s", justify="right")
    table.add_column("vs aware", justify="right")
    rows = []
    if plan.uniform_step_time_s:
        rows.append((f"uniform, ignores the difference ({plan.uniform_layout}, slowest pace)", plan.uniform_step_time_s))
    rows += [(f"best uniform subset: {k} only", v) for k, v in plan.subset_step_time_s.items()]
    rows.append((f"heterogeneity-aware ({plan.mode})", plan.step_time_s))
    for label, step in rows:
        table.add_row(label, f"{step:.2f}", f"{step / plan.step_time_s:.2f}x")
    return table


def print_hetero(plan: HeteroPlan, out: Path | None, as_json: bool) -> None:
    """A mixed-cluster plan as `parallax plan` prints it: the balance per group and the comparison."""
    if emit(plan, out, as_json):
        return
    console.print(balance_table(plan))
    console.print(comparison_table(plan))
    for note in plan.notes:
        console.print(f"note: {note}")


@app.command("hetero-plan")
def hetero_plan_command(
    model: str = typer.Argument(..., help="built-in name (see `parallax models`), a config.json path or folder, or a cached HF id (org/name)"),
    hw: str = typer.Option(..., "--hw", help="mixed spec, e.g. 16xa100-80g+8xh100-sxm"),
    global_batch: int = typer.Option(..., "--global-batch"),
    seq_len: int = typer.Option(..., "--seq-len"),
    dtype: str = typer.Option("bf16", "--dtype"),
    time_limit: float = typer.Option(4.0, "--time-limit", help="solver seconds for each uniform plan"),
    out: Optional[Path] = typer.Option(None, "--out"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Alias of `parallax plan MODEL --hw A+B` for a cluster of several GPU types."""
    print_hetero(plan_hetero(model, hw, global_batch=global_batch, seq_len=seq_len, dtype=dtype, time_limit_s=time_limit),
                 out, as_json)
