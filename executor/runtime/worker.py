"""What torchrun starts on every rank: read the plan, materialise, train, report.

    python -m executor.runtime.worker PLAN.json RUN.json --out report.json [--failure-dir DIR]

Everything the worker does comes from the plan and the run's configuration
(executor/runtime/config.py: RunConfig), both written by the launcher; from the
environment it reads only what torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
TORCHELASTIC_RESTART_COUNT, ...) and OMP_NUM_THREADS.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from layout.plan import Plan
from executor.runtime.config import RunConfig
from executor.runtime.mesh import device_and_backend, init_distributed
from executor.runtime.report import RunReport
from executor.runtime.train import run_rank, steady_step_time


def _gather_report(plan: Plan, model: str, steps: int, mine: dict) -> RunReport | None:
    """The run report, on each node's first rank (every node's launcher prints it)."""
    everyone: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return None
    mine = everyone[0]
    ran = len(mine["step_times_s"])  # fewer than `steps` when resumed from a checkpoint
    times = [max(r["step_times_s"][i] for r in everyone) for i in range(ran)]
    notes = list(mine.get("notes", []))
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restarts:
        notes.insert(0, f"torchrun restarted the workers {restarts} time(s)")
    if mine.get("start_step"):
        notes.append(f"losses and times are for steps {mine['start_step']}..{steps - 1}")
    return RunReport(model=model, plan=json.loads(plan.to_json()), steps=steps, world_size=len(everyone),
                     device=device_and_backend()[0], losses=mine["losses"], step_times_s=times,
                     step_time_s=steady_step_time(times, mine.get("profiled_steps", [])) if times else 0.0,
                     peak_memory_bytes=[r["peak_memory_bytes"] for r in everyone],
                     peak_reserved_bytes=[r["peak_reserved_bytes"] for r in everyone],
                     tp_replicated=mine["tp_replicated"], notes=notes)


def _plan_for_world(plan: Plan, model: str, trust_module: bool) -> tuple[Plan, str]:
    """The plan itself, or (after torchrun's elastic agent restarted the job on fewer nodes)
    rank 0's re-plan for the ranks that are left, the same on every rank."""
    world = dist.get_world_size()
    if world == plan.n_gpus:
        return plan, ""
    answer: list = [None, ""]
    if dist.get_rank() == 0:
        from executor.runtime.elastic import replan
        from executor.runtime.launch import layer_kinds
        from executor.runtime.models import build_model
        from hardware.errors import ParallaxError

        try:
            new, note = replan(plan.model_copy(update={"model": model}), world, layer_kinds(build_model(model, trust_module=trust_module)))
            answer = [new.to_json(), note]
        except ParallaxError as error:
            answer = [None, str(error)]
    dist.broadcast_object_list(answer, src=0)
    if answer[0] is None:
        from hardware.errors import PlanError

        raise PlanError("world size", answer[1])
    return Plan.from_json(answer[0]), answer[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("plan", help="the plan, as `Plan.to_json` writes it")
    parser.add_argument("config", help="the run's configuration, as `RunConfig.model_dump_json` writes it")
    parser.add_argument("--out", required=True)
    parser.add_argument("--failure-dir", default=None, help="write this rank's exception here if it fails")
    args = parser.parse_args(argv)
    try:
        _work(args)
    except Exception as error:
        if args.failure_dir:
            _record_failure(args.failure_dir, error)
        raise


def _record_failure(folder: str, error: Exception) -> None:
    import time

    rank = os.environ.get("RANK", "?")
    root = error
    while root.__cause__ is not None:  # pipelining wraps a stage's error: report what went wrong inside
        root = root.__cause__
    record = {"rank": rank, "type": type(root).__name__, "message": str(root) or repr(root), "time": time.time()}
    with open(os.path.join(folder, f"failure.rank{rank}.json"), "w") as fh:
        json.dump(record, fh)


def _work(args) -> None:
    if device_and_backend()[0] == "cpu":
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    plan = Plan.from_json(open(args.plan).read())
    with open(args.config) as fh:
        config = RunConfig.model_validate_json(fh.read())
    model = config.model_for(plan.model)
    init_distributed()
    plan, replanned = _plan_for_world(plan, model, config.trust.module)
    mine = run_rank(plan, config)
    if replanned:
        mine["notes"].insert(0, replanned)
    report = _gather_report(plan, model, config.steps, mine)
    if report is not None:
        with open(args.out, "w") as fh:
            fh.write(report.model_dump_json(indent=2))
    # Clean gloo shutdown: barrier, destroy, flush, then skip interpreter teardown (can SIGABRT).
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
