"""Weight-only quantization for serving (hardware/catalog/engines/weight_quantization.json):
priced in the bytes the weights take and a decode streams, GEMMs at the 16-bit rate, and
refused by name where the GPU's kernels lack it."""
from __future__ import annotations

import pytest

import hardware
from costmodel.inference import ServingModel
from hardware.engines import weight_quantization
from hardware.errors import PlanError
from parallax_cli import main
from planner.inference import InferencePlan, plan_inference
from planner.resolve import resolve_workload


@pytest.fixture(scope="module")
def llama_70b():
    return resolve_workload("llama-3-70b", seq_len=1024, dtype="bf16")


def _model(workload, method: str) -> ServingModel:
    cluster = hardware.load("2xa100-80g")
    return ServingModel(workload, cluster, prompt_len=1024, output_len=256,
                        quantization=weight_quantization(method, cluster.gpu))


def test_packed_weights_take_their_bits_and_their_groups_scales(llama_70b):
    plain, int8, int4 = (_model(llama_70b, m) for m in ("none", "int8", "int4"))
    assert int4.weight_bytes == pytest.approx(0.5 + 2.5 / 128) and int8.weight_bytes == pytest.approx(1 + 2.5 / 128)
    assert int4.weights_per_gpu(2, 1) / plain.weights_per_gpu(2, 1) == pytest.approx((0.5 + 2.5 / 128) / 2)
    assert int4.max_sequences(2, 1) > int8.max_sequences(2, 1) > plain.max_sequences(2, 1)
    block = next(layer for layer in llama_70b.layers if layer.kind == "block")
    # the GEMMs run on 16-bit activations: as long as the plain model's
    assert int4._gemm_seconds(block, 2, 4096) == pytest.approx(plain._gemm_seconds(block, 2, 4096))


def test_a_small_batch_decodes_faster_on_fewer_weight_bytes(llama_70b):
    """At batch 1 a decode streams the weights: the step shrinks with them."""
    steps = [_model(llama_70b, m).decode_iteration(2, 1, 1)[0] for m in ("none", "int8", "int4")]
    assert steps[0] > steps[1] > steps[2] > steps[0] / 4


def test_a_plan_states_its_quantization_and_round_trips(llama_70b):
    plan = plan_inference(llama_70b, "2xa100-80g", prompt_len=1024, output_len=256, batch=16, quantization="int4")
    assert plan.quantization == "int4"
    assert InferencePlan.model_validate_json(plan.to_json()).quantization == "int4"


@pytest.mark.parametrize("hw, method, words", [("1xmi300x", "int4", "gfx942"), ("1xh100-sxm", "int3", "unknown"),
                                               ("1xcpu", "int8", "not one"), ("1xv100-32g", "w8a8", "7.5 and newer"),
                                               ("1xb200", "w8a8", "no int8 peak")])
def test_a_method_the_gpu_cannot_run_is_refused_by_name(hw, method, words):
    with pytest.raises(PlanError, match=words) as caught:
        weight_quantization(method, hardware.load(hw).gpu)
    assert caught.value.field == "quantization"


def test_the_cli_refuses_fp8_with_a_weight_only_method_in_one_line(capsys):
    code = main(["serve-plan", "llama-3-8b", "--hw", "1xh100-sxm", "--prompt-len", "512", "--output-len", "64",
                 "--dtype", "fp8", "--quantization", "int4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "FP8 is itself the weights' format" in err[0]


def test_a_plan_file_naming_an_unknown_method_is_refused(llama_70b):
    plan = plan_inference(llama_70b, "2xa100-80g", prompt_len=1024, output_len=256, batch=16, quantization="int8")
    text = plan.to_json().replace('"quantization": "int8"', '"quantization": "int3"')
    with pytest.raises(ValueError, match="unknown weight quantization 'int3'"):
        InferencePlan.model_validate_json(text)


def test_w8a8_runs_the_blocks_gemms_at_the_int8_rate(llama_70b):
    """W8A8 streams about int8's bytes but computes the blocks' GEMMs on the INT8 tensor cores:
    a prompt's prefill, bound by its GEMMs, shortens; the LM head stays 16-bit."""
    int8, w8a8 = _model(llama_70b, "int8"), _model(llama_70b, "w8a8")
    assert w8a8.weights_per_gpu(2, 1) == pytest.approx(int8.weights_per_gpu(2, 1), rel=0.03)
    assert w8a8.prefill_latency(2, 1) < 0.75 * int8.prefill_latency(2, 1)
    head = next(layer for layer in llama_70b.layers if layer.kind == "head")
    block = next(layer for layer in llama_70b.layers if layer.kind == "block")
    # A100: 624 int8 TOPS, 312 bf16 TFLOP/s, at the same efficiency
    assert w8a8._gemm_seconds(block, 2, 4096) == pytest.approx(0.5 * int8._gemm_seconds(block, 2, 4096))
    assert w8a8._gemm_seconds(head, 2, 4096) == pytest.approx(int8._gemm_seconds(head, 2, 4096))


def test_an_int8_peak_never_falls_back_to_another_dtype():
    with pytest.raises(ValueError, match="no int8 peak"):
        hardware.load("1xb200").gpu.peak_flops("int8")
