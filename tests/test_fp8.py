"""FP8: GEMMs at the GPU's FP8 peak, the rest in bf16, refused where the GPU has no FP8 peak."""
import pytest

import hardware
import planner
from costmodel import estimate
from costmodel.compute import Context, forward_parts
from costmodel.memory import model_state_bytes
from executor.runtime.launch import executed_dtype_notes
from hardware.errors import PlanError


@pytest.fixture(scope="module")
def llama_8b():
    from planner.resolve import resolve_workload

    return resolve_workload("llama-3-8b", seq_len=4096, dtype="bf16")


def test_fp8_runs_only_the_gemms_at_the_fp8_peak(llama_8b):
    cluster = hardware.load("8xh100-sxm")
    block = next(layer for layer in llama_8b.layers if layer.kind == "block")
    kw = dict(cluster=cluster, tp=1, sp=False, micro_batch=1, tp_group=None)
    gemm16, attn16, mem16 = forward_parts(block, Context(dtype="bf16", **kw))
    gemm8, attn8, mem8 = forward_parts(block, Context(dtype="fp8", **kw))
    eff = cluster.gpu.efficiency
    ratio = cluster.gpu.peak_tflops["fp8"] * eff.fp8_matmul_max / (cluster.gpu.peak_tflops["bf16"] * eff.matmul_max)
    assert gemm16 / gemm8 == pytest.approx(ratio)  # matmul_half_dim scales both alike
    assert (attn8, mem8) == (attn16, mem16)


def test_fp8_keeps_bf16_weights_and_fp32_states_plus_its_cast():
    """Transformer Engine (the fused stack) keeps its FP8 weight copy beside the bf16 weights; under
    autocast (eager) the fp32 weights are cast per GEMM, and the states are the autocast ones."""
    assert model_state_bytes(1.0, "fp8", 0, 1) == model_state_bytes(1.0, "bf16", 0, 1)
    bf16 = model_state_bytes(1.0, "bf16", 0, 1, "fused")
    fp8 = model_state_bytes(1.0, "fp8", 0, 1, "fused")
    assert fp8["weights"] == bf16["weights"] + 1
    assert (fp8["gradients"], fp8["optimizer"]) == (bf16["gradients"], bf16["optimizer"])


def test_fp8_plan_is_faster_than_bf16_on_h100():
    kw = dict(global_batch=64, seq_len=4096, time_limit_s=2)
    fp8 = planner.plan("llama-3-8b", "8xh100-sxm", dtype="fp8", **kw)
    bf16 = planner.plan("llama-3-8b", "8xh100-sxm", dtype="bf16", **kw)
    assert fp8.dtype == "fp8"
    assert 1.1 < bf16.estimate.step_time_s / fp8.estimate.step_time_s < 2.0


def test_fp8_is_refused_on_a_gpu_without_an_fp8_peak(llama_8b):
    with pytest.raises(PlanError, match="fp8 peak") as err:
        planner.plan("llama-3-8b", "8xa100-80g", dtype="fp8", global_batch=64, seq_len=4096)
    assert err.value.field == "dtype"
    bf16 = planner.plan("llama-3-8b", "8xa100-80g", global_batch=64, seq_len=4096, time_limit_s=2)
    with pytest.raises(PlanError, match="fp8"):
        estimate(llama_8b, bf16.with_overrides(dtype="fp8"), hardware.load("8xa100-80g"))


def test_the_run_report_says_fp8_ran_in_bf16():
    plan = planner.plan("reference-tiny", "2xh100-sxm", dtype="fp8", global_batch=4, seq_len=32, time_limit_s=1)
    (note,) = executed_dtype_notes(plan, "cpu")
    assert "fp8 plan executed in bf16" in note
