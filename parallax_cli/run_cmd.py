"""`parallax run` and `parallax calibrate`: execute a plan, measure a machine."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from hardware.errors import PlanError
from parallax_cli import TRUST_MODULE_HELP, app, check_model, load_plan, write_output


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
    checkpoint_every: Optional[int] = typer.Option(
        None, "--checkpoint-every", min=0,
        help="save every N steps (and after the last); default: the plan's Young/Daly interval"),
    max_restarts: int = typer.Option(0, "--max-restarts", min=0, help="torchrun restarts after a worker dies"),
    nnodes: str = typer.Option("1", "--nnodes", help="nodes in the job: N, or MIN:MAX for an elastic job that "
                                                     "re-plans when nodes are lost"),
    node_rank: int = typer.Option(0, "--node-rank", min=0, help="this node's index (0 on the first node)"),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint",
                                                help="HOST:PORT of torchrun's c10d rendezvous (the first node)"),
    rdzv_id: str = typer.Option("parallax", "--rdzv-id", help="the job's rendezvous id, the same on every node"),
    rdzv_last_call: Optional[int] = typer.Option(None, "--rdzv-last-call", min=0,
                                                 help="seconds to wait for more nodes once the minimum has joined "
                                                      "(torchrun's default: 30)"),
    seed: int = typer.Option(0, "--seed", help="seeds the model, the data and compression's randomness"),
    topk_fraction: Optional[float] = typer.Option(
        None, "--topk-fraction", help="override the plan's topk_fraction: k for compression 'topk' (0 < k <= 1)"),
    powersgd_rank: Optional[int] = typer.Option(
        None, "--powersgd-rank", help="override the plan's powersgd_rank: factor rank for compression 'powersgd'"),
    profile_dir: Optional[Path] = typer.Option(
        None, "--profile-dir", help="record torch.profiler on every rank for the last steps; write the merged "
                                    "measured/predicted trace, the phase table and report.html here"),
    stochastic_rounding: Optional[bool] = typer.Option(
        None, "--stochastic-rounding/--no-stochastic-rounding",
        help="override the plan's stochastic_rounding: int8 compression rounds stochastically"),
    trust_module: bool = typer.Option(False, "--trust-module", help=TRUST_MODULE_HELP),
    trust_checkpoint_dir: bool = typer.Option(False, "--trust-checkpoint-dir",
                                              help="resume from a checkpoint folder other users may write"),
) -> None:
    """Run PLAN with torchrun and print measured (and predicted) step time, memory and loss.

    The compression options are fields of the plan (topk_fraction, powersgd_rank,
    stochastic_rounding); --topk-fraction, --powersgd-rank and --stochastic-rounding run a
    validated copy of the plan with those fields replaced, which is also what is predicted
    and reported. With --checkpoint-dir the job resumes from the newest valid checkpoint there;
    --nproc other than the plan's rank count re-plans the job and reshards the checkpoint
    (elastic resume). On several nodes, run the same command on each with --nnodes,
    --node-rank and --rdzv-endpoint (torchrun's c10d rendezvous); `parallax launch --slurm`
    writes the batch script that does so."""
    from executor.runtime.config import RunConfig, Trust
    from executor.runtime.launch import Nodes, run

    nodes = Nodes(nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                  last_call_s=rdzv_last_call)
    plan = load_plan(plan_path, trust_module)
    check_model(model, trust_module)
    overrides = {k: v for k, v in dict(topk_fraction=topk_fraction, powersgd_rank=powersgd_rank,
                                       stochastic_rounding=stochastic_rounding).items() if v is not None}
    if overrides:  # validated like the plan file: a bad value is one line naming the field
        plan = plan.with_overrides(**overrides)
    cluster = None
    if hardware:
        from hardware import load

        cluster = load(hardware)
    config = RunConfig(model=model, steps=steps, seed=seed, checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
                       checkpoint_every=checkpoint_interval(plan, checkpoint_dir, checkpoint_every),
                       max_restarts=max_restarts, profile_dir=str(profile_dir) if profile_dir else None,
                       trust=Trust(module=trust_module, checkpoint_dir=trust_checkpoint_dir))
    report = run(plan, config, nproc=nproc, nodes=nodes, cluster=cluster)
    if out:
        write_output(out, report.model_dump_json(indent=2))
    guess = (cluster or plan.cluster()).guess_warning()
    if guess:
        typer.echo(guess)
    typer.echo(f"losses: {', '.join(f'{l:.4f}' for l in report.losses)}")
    typer.echo(f"step time: {report.step_time_s * 1e3:.1f} ms" + _vs(report.predicted_step_time_s, report.step_time_error, 1e3, "ms"))
    reserved = f", reserved {max(report.peak_reserved_bytes) / 2**20:.1f} MiB" if report.device == "cuda" else ""
    if reserved and report.predicted_peak_reserved_bytes:
        reserved += f" (predicted {report.predicted_peak_reserved_bytes / 2**20:.1f} MiB)"
    typer.echo(f"peak memory: {max(report.peak_memory_bytes) / 2**20:.1f} MiB allocated{reserved}"
               + _vs(report.predicted_peak_memory_bytes, report.memory_error, 2 ** -20, "MiB"))
    for note in report.notes:
        typer.echo(f"note: {note}")
    if profile_dir:
        from layout.plan import Plan
        from executor.measure.profile_report import profile_report

        for line in profile_report(profile_dir, Plan.model_validate(report.plan), report.model, cluster, trust_module):
            typer.echo(line)


def checkpoint_interval(plan, checkpoint_dir, given: int | None) -> int:
    """--checkpoint-every when given, else the plan's Young/Daly interval (said in one line)."""
    if given is not None or not checkpoint_dir:
        return given or 0
    if plan.checkpointing is None:
        typer.echo("checkpoint: the plan has no checkpoint interval (plan it again, or pass --checkpoint-every); "
                   "saving after the last step only")
        return 0
    typer.echo(f"checkpoint: every {plan.checkpointing.every_steps} steps, the plan's Young/Daly interval "
               f"(expected goodput {plan.checkpointing.goodput:.1%})")
    return plan.checkpointing.every_steps


def _vs(predicted: float | None, error: float | None, scale: float, unit: str) -> str:
    if predicted is None:
        return ""
    return f" (predicted {predicted * scale:.1f} {unit}, error {error:+.1%})"


@app.command("launch")
def launch_command(
    plan_path: Path = typer.Argument(..., help="plan JSON, at a path every node can read"),
    slurm: bool = typer.Option(False, "--slurm", help="write a SLURM batch script (sbatch)"),
    out: Path = typer.Option(..., "--out", help="the script to write"),
    steps: int = typer.Option(5, "--steps", min=1),
    checkpoint_dir: Optional[Path] = typer.Option(None, "--checkpoint-dir", help="shared storage for checkpoints"),
    checkpoint_every: Optional[int] = typer.Option(None, "--checkpoint-every", min=0,
                                                   help="default: the plan's Young/Daly interval"),
    max_restarts: int = typer.Option(3, "--max-restarts", min=0, help="torchrun restarts after a failure"),
    min_nodes: Optional[int] = typer.Option(None, "--min-nodes", min=1,
                                            help="go on with this many nodes when others are lost (re-planned)"),
    port: int = typer.Option(29500, "--rdzv-port", min=1, max=65535, help="the rendezvous port on the first node"),
    trust_module: bool = typer.Option(False, "--trust-module", help=TRUST_MODULE_HELP),
) -> None:
    """Write a batch script that runs PLAN on a cluster: one torchrun per node, c10d rendezvous."""
    from executor.runtime.slurm import batch_script

    if not slurm:
        raise PlanError("launch", "no scheduler named", "pass --slurm")
    plan = load_plan(plan_path, trust_module)
    every = checkpoint_interval(plan, checkpoint_dir, checkpoint_every)
    text = batch_script(plan, str(plan_path.resolve()), steps=steps,
                        checkpoint_dir=str(checkpoint_dir.resolve()) if checkpoint_dir else None,
                        checkpoint_every=every, max_restarts=max_restarts, min_nodes=min_nodes, port=port,
                        trust_module=trust_module)
    write_output(out, text)
    out.chmod(0o755)
    typer.echo(f"wrote {out}: submit it with `sbatch {out}`")


@app.command("calibrate")
def calibrate_command(
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    ranks: int = typer.Option(2, "--ranks", min=2, help="local ranks for the collective benchmark"),
    out: Path = typer.Option(..., "--out", help="hardware profile JSON to write"),
) -> None:
    """Measure matmul, memory and collective performance; write a sourced hardware profile."""
    from executor.measure.calibrate import calibrate

    cluster = calibrate(device, ranks)
    write_output(out, cluster.model_dump_json(indent=2))
    peaks = ", ".join(f"{dtype} {tflops:.3g}" for dtype, tflops in cluster.gpu.peak_tflops.items())
    typer.echo(f"wrote {out}: {peaks} TFLOP/s, {cluster.gpu.hbm_gbps:.1f} GB/s memory, "
               f"{cluster.node.link_gbps:.2f} GB/s link")
