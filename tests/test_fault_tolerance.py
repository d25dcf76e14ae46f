"""Checkpoints, kill-and-restart, corrupted checkpoints, elastic resume (CPU, gloo, torchrun).

One uninterrupted 4-rank run (FSDP2, ZeRO-3: the checkpoint is sharded as the plan
shards) is the reference for everything else. Each failure-injecting launch is its
own torchrun job.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

import hardware
from costmodel.goodput import (daly_interval, expected_goodput, first_order_goodput, goodput, young_interval)
from layout.plan import Plan, uniform_stages
from executor.checkpoints.store import latest_valid, verify
from executor.runtime.elastic import replan
from faults import killing

STEPS = 8
EVERY = 2
KINDS = ["embedding"] + ["block"] * 4 + ["head"]


def make_plan(dp: int = 4, zero: int = 3) -> Plan:
    return Plan(model="reference-tiny", hardware="cpu", global_batch=8, seq_len=16, dtype="fp32", dp=dp, tp=1, pp=1,
                zero=zero, micro_batch=8 // dp, stages=uniform_stages(KINDS, 1))


def launch(folder: Path, nproc: int = 4, **kwargs):
    from executor.runtime.launch import run

    from executor.runtime.config import RunConfig

    config = RunConfig(steps=STEPS, checkpoint_dir=str(folder), checkpoint_every=EVERY, **kwargs)
    return run(make_plan(), config, nproc=nproc, timeout_s=600)


def saved_state(folder: Path, tmp: Path) -> dict:
    """A DCP checkpoint as one flat {key: tensor} dict (loaded without a process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{folder.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(str(folder), str(out))
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = value
    walk("", torch.load(out, weights_only=False))
    return flat


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    report = launch(root / "ckpt")
    return root / "ckpt", report


def test_checkpoints_are_complete_and_described(reference):
    folder, report = reference
    assert len(report.losses) == STEPS
    names = sorted(p.name for p in folder.iterdir() if p.name != ".parallax-lock")  # the run lock stays, unlocked
    assert names == ["step-00000004", "step-00000006", "step-00000008"]  # keep=3, no .tmp left behind
    manifest = json.loads((folder / "step-00000008" / "manifest.json").read_text())
    assert manifest["step"] == 8 and manifest["world_size"] == 4
    assert manifest["data_position"] == {"next_step": 8, "samples_consumed": 64, "seed": 0}
    assert sum(1 for f in manifest["files"] if f.endswith(".distcp")) == 4  # one shard file per rank
    assert sum(1 for f in manifest["files"] if f.startswith("extra/")) == 4  # RNG state per rank
    assert verify(folder / "step-00000008")[0] is not None


def test_kill_one_rank_twice_and_resume_bit_identical(reference, tmp_path):
    """Rank 1 is SIGKILLed mid-step on two successive attempts; torchrun restarts the group
    each time and it resumes from the last checkpoint. The final parameters and optimizer
    state equal the uninterrupted run's, bit for bit."""
    folder, ref = reference
    report = launch(tmp_path / "ckpt", max_restarts=2, step_hook=killing([3, 5], rank=1))
    assert any("restarted the workers 2 time" in n for n in report.notes), report.notes
    assert any("resumed from step-00000004" in n for n in report.notes), report.notes
    assert report.losses == ref.losses[4:]
    assert_identical(saved_state(folder / "step-00000008", tmp_path), saved_state(tmp_path / "ckpt" / "step-00000008", tmp_path))


def test_fault_injection_is_a_step_hook_outside_the_run_signatures(tmp_path):
    """The workers read the run's configuration from a file; the hook kills the named rank on
    the named attempt only."""
    from executor.runtime.config import RunConfig
    from executor.runtime.launch import torchrun_command

    cmd = torchrun_command("p.json", "run.json", "r.json", 4)
    assert cmd[cmd.index("executor.runtime.worker") + 1:] == ["p.json", "run.json", "--out", "r.json"]
    config = RunConfig(step_hook=killing([3, 5, 7], rank=1))
    assert RunConfig.model_validate_json(config.model_dump_json()) == config
    calls = []
    hook = config.step_hook.build()
    import faults

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(faults.os, "kill", lambda pid, sig: calls.append(sig))
        for attempt in range(4):
            for step in range(8):
                hook(step, 1, attempt)
                hook(step, 0, attempt)
    assert len(calls) == 3  # steps 3, 5, 7 of attempts 0-2 on rank 1; none on rank 0 or attempt 3
    with pytest.raises(ValueError, match="package.module:function"):
        RunConfig(step_hook={"function": "os.system"})


def test_a_rank_that_outgrows_its_device_stops_the_run_in_one_line(reference, tmp_path):
    """Resumed on a profile whose device holds 1 MiB: the first step's peak is over it, every
    rank stops (none left running), the line names the rank, the step, measured and predicted
    memory and the command that re-plans, and the last good checkpoint is kept."""
    import subprocess
    import tempfile

    from executor.runtime.config import RunConfig
    from executor.runtime.launch import run
    from hardware.errors import RunError

    folder, _ = reference
    work = tmp_path / "ckpt"
    shutil.copytree(folder, work)
    cluster = hardware.load("4xcpu")
    small = cluster.model_copy(update={"gpu": cluster.gpu.model_copy(update={"hbm_gb": 2**-10})})
    scratch = tmp_path / "scratch"  # the run's files, named on its workers' command lines
    scratch.mkdir()
    with pytest.raises(RunError) as failed, pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", str(scratch))
        run(make_plan(), RunConfig(steps=STEPS + 2, checkpoint_dir=str(work)), nproc=4, cluster=small, timeout_s=600)
    line = str(failed.value)
    assert "\n" not in line and line.startswith("rank ") and "DoesNotFit" in line, line
    assert f"in step {STEPS} (the run's first), more than the device's 1.0 MiB; predicted" in line, line
    assert "re-plan with more memory kept free: parallax plan reference-tiny" in line, line
    # this run's workers only: another test's may be running beside it
    assert subprocess.run(["pgrep", "-f", f"executor.runtime.worker {scratch}"], capture_output=True).stdout == b""
    assert latest_valid(work)[0].name == f"step-{STEPS:08d}"


def test_corrupted_checkpoint_is_detected_and_the_previous_one_used(reference, tmp_path):
    folder, ref = reference
    work = tmp_path / "ckpt"
    shutil.copytree(folder, work)
    # unit level: truncated, bit-flipped, manifest-less folders are all refused, .tmp folders ignored
    shard = work / "step-00000008" / "__1_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    assert "truncated" in verify(work / "step-00000008")[1]
    flipped = work / "step-00000006" / "__2_0.distcp"
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    flipped.write_bytes(bytes(raw))
    assert "checksum" in verify(work / "step-00000006")[1]
    (work / ".tmp-step-00000010").mkdir()
    chosen, manifest, messages = latest_valid(work)
    assert chosen.name == "step-00000004" and manifest["step"] == 4 and len(messages) == 2
    # end to end: the job says so, resumes from step 4 and still ends where the uninterrupted run did
    report = launch(work)
    assert any("step-00000008 is invalid" in n and "truncated" in n for n in report.notes), report.notes
    assert any("step-00000006 is invalid" in n and "checksum" in n for n in report.notes), report.notes
    assert any("resumed from step-00000004" in n for n in report.notes)
    assert report.losses == ref.losses[4:]
    assert_identical(saved_state(folder / "step-00000008", tmp_path), saved_state(work / "step-00000008", tmp_path))


def test_resume_on_two_ranks_from_a_four_rank_checkpoint(reference, tmp_path):
    """Elastic: the 4-rank ZeRO-3 checkpoint is resharded onto 2 ranks, re-planned by the
    planner; the loss continues on the uninterrupted run's curve."""
    folder, ref = reference
    work = tmp_path / "ckpt"
    work.mkdir()
    shutil.copytree(folder / "step-00000004", work / "step-00000004")
    report = launch(work, nproc=2)
    assert any("elastic re-plan for 2 ranks: the planner picked" in n for n in report.notes), report.notes
    assert any("written by 4 ranks, resharded onto 2" in n for n in report.notes), report.notes
    assert report.world_size == 2 and Plan.model_validate(report.plan).n_gpus == 2
    assert report.losses == pytest.approx(ref.losses[4:], abs=1e-4)
    resumed = saved_state(work / "step-00000008", tmp_path)
    uninterrupted = saved_state(folder / "step-00000008", tmp_path)
    for key, value in uninterrupted.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert torch.allclose(resumed[key], value, atol=1e-4), key


def test_replan_asks_the_planner_and_keeps_the_batch():
    plan = make_plan(dp=4).model_copy(update={"micro_batch": 2})
    new, note = replan(plan, 2, KINDS)
    assert new.n_gpus == 2 and new.global_batch == 8 and new.seq_len == plan.seq_len and new.dtype == "fp32"
    assert note.startswith("elastic re-plan for 2 ranks: the planner picked") and new.estimate is not None
    same, note = replan(plan, 4, KINDS)
    assert same is plan and note == ""


def test_replan_of_a_model_the_planner_cannot_name_keeps_its_model_parallel_layout():
    plan = make_plan(dp=4).model_copy(update={"micro_batch": 2, "model": "tests.failing_model:build"})
    new, note = replan(plan, 2, KINDS)
    assert (new.dp, new.tp, new.pp, new.micro_batch, new.global_batch) == (2, 1, 1, 2, 8) and "dp 4->2" in note


# ------------------------------------------------------------------ goodput

def test_young_daly_and_goodput_formulas():
    delta, mtbf, restart = 30.0, 3600.0 * 50, 600.0
    assert young_interval(delta, mtbf) == pytest.approx(math.sqrt(2 * delta * mtbf))
    tau = young_interval(delta, mtbf)
    # Daly's exact exponential model agrees with the first-order one when delta, tau << M
    assert expected_goodput(tau, delta, restart, mtbf) == pytest.approx(first_order_goodput(tau, delta, restart, mtbf), abs=2e-3)
    # Young's interval is (near) optimal: the numerical optimum of Daly's model is within Daly's estimate
    grid = [tau * f for f in (0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 2.0)]
    best = max(grid, key=lambda t: expected_goodput(t, delta, restart, mtbf))
    assert best in (tau * 0.9, tau, tau * 1.1)
    assert daly_interval(delta, mtbf) == pytest.approx(tau, rel=0.05)
    # no failures: only the checkpoint overhead remains
    assert expected_goodput(100.0, 1.0, restart, math.inf) == pytest.approx(100 / 101)


def test_goodput_falls_with_cluster_size():
    values = [goodput(70e9, hardware.load(f"{n}xh100-sxm")).goodput for n in (64, 1024, 16384)]
    assert values[0] > values[1] > values[2]
    g = goodput(70e9, hardware.load("1024xh100-sxm"))
    assert g.job_mtbf_s == pytest.approx(50700 * 3600 / 1024)
    assert g.checkpoint_bytes == pytest.approx(70e9 * 14)  # bf16 weights + fp32 master and Adam moments
    # each of the 128 nodes writes at the profile's sourced 0.98 GB/s
    assert g.write_s == pytest.approx(70e9 * 14 / (128 * 0.98e9))
    assert "Llama 3" in g.sources["storage_gbps"]
    assert g.optimal_interval_s == pytest.approx(math.sqrt(2 * g.write_s * g.job_mtbf_s))


def test_whatif_goodput_column_falls_with_cluster_size(small_gpt):
    from hardware.errors import InfeasibleError
    from planner.whatif import whatif

    def nothing_fits(model, cluster, **_):  # the goodput column needs only the parameter count and the cluster
        raise InfeasibleError("hw", "stub")

    rows = whatif(small_gpt, ["h100-sxm"], [64, 1024, 16384], global_batch=1024, seq_len=1024, plan_fn=nothing_fits)
    values = [r.goodput_fraction for r in rows]
    assert values[0] > values[1] > values[2]
    expected = goodput(small_gpt.params, hardware.load("1024xh100-sxm")).optimal_interval_s
    assert rows[1].checkpoint_interval_s == pytest.approx(expected)
