"""Launch a plan with torchrun and collect its run report.

One node runs `torchrun --standalone`; several meet at torchrun's own c10d rendezvous
(`Nodes`): the same command on every node, each starting its share of the ranks, and
an elastic range `--nnodes MIN:MAX` lets the job go on when nodes are lost (the
workers re-plan for the ranks that are left, executor/runtime/elastic.py).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from layout.plan import Plan
from hardware.errors import ParallaxError, PlanError, RunError

from executor.runtime.config import RunConfig, Trust
from executor.runtime.models import build_model, parameter_shapes
from executor.runtime.predict import predict
from executor.runtime.report import RunReport
from executor.apply.validate import validate


@dataclass(frozen=True)
class Nodes:
    """Where the ranks run: one node, or `nnodes` ("N", or "MIN:MAX" for an elastic job)
    meeting at the c10d rendezvous on `rdzv_endpoint`, HOST:PORT of node 0, which hosts it."""
    nnodes: str = "1"
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str = "parallax"
    last_call_s: int | None = None  # c10d's wait for late nodes once MIN have joined (torchrun's default: 30 s)

    def __post_init__(self) -> None:
        parts = str(self.nnodes).split(":")
        if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts) or int(parts[0]) > int(parts[-1]):
            raise PlanError("nnodes", f"cannot read {self.nnodes!r}", "pass a node count N, or MIN:MAX for an elastic job")
        if not 0 <= self.node_rank < self.max_nodes:
            raise PlanError("node_rank", f"{self.node_rank} is not a node of {self.max_nodes}", f"use 0..{self.max_nodes - 1}")
        if self.max_nodes > 1 and not self.rdzv_endpoint:
            raise PlanError("rdzv_endpoint", f"{self.max_nodes} nodes need a rendezvous endpoint",
                            "pass --rdzv-endpoint HOST:PORT, the first node's address and a free port")
        if self.rdzv_endpoint and (":" not in self.rdzv_endpoint or not self.rdzv_endpoint.rsplit(":", 1)[1].isdigit()):
            raise PlanError("rdzv_endpoint", f"cannot read {self.rdzv_endpoint!r}", "pass HOST:PORT, e.g. node001:29500")

    @property
    def max_nodes(self) -> int:
        return int(str(self.nnodes).split(":")[-1])

    @property
    def single(self) -> bool:
        return self.max_nodes == 1 and not self.rdzv_endpoint

    def torchrun_args(self) -> list[str]:
        if self.single:
            return ["--standalone"]
        # node 0 hosts the rendezvous store at the endpoint (its own address), the others join it:
        # left to torchrun, whichever agent started first on a shared host would, and its death
        # would end the job instead of shrinking it
        return ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", str(self.rdzv_endpoint), "--rdzv-id", self.rdzv_id,
                "--rdzv-conf", f"is_host={int(self.node_rank == 0)}"
                + (f",last_call_timeout={self.last_call_s}" if self.last_call_s is not None else "")]


def torchrun_command(plan_path: str, config_path: str, out_path: str, nproc: int, nodes: Nodes = Nodes(),
                     max_restarts: int = 0, log_dir: str | None = None) -> list[str]:
    """`python -m torch.distributed.run` for this node's ranks: each reads the plan and the run's
    configuration from their files. With `log_dir`, torchrun keeps every rank's stdout and stderr
    there and each failing rank writes its exception there too (see `first_failure`)."""
    node_args = nodes.torchrun_args()
    if log_dir:
        node_args += ["--log-dir", log_dir, "--redirects", "3"]
    if max_restarts:
        node_args += ["--max-restarts", str(max_restarts)]
    return [sys.executable, "-m", "torch.distributed.run", *node_args, "--nproc-per-node", str(nproc),
            "-m", "executor.runtime.worker", plan_path, config_path, "--out", out_path,
            *(["--failure-dir", log_dir] if log_dir else [])]


def run(plan: Plan, config: RunConfig = RunConfig(), *, nproc: int | None = None, nodes: Nodes = Nodes(),
        cluster=None, timeout_s: float | None = None) -> RunReport:
    """Validate (before any process starts), launch, and return the report with predictions.

    Everything the workers do comes from `plan` (compression options included) and `config`,
    both written to files they read. With `config.checkpoint_dir`, the job saves every
    `checkpoint_every` steps (and at the end) and resumes from the newest valid checkpoint
    there, checked first (`executor.checkpoints.guard`: owner, lock, step, model, seed,
    parameters); torchrun restarts it up to `max_restarts` times after a worker dies. A rank
    count other than the plan's re-plans the job (executor/runtime/elastic.py) and the checkpoint is
    resharded on load.

    `nproc`: this node's ranks (default: the plan's, shared among the nodes); `nodes`: this
    node's place in a multi-node job, where every node runs the same call and prints the same
    report (each node's first rank writes it); `cluster`: the profile the prediction is for
    (default: the plan's). SIGINT or SIGTERM stops torchrun and every worker and raises
    `hardware.errors.Interrupted`."""
    model = config.model_for(plan.model)
    nproc = nproc or max(1, plan.n_gpus // nodes.max_nodes)
    with torch.device("meta"):  # its structure alone, to check the plan against: a 70B is refused without 280 GB
        module = build_model(model, trust_module=config.trust.module)
    replanned = ""
    if config.checkpoint_dir and nproc * nodes.max_nodes != plan.n_gpus:
        from executor.runtime.elastic import replan

        plan, replanned = replan(plan.model_copy(update={"model": model}), nproc * nodes.max_nodes, layer_kinds(module))
    if plan.compression != "none":
        from executor.apply.compression import check_compression

        check_compression(plan)
    validate(plan, module, world_size=nproc * nodes.max_nodes)
    if cluster is not None and config.device_memory_bytes is None:  # the profile's memory is the ranks' device
        config = config.model_copy(update={"device_memory_bytes": cluster.gpu.hbm_gb * 2**30})
    with ExitStack() as held:
        if config.checkpoint_dir:
            _check_checkpoint(Path(config.checkpoint_dir), held, nodes, config.trust, model=model, seed=config.seed,
                              steps=config.steps, parameters=parameter_shapes(module))
        del module
        try:
            report = _launch(plan, config, nproc, nodes, timeout_s)
        except RunError as error:
            raise _said_with_prediction(error, plan, model, cluster, config) from None
    if replanned:
        report = report.model_copy(update={"notes": [replanned, *report.notes]})
    ran = Plan.model_validate(report.plan)  # the workers' own re-plan when nodes were lost
    report = report.model_copy(update={"notes": [*report.notes, *executed_dtype_notes(ran, report.device)]})
    step, peak, reserved, note = predict(ran, model, cluster, config.trust.module)
    peak, measured_eagerly = _memory_as_measured(ran, report.device, peak, model, cluster, config)
    if measured_eagerly:
        report = report.model_copy(update={"notes": [*report.notes, measured_eagerly]})
    return report.with_prediction(step, peak, note or _elsewhere(ran, report.device, cluster), reserved)


def _memory_as_measured(plan: Plan, device: str, peak, model: str, cluster, config: RunConfig):
    """(the peak to hold the measurement to, a note): a compiled plan's memory steps run eagerly on
    a CPU (executor.measure.memory), so there it is held to the eager price of the same layout."""
    if plan.stack != "compile" or device != "cpu" or peak is None:
        return peak, ""
    eager = predict(plan.model_copy(update={"stack": "eager"}), model, cluster, config.trust.module).peak_bytes
    if eager is None:
        return peak, ""
    return eager, (f"compile: the CPU's memory steps ran eagerly, so memory is held to the eager price "
                   f"({eager / 2**20:,.1f} MiB); the compiled steps' price is {peak / 2**20:,.1f} MiB (torch.compile's "
                   "partition recomputes pointwise ops), what a GPU's allocator measures")


RETRY_RESERVE = 0.1  # a tenth of each GPU kept free beyond the predicted reservation, for the re-plan


def _said_with_prediction(error: RunError, plan: Plan, model: str, cluster, config: RunConfig) -> RunError:
    """A rank that ran out of memory: its line with the prediction and the command that re-plans
    with more memory kept free; any other failure as it was."""
    if "DoesNotFit" not in error.problem:
        return error
    peak = predict(plan, model, cluster, config.trust.module).peak_bytes
    predicted = f"; predicted {peak / 2**20:,.1f} MiB at the plan's peak rank" if peak else ""
    from hardware import loads_back

    where = plan.hardware if cluster is None else cluster.spec() if loads_back(cluster) else "PROFILE (the --hardware file)"
    command = (f"parallax plan {model} --hw {where} --global-batch {plan.global_batch} --seq-len {plan.seq_len} "
               f"--memory-reserve {RETRY_RESERVE:g}")
    return RunError(error.field, error.problem + predicted, f"re-plan with more memory kept free: {command}; {error.hint}")


def _check_checkpoint(root: Path, held: ExitStack, nodes: Nodes, trust: Trust, **run) -> None:
    """Owner and lock (the first node's launcher holds it for the job), then what a resume would load."""
    from executor.checkpoints.guard import FolderLock, check_owner, check_resume

    check_owner(root, trust.checkpoint_dir)
    if nodes.node_rank == 0:
        held.enter_context(FolderLock(root))
    check_resume(root, **run)


def _launch(plan: Plan, config: RunConfig, nproc: int, nodes: Nodes, timeout_s: float | None) -> RunReport:
    """torchrun for this node's ranks, stopped whole on an interrupt; the workers' report."""
    from executor.runtime.process_tree import run_interruptible

    resolved = {key: str(Path(value).resolve()) for key in ("checkpoint_dir", "profile_dir")
                if (value := getattr(config, key))}
    config = config.model_copy(update=resolved)  # the workers may start in another folder
    logs = tempfile.mkdtemp(prefix="parallax-logs-")
    with tempfile.TemporaryDirectory(prefix="parallax-run-") as tmp:
        plan_path, config_path, out_path = Path(tmp, "plan.json"), Path(tmp, "run.json"), Path(tmp, "report.json")
        plan_path.write_text(plan.to_json())
        config_path.write_text(config.model_dump_json())
        cmd = torchrun_command(str(plan_path), str(config_path), str(out_path), nproc, nodes, config.max_restarts, logs)
        model = config.model_for(plan.model)
        try:
            done = run_interruptible(cmd, worker_env(model, nproc, config.trust.module), timeout_s)
        except subprocess.TimeoutExpired:
            raise RunError("run", f"no result after {timeout_s:.0f} s", f"per-rank logs are in {logs}") from None
        if done.returncode != 0 or not out_path.exists():
            raise first_failure(logs, done.returncode, done.stderr)
        report = RunReport.model_validate_json(out_path.read_text())
    shutil.rmtree(logs, ignore_errors=True)
    return report


def worker_env(model: str, nproc: int, trust_module: bool) -> dict[str, str]:
    """The workers' environment: the project and a trusted factory's folder on the path, never
    the current folder (a `sitecustomize.py` or an `executor/` there would run in every worker)."""
    from planner.factory import factory_folder, names_factory

    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # a fresh TCPStore per torchrun attempt
    # CPU threads: the node's cores split among its ranks (at least 1 each), so that the ranks'
    # intra-op thread pools do not oversubscribe the cores; a caller's OMP_NUM_THREADS is kept.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    own = [str(Path(__file__).resolve().parents[2])]
    if trust_module and names_factory(model):
        own.append(factory_folder(model))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*own, env.get("PYTHONPATH")]))
    env["PYTHONSAFEPATH"] = "1"  # `python -m` then leaves the current folder off sys.path
    return env


def _elsewhere(plan: Plan, device: str, cluster) -> str:
    """The note that says a GPU plan ran on this CPU, so its prediction is not of this machine."""
    if cluster is not None or device != "cpu":
        return ""
    try:
        planned = plan.cluster()
    except ParallaxError:  # the prediction already says why it has none
        return ""
    gpus = [g.gpu for g in planned.groups] if plan.groups else [planned.gpu]
    if all(gpu.device_type == "cpu" for gpu in gpus):
        return ""
    return (f"predicted for {plan.hardware}, not this CPU: pass --hardware PROFILE (from `parallax calibrate`) "
            "to predict this machine")


def layer_kinds(module) -> list[str]:
    """The executor's expanded layers as the plan's stages name them."""
    from executor.apply.layers import layer_map

    lmap = layer_map(module)
    return ["embedding"] + ["block"] * (lmap.n_layers - 2) + ["head"]


def executed_dtype_notes(plan: Plan, device: str) -> list[str]:
    """How the plan's dtype ran (see executor.runtime.train.precision)."""
    if plan.dtype == "fp32":
        return []
    states = (f"weights and gradients in {plan.master_dtype}, AdamW state in {plan.optimizer_dtype}"
              if plan.master_dtype != "fp32" else "weights, gradients and AdamW state in fp32")
    if plan.dtype == "fp8":
        return [f"fp8 plan executed in bf16: {states}, compute under torch.autocast({device}, bf16); this executor "
                "has no FP8 GEMMs, so the measured step is a bf16 step"]
    return [f"{plan.dtype}: {states}, compute under torch.autocast({device}, {plan.dtype})"]


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
