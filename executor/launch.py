"""Launch a plan with torchrun and collect its run report."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from costmodel.plan import Plan
from hardware.errors import PlanError, RunError

from executor.models import build_model
from executor.predict import predict
from executor.report import RunReport
from executor.validate import validate


def torchrun_command(plan_path: str, out_path: str, model: str, steps: int, nproc: int,
                     extra_torchrun_args=(), checkpoint_dir: str | None = None, checkpoint_every: int = 0,
                     max_restarts: int = 0, seed: int = 0, fail_at: list[int] | None = None,
                     fail_rank: int = 1, log_dir: str | None = None) -> list[str]:
    """`python -m torch.distributed.run` for one node, or multi-node when rendezvous args are given.
    With `log_dir`, torchrun keeps every rank's stdout and stderr there and each
    failing rank writes its exception there too (see `first_failure`)."""
    node_args = list(extra_torchrun_args) or ["--standalone"]
    if log_dir:
        node_args += ["--log-dir", log_dir, "--redirects", "3"]
    if max_restarts:
        node_args += ["--max-restarts", str(max_restarts)]
    ckpt = ["--checkpoint-dir", checkpoint_dir, "--checkpoint-every", str(checkpoint_every)] if checkpoint_dir else []
    fail = ["--fail-at", ",".join(str(s) for s in fail_at), "--fail-rank", str(fail_rank)] if fail_at else []
    return [sys.executable, "-m", "torch.distributed.run", *node_args, "--nproc-per-node", str(nproc),
            "-m", "executor.worker", plan_path, "--model", model, "--steps", str(steps), "--seed", str(seed),
            "--out", out_path, *ckpt, *fail, *(["--failure-dir", log_dir] if log_dir else [])]


def run(plan: Plan, model: str | None = None, steps: int = 5, nproc: int | None = None,
        extra_torchrun_args=(), cluster=None, timeout_s: float | None = None,
        checkpoint_dir: str | None = None, checkpoint_every: int = 0, max_restarts: int = 0,
        seed: int = 0, fail_at: list[int] | None = None, fail_rank: int = 1) -> RunReport:
    """Validate (before any process starts), launch, and return the report with predictions.

    Everything the workers do comes from `plan` (compression options included) and these
    arguments, passed on their command line. With `checkpoint_dir`, the job saves every
    `checkpoint_every` steps (and at the end) and resumes from the newest valid checkpoint
    there; torchrun restarts it up to `max_restarts` times after a worker dies. A rank count
    other than the plan's re-plans the job (executor/elastic.py) and the checkpoint is
    resharded on load. `seed` seeds the model, the data and compression's randomness.

    `fail_at` / `fail_rank` are fault injection for the restart tests: on torchrun attempt i,
    rank `fail_rank` SIGKILLs itself mid-step at step `fail_at[i]`."""
    model = model or plan.model
    nnodes = _nnodes(extra_torchrun_args)
    nproc = nproc or plan.n_gpus // nnodes
    module = build_model(model)
    replanned = ""
    if checkpoint_dir and nproc * nnodes != plan.n_gpus:
        from executor.elastic import replan
        from executor.layers import layer_map

        lmap = layer_map(module)
        kinds = ["embedding"] + ["block"] * (lmap.n_layers - 2) + ["head"]
        plan, replanned = replan(plan, nproc * nnodes, kinds)
    if plan.compression != "none":
        from executor.compression import check_compression

        check_compression(plan)
    validate(plan, module, world_size=nproc * nnodes)
    if checkpoint_dir:
        from executor.checkpoint import check_checkpointable

        check_checkpointable(plan)
    logs = tempfile.mkdtemp(prefix="parallax-logs-")
    with tempfile.TemporaryDirectory(prefix="parallax-run-") as tmp:
        plan_path, out_path = Path(tmp, "plan.json"), Path(tmp, "report.json")
        plan_path.write_text(plan.to_json())
        # a fresh TCPStore per torchrun attempt: restarted gloo workers reconnect reliably
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        # CPU threads: the node's cores split among its ranks (at least 1 each), so that the ranks'
        # intra-op thread pools do not oversubscribe the cores (torchrun's own default is 1 thread);
        # a caller's OMP_NUM_THREADS is kept. The worker sizes torch's pool from it.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
        cmd = torchrun_command(str(plan_path), str(out_path), model, steps, nproc, extra_torchrun_args,
                               str(checkpoint_dir) if checkpoint_dir else None, checkpoint_every, max_restarts,
                               seed=seed, fail_at=fail_at, fail_rank=fail_rank, log_dir=logs)
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RunError("run", f"no result after {timeout_s:.0f} s", f"per-rank logs are in {logs}") from None
        if done.returncode != 0 or not out_path.exists():
            raise first_failure(logs, done.returncode, done.stderr)
        report = RunReport.model_validate_json(out_path.read_text())
    shutil.rmtree(logs, ignore_errors=True)
    if replanned:
        report = report.model_copy(update={"notes": [replanned, *report.notes]})
    report = report.model_copy(update={"notes": [*report.notes, *executed_dtype_notes(plan, report.device)]})
    return report.with_prediction(*predict(plan, model, cluster))


def executed_dtype_notes(plan: Plan, device: str) -> list[str]:
    """How the plan's dtype ran (see executor.train.precision)."""
    if plan.dtype == "fp32":
        return []
    if plan.dtype == "fp8":
        return [f"fp8 plan executed in bf16: weights, gradients and AdamW state in fp32, compute under "
                f"torch.autocast({device}, bf16); this executor has no FP8 GEMMs, so the measured step is a bf16 step"]
    return [f"{plan.dtype}: weights, gradients and AdamW state in fp32, compute under torch.autocast({device}, {plan.dtype})"]


def first_failure(log_dir: str, exit_code: int, stderr: str) -> RunError:
    """The root failure: the earliest exception a rank recorded, preferring one that is not
    just a peer noticing the crash ("Connection closed by peer", a timeout)."""
    records = []
    for path in Path(log_dir).glob("failure.rank*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    where = f"per-rank logs are in {log_dir}"
    if not records:
        last = next((line for line in reversed(stderr.strip().splitlines()) if line.strip()), "no output")
        return RunError("run", f"torchrun exited {exit_code} with no rank reporting an exception: {last[:300]}", where)
    secondary = ("closed by peer", "Connection reset", "timed out", "Timeout", "ProcessGroupGloo")
    records.sort(key=lambda r: (any(s in r["message"] for s in secondary), r["time"]))
    first = records[0]
    message = " ".join(first["message"].split())[:400]
    return RunError(f"rank {first['rank']}", f"{first['type']}: {message}", where)


def _nnodes(args) -> int:
    args = list(args)
    for i, arg in enumerate(args):
        if arg.startswith("--nnodes"):
            value = arg.split("=", 1)[1] if "=" in arg else args[i + 1]
            try:
                return int(value.split(":")[-1])
            except ValueError as error:
                raise PlanError("nnodes", f"cannot read {value!r}", "pass --nnodes N") from error
    return 1
