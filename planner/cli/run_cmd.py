"""`parallax run` and `parallax calibrate`: execute a plan, measure a machine."""
from __future__ import annotations

from pathlib import Path

import typer

from planner.cli import app


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
    topk_fraction: float = typer.Option(None, "--topk-fraction", help="k for plan compression 'topk' (default 0.01)"),
    stochastic_rounding: bool = typer.Option(False, "--stochastic-rounding", help="int8 compression rounds stochastically"),
) -> None:
    """Run PLAN with torchrun and print measured (and predicted) step time, memory and loss.

    With --checkpoint-dir the job resumes from the newest valid checkpoint there; --nproc other
    than the plan's rank count re-plans the job and reshards the checkpoint (elastic resume)."""
    from costmodel.plan import Plan
    from executor.launch import run

    plan = Plan.from_json(plan_path.read_text())
    cluster = None
    if hardware:
        from hardware import load

        cluster = load(hardware)
    env = {}
    if topk_fraction is not None:
        env["PARALLAX_TOPK_FRACTION"] = str(topk_fraction)
    if stochastic_rounding:
        env["PARALLAX_STOCHASTIC_ROUNDING"] = "1"
    report = run(plan, model=model, steps=steps, nproc=nproc, cluster=cluster,
                 checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None, checkpoint_every=checkpoint_every,
                 max_restarts=max_restarts, extra_env=env)
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
