"""No silent guesses: a placeholder profile says so first, a CPU without fast bf16 plans fp32,
and calibration stays bounded on a CPU whose bf16 is tens of times slower than its fp32."""
from __future__ import annotations

from pathlib import Path

import torch

import hardware
import planner
from costmodel.validate import default_dtype
from parallax_cli import main

PROFILE = Path(__file__).parent / "data" / "cpu4-profile.json"


def test_a_profile_without_faster_bf16_plans_fp32_and_says_why():
    plan = planner.plan("reference-tiny", "4xcpu", global_batch=8, seq_len=16, top_k=1)
    assert plan.dtype == "fp32" and plan.notes[0].startswith("dtype fp32: cpu's bf16 matmuls")
    assert planner.plan("reference-tiny", "4xcpu", global_batch=8, seq_len=16, dtype="bf16", top_k=1).dtype == "bf16"
    assert default_dtype(hardware.load("8xh100-sxm")) == ("bf16", "")
    slow = hardware.load(str(PROFILE))
    slow = slow.model_copy(update={"gpu": slow.gpu.model_copy(update={"peak_tflops": {"fp32": 0.033, "bf16": 0.0006}})})
    assert default_dtype(slow)[0] == "fp32"


def test_a_catalog_guess_says_so_on_the_first_line(capsys, tmp_path):
    out = tmp_path / "p.json"
    assert main(["plan", "reference-tiny", "--hw", "4xcpu", "--global-batch", "8", "--seq-len", "16", "--out", str(out)]) == 0
    first = capsys.readouterr().out.strip().splitlines()[0]
    assert first.startswith("4xcpu is a catalog guess, not this machine: run parallax calibrate")
    assert main(["estimate", "reference-tiny", "--hw", "4xcpu", "--plan", str(out)]) == 0
    assert capsys.readouterr().out.startswith("4xcpu is a catalog guess")
    assert hardware.load(str(PROFILE)).guess_warning() == "" and hardware.load("8xh100-sxm").guess_warning() == ""


def test_matmul_sizes_stop_growing_past_the_call_budget():
    from executor.measure.calibrate import slow_dtype_notes
    from executor.measure.microbench import matmul_curve

    assert list(matmul_curve("cpu", torch.float32, sizes=(32, 64, 128), call_budget_s=0.0)) == [32]
    assert list(matmul_curve("cpu", torch.float32, sizes=(32, 64, 128), call_budget_s=60.0)) == [32, 64, 128]
    results = [{("matmul", "fp32"): {256: 1, 2048: 1}, ("matmul", "bf16"): {256: 1, 512: 1}}]
    note = slow_dtype_notes({"fp32": 0.033, "bf16": 0.0006}, results)
    assert note == "; bf16: no native units here, 55x slower than fp32, measured at d <= 512 only"
    assert slow_dtype_notes({"fp32": 0.05, "bf16": 0.2}, results) == ""
