"""FP8: the blocks' GEMMs at the GPU's FP8 peak, the rest in bf16, the casts priced by stack, refused where
the GPU has no FP8 peak."""
import pytest

import hardware
import planner
from costmodel import estimate
from costmodel.compute import Context, fp8_cast_times, forward_parts
from costmodel.fp8 import CAST_RECIPES, amax_all_reduces, weight_cast_bytes_per_param
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


def test_fp8_plan_is_faster_than_bf16_on_h100_where_its_casts_are_fused():
    """Compiled (torchao's casts fused by inductor) and fused (Transformer Engine) FP8 beat bf16;
    eager's unfused casts (one kernel per op of each cast) eat the faster GEMMs."""
    kw = dict(global_batch=64, seq_len=4096, time_limit_s=2)
    speedup = {}
    for stack in ("eager", "compile", "fused"):
        fp8 = planner.plan("llama-3-8b", "8xh100-sxm", dtype="fp8", fixed={"stack": stack}, **kw)
        bf16 = planner.plan("llama-3-8b", "8xh100-sxm", dtype="bf16", fixed={"stack": stack}, **kw)
        assert fp8.dtype == "fp8"
        speedup[stack] = bf16.estimate.step_time_s / fp8.estimate.step_time_s
    assert 1.1 < speedup["compile"] < 2.0 and 1.1 < speedup["fused"] < 2.0
    assert speedup["eager"] < 1.1


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


def test_the_head_stays_bf16_under_fp8(llama_8b):
    """Only the blocks' projections run in FP8 (Transformer Engine's and torchao's recipes): the LM
    head's GEMM costs what it costs in bf16, and casts nothing."""
    cluster = hardware.load("8xh100-sxm")
    head = llama_8b.layers[-1]
    kw = dict(cluster=cluster, tp=1, sp=False, micro_batch=1, tp_group=None)
    assert forward_parts(head, Context(dtype="fp8", **kw)) == forward_parts(head, Context(dtype="bf16", **kw))
    assert fp8_cast_times(head, Context(dtype="fp8", **kw)) == (0.0, 0.0)


def test_the_casts_cost_what_each_stack_moves(llama_8b):
    """Per micro-batch: torchao's unfused eager casts move the most, its compiled ones less, and
    Transformer Engine's fused casts least (its weights cast once a step, priced with the optimizer)."""
    cluster = hardware.load("8xh100-sxm")
    block = next(layer for layer in llama_8b.layers if layer.kind == "block")
    kw = dict(cluster=cluster, tp=1, sp=False, micro_batch=1, tp_group=None)
    times = {stack: fp8_cast_times(block, Context(dtype="fp8", stack=stack, **kw)) for stack in CAST_RECIPES}
    assert times["eager"][0] > times["compile"][0] > times["fused"][0] > 0
    assert times["eager"][1] > times["compile"][1] > times["fused"][1] > 0
    assert fp8_cast_times(block, Context(dtype="bf16", **kw)) == (0.0, 0.0)
    # the fused stack's bytes: 2 per input element forward, 4 per output gradient element backward
    bandwidth = cluster.gpu.hbm_gbps * 1e9 * cluster.gpu.efficiency.memory_bound
    assert times["fused"][0] * bandwidth == pytest.approx(2 * block.gemm_input_elements)
    assert times["fused"][1] * bandwidth == pytest.approx(4 * block.gemm_output_elements)
    assert weight_cast_bytes_per_param("fp8", "fused") == 4 and weight_cast_bytes_per_param("fp8", "compile") == 0


def test_dynamic_scaling_all_reduces_each_split_tensors_amax(llama_8b):
    """torchao's dynamic scales of TP-split tensors need their amax over the TP group; Transformer
    Engine's delayed scaling reads its history."""
    block = next(layer for layer in llama_8b.layers if layer.kind == "block")
    assert amax_all_reduces(block, "fp8", "compile", split=2) == block.gemm_casts == 11  # 4 inputs, 7 outputs
    assert amax_all_reduces(block, "fp8", "fused", split=2) == 0
    assert amax_all_reduces(block, "fp8", "compile", split=1) == 0


def test_both_doors_count_the_same_gemm_operands(llama_8b):
    """The tracer (llama-3-8b's HF config) and the analytic transformer give the FP8 casts the same
    operands: q, k and v share their input, each projection its own output."""
    from costmodel.transformer import TransformerDims, transformer_workload

    dims = TransformerDims(n_layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, gated_mlp=True,
                           vocab=128256, seq_len=4096, biases=False, learned_positions=False)
    analytic = next(layer for layer in transformer_workload(dims).layers if layer.kind == "block")
    traced = next(layer for layer in llama_8b.layers if layer.kind == "block")
    for name in ("gemm_input_elements", "gemm_output_elements", "gemm_casts"):
        assert getattr(analytic, name) == getattr(traced, name), name
    assert traced.gemm_input_elements == 4096 * (3 * 4096 + 14336)


def test_fused_kernels_save_the_min_cut_share_and_fp8_saves_its_gemm_inputs_at_one_byte(llama_8b):
    """Megatron/Transformer Engine fuse each pointwise chain (norms, SwiGLU, rotary) and save its
    inputs, as inductor's min-cut does; under FP8 its linears save their inputs as the FP8 copy."""
    from costmodel.memory import activation_bytes

    block = next(layer for layer in llama_8b.layers if layer.kind == "block")
    kw = dict(tp=4, sp=True, micro_batch=1)
    eager = activation_bytes(block, "none", stack="eager", **kw)
    fused = activation_bytes(block, "none", stack="fused", **kw)
    assert block.act_compiled_share is not None and 0.5 < block.act_compiled_share < 0.9
    no_sp = dict(tp=4, sp=False, micro_batch=1)  # under SP, DTensor (compile) saves gathered inputs whole
    assert activation_bytes(block, "none", stack="fused", **no_sp) == pytest.approx(
        activation_bytes(block, "none", stack="compile", **no_sp))
    assert fused < eager
    fused_fp8 = activation_bytes(block, "none", stack="fused", dtype="fp8", **kw)
    assert fused - fused_fp8 == pytest.approx(block.gemm_input_elements / 4)  # one byte less each, TP-split
    assert activation_bytes(block, "none", stack="eager", dtype="fp8", **kw) == eager  # torchao saves 16-bit
    assert activation_bytes(block, "full", stack="fused", dtype="fp8", **kw) == activation_bytes(
        block, "full", stack="eager", **kw)  # the layer input alone, whatever the stack


def test_fp8_weights_are_held_and_gathered_in_one_byte():
    """Megatron-LM's --fp8-param-gather: the compute copy is the FP8 weight alone (1 byte, not bf16
    and its cast), ZeRO gathers it in FP8, and it is refused off the fused stack's FP8."""
    from costmodel.memory import state_bytes_per_param
    from layout.layout import Layout
    from layout.rules import precision_problem

    assert state_bytes_per_param("fp8", "fused")[0] == 3
    assert state_bytes_per_param("fp8", "fused", fp8_weights=True) == (1, 2, 12)
    kw = dict(global_batch=128, seq_len=8192, dtype="fp8")
    fixed = {"stack": "fused", "dp": 8, "tp": 1, "pp": 1, "zero": 3, "micro_batch": 1, "recompute": "none"}
    bf16_weights = planner.plan("llama-3-8b", "8xh100-sxm", fixed=fixed, **kw).estimate
    fp8_weights = planner.plan("llama-3-8b", "8xh100-sxm", fixed={**fixed, "fp8_param_gather": True}, **kw).estimate
    assert fp8_weights.breakdown_s["zero_comm"] < bf16_weights.breakdown_s["zero_comm"]
    assert fp8_weights.peak_memory_bytes < bf16_weights.peak_memory_bytes
    for dtype, stack in (("bf16", "fused"), ("fp8", "eager"), ("fp32", "fused")):
        refused = precision_problem(Layout(dp=8, stack=stack, fp8_param_gather=True), dtype)
        assert refused is not None and refused.field == "fp8_param_gather"
    assert precision_problem(Layout(dp=8, stack="fused", fp8_param_gather=True), "fp8") is None
