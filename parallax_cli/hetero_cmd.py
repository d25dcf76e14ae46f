"""`parallax hetero-plan`: the old name of `parallax plan MODEL --hw A+B` for a mixed-GPU cluster."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from parallax_cli import app
from parallax_cli.plan_cmd import print_plan
from planner.mixed.search import plan_mixed
from planner.request import PlanRequest


@app.command("hetero-plan")
def hetero_plan_command(
    model: str = typer.Argument(..., help="built-in name (see `parallax models`), a config.json path or folder, or a cached HF id (org/name)"),
    hw: str = typer.Option(..., "--hw", help="mixed spec, e.g. 16xa100-80g+8xh100-sxm"),
    global_batch: int = typer.Option(..., "--global-batch"),
    seq_len: int = typer.Option(..., "--seq-len"),
    dtype: str = typer.Option("bf16", "--dtype"),
    time_limit: float = typer.Option(4.0, "--time-limit", help="search seconds"),
    out: Optional[Path] = typer.Option(None, "--out"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Alias of `parallax plan MODEL --hw A+B` for a cluster of several GPU types."""
    request = PlanRequest.of(global_batch=global_batch, seq_len=seq_len, dtype=dtype, time_limit_s=time_limit)
    print_plan(plan_mixed(model, hw, request), model, out, as_json)
