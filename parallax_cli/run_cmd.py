"""`parallax run` and `parallax calibrate`: execute a plan, measure a machine."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from parallax_cli import app, load_plan


@app.command("run")
def run_command(
    plan_path: Path = typer.Argument(..., help="plan JSON (hand-written or from `parallax plan`)"),
    model: str = typer.Option(None, "--model", help="model name; default: the plan's"),
    steps: int = typer.Option(5, "--steps", min=1),
    nproc: int = typer.Option(None, "--nproc", help="processes on this node; default dp*tp*pp"),
    hardware: str = typer.Option(None, "--hardware", help="profile or spec for the predicted columns"),
    out: Path = typer.Option(None, "--out", help="write the run report JSON here"),
    checkpoint_dir: Path = typer.Option(None, "--checkpoint-dir",
                                        help="save model+optimizer state here (sharded, atomic, verified) and resume from it"),
    checkpoint_every: int = typer.Option(0, "--checkpoint-every", min=0, help="save every N steps (and after the last)"),
    max_restarts: int = typer.Option(0, "--max-restarts", min=0, help="torchrun restarts after a worker dies"),
    seed: int = typer.Option(0, "--seed", help="seeds the model, the data and compression's randomness"),
    topk_fraction: Optional[float] = typer.Option(
        None, "--topk-fraction", help="override the plan's topk_fraction: k for compression 'topk' (0 < k <= 1)"),
    powersgd_rank: Optional[int] = typer.Option(
        None, "--powersgd-rank", help="override the plan's powersgd_rank: factor rank for compression 'powersgd'"),
    stochastic_rounding: Optional[bool] = typer.Option(
        None, "--stochastic-rounding/--no-stochastic-rounding",
        help="override the plan's stochastic_rounding: int8 compression rounds stochastically"),
) -> None:
    """Run PLAN with torchrun and print measured (and predicted) step time, memory and loss.

    The compression options are fields of the plan (topk_fraction, powersgd_rank,
    stochastic_rounding); --topk-fraction, --powersgd-rank and --stochastic-rounding run a
    validated copy of the plan with those fields replaced, which is also what is predicted
    and reported. With --checkpoint-dir the job resumes from the newest valid checkpoint there;
    --nproc other than the plan's rank count re-plans the job and reshards the checkpoint
    (elastic resume)."""
    from executor.launch import run

    plan = load_plan(plan_path)
    overrides = {k: v for k, v in dict(topk_fraction=topk_fraction, powersgd_rank=powersgd_rank,
                                       stochastic_rounding=stochastic_rounding).items() if v is not None}
    if overrides:  # validated like the plan file: a bad value is one line naming the field
        plan = plan.with_overrides(**overrides)
    cluster = None
    if hardware:
        from hardware import load

        cluster = load(hardware)
    report = run(plan, model=model, steps=steps, nproc=nproc, cluster=cluster,
                 checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None, checkpoint_every=checkpoint_every,
                 max_restarts=max_restarts, seed=seed)
    if out:
        out.write_text(report.model_dump_json(indent=2))
    typer.echo(f"losses: {', '.join(f'{l:.4f}' for l in report.losses)}")
    typer.echo(f"step time: {report.step_time_s * 1e3:.1f} ms" + _vs(report.predicted_step_time_s, report.step_time_error, 1e3, "ms"))
    typer.echo(f"peak memory: {max(report.peak_memory_bytes) / 2**20:.1f} MiB"
               + _vs(report.predicted_peak_memory_bytes, report.memory_error, 2 ** -20, "MiB"))
    for note in report.notes:
        typer.echo(f"note: {note}")


def _vs(predicted: float | None, error: float | None, scale: float, unit: str) -> str:
    if predicted is None:
        return ""
    return f" (predicted {predicted * scale:.1f} {unit}, error {error:+.1%})"


@app.command("calibrate")
def calibrate_command(
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    ranks: int = typer.Option(2, "--ranks", min=2, help="local ranks for the collective benchmark"),
    out: Path = typer.Option(..., "--out", help="hardware profile JSON to write"),
) -> None:
    """Measure matmul, memory and collective performance; write a sourced hardware profile."""
    from executor.calibrate import calibrate

    cluster = calibrate(device, ranks)
    out.write_text(cluster.model_dump_json(indent=2))
    typer.echo(f"wrote {out}: {cluster.gpu.peak_tflops} TFLOP/s, {cluster.gpu.hbm_gbps:.1f} GB/s memory, "
               f"{cluster.node.link_gbps:.2f} GB/s link")
