"""`parallax whatif MODEL --hw A --hw B`: best plan, speed and dollars per hardware and GPU count."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from hardware.errors import ParallaxError
from hardware.limits import MAX_GPUS, check_count, check_positive
from hardware.untrusted import check_name
from parallax_cli import app, wide_console


def parse_counts(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        counts = [int(part) for part in text.replace(" ", "").split(",")]
    except ValueError:
        raise ParallaxError("gpus", f"{text!r} is not a comma-separated list of GPU counts", "e.g. 64,128,256") from None
    return [check_count("gpus", c, MAX_GPUS, hint="e.g. 64,128,256") for c in counts]


def rows_table(rows, title: str) -> Table:
    from planner.report import COLUMNS, row_cells

    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("hardware", "layout", "notes") else "right")
    table.add_column("goodput", justify="right")  # under failures, checkpointing at Young's interval
    table.add_column("ckpt every", justify="right")
    for row in rows:
        g = getattr(row, "goodput", None)
        extra = ["-", "-"] if g is None else [f"{g.goodput:.2%}", f"{g.optimal_interval_s / 60:.1f} min"]
        table.add_row(*row_cells(row), *extra)
    return table


@app.command("whatif")
def whatif_command(
    model: str = typer.Argument(..., help="built-in name (see `parallax models`), a config.json path or folder, or a cached HF id (org/name)"),
    hw: list[str] = typer.Option(..., "--hw", help="hardware spec; repeat to compare, e.g. --hw h100-sxm --hw a100-80g"),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="GPU counts to sweep, e.g. 64,128,256"),
    global_batch: int = typer.Option(512, "--global-batch"),
    seq_len: int = typer.Option(4096, "--seq-len"),
    tokens: Optional[float] = typer.Option(None, "--tokens", help="training budget in tokens, e.g. 2e12"),
    price: Optional[float] = typer.Option(None, "--price-per-gpu-hour"),
    nic_gbps: Optional[float] = typer.Option(None, "--nic-gbps", help="override per-GPU NIC bandwidth (Gb/s)"),
    intra_gbps: Optional[float] = typer.Option(None, "--intra-gbps", help="override per-GPU intra-node bandwidth (GB/s)"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="write scaling curves PNG here"),
    report: Optional[Path] = typer.Option(None, "--report", help="write a self-contained HTML report here"),
    storage_gbps: Optional[float] = typer.Option(None, "--storage-gbps",
                                                 help="aggregate checkpoint write bandwidth, GB/s (default 2000, Llama 3 paper)"),
    restart_min: Optional[float] = typer.Option(None, "--restart-min", help="minutes to restart after a failure (default 10)"),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, fp16, fp32 or fp8 (FP8 GEMMs where the GPU has an FP8 peak)"),
) -> None:
    """Plan MODEL on each hardware x GPU count and compare step time, throughput and cost."""
    from planner.whatif import whatif

    for name in (model, *hw):
        check_name(name, "model" if name == model else "--hw")
    for name, value in (("--tokens", tokens), ("--price-per-gpu-hour", price), ("--nic-gbps", nic_gbps),
                        ("--intra-gbps", intra_gbps), ("--storage-gbps", storage_gbps), ("--restart-min", restart_min)):
        if value is not None:
            check_positive(name, value)
    rows = whatif(model, hw, parse_counts(gpus), global_batch=global_batch, seq_len=seq_len, tokens=tokens,
                  price_per_gpu_hour=price, nic_gbps=nic_gbps, intra_gbps=intra_gbps, storage_gbps=storage_gbps,
                  restart_s=restart_min * 60 if restart_min is not None else None, dtype=dtype)
    console = wide_console()
    console.print(rows_table(rows, f"{model}: global batch {global_batch} x {seq_len} tokens"))
    if any(getattr(r, "goodput", None) for r in rows):
        console.print("goodput: Daly's expected useful fraction with per-GPU MTBF from the hardware data, checkpoint "
                      "write = weights + optimizer state / storage bandwidth, checkpointing every sqrt(2 x write x job MTBF) "
                      "(Young); see costmodel/goodput.py for sources")
    if plot:
        from planner.plots import save_png, scaling_curves

        console.print(f"plot written to {save_png(scaling_curves(rows), plot)}")
    if report:
        from planner.report import whatif_report, write_report

        console.print(f"report written to {write_report(report, whatif_report(rows, f'Parallax what-if: {model}'))}")
