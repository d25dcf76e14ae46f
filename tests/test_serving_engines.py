"""Serving engines as data (hardware/engines.py): a family's fitted HBM efficiency and
per-iteration overhead enter the decode iteration, and nothing else changes."""
from __future__ import annotations

import dataclasses

import pytest

import hardware
from costmodel.inference import ServingModel
from hardware.engines import EngineFit, ServingEngine, engine_catalog, engine_fit, resolve_engine
from hardware.errors import PlanError
from parallax_cli import main
from planner.inference import plan_inference
from planner.resolve import resolve_workload


@pytest.fixture(scope="module")
def llama_8b():
    return resolve_workload("llama-3-8b", seq_len=1024, dtype="bf16")


def test_an_engine_fit_sets_the_bandwidth_and_adds_its_overhead_per_iteration(llama_8b):
    cluster = hardware.load("1xh100-sxm")
    fit = EngineFit(gpu="h100-sxm", hbm_efficiency=1.0, step_overhead_ms=5.0,
                    sources={"hbm_efficiency": "test", "step_overhead_ms": "test"})
    plain = ServingModel(llama_8b, cluster, prompt_len=1024, output_len=128)
    fitted = ServingModel(llama_8b, cluster, prompt_len=1024, output_len=128, engine=ServingEngine("test", fit))
    assert fitted.hbm == pytest.approx(cluster.gpu.hbm_gbps * 1e9)
    streamed = plain.decode_iteration(1, 1, 8)[0] * plain.hbm / fitted.hbm  # the roofline, at the fit's bandwidth
    step, parts = fitted.decode_iteration(1, 1, 8)
    assert step == pytest.approx(streamed + 5e-3, rel=0.02) and parts["engine_overhead"] == 5e-3
    assert fitted.prefill_latency(1, 1) <= plain.prefill_latency(1, 1)  # its weight reads at the fit's bandwidth


def test_every_fit_is_sourced_and_a_plan_names_its_engine(llama_8b):
    fits = [fit for engine in engine_catalog().engines for fit in engine.fits]
    assert fits and all(set(fit.sources) == {"hbm_efficiency", "step_overhead_ms"} for fit in fits)
    assert engine_fit("trtllm", "h100-sxm") is not None and engine_fit("generic", "h100-sxm") is None
    plan = plan_inference(llama_8b, "1xh100-sxm", prompt_len=1024, output_len=128, batch=8, engine="trtllm")
    generic = plan_inference(llama_8b, "1xh100-sxm", prompt_len=1024, output_len=128, batch=8)
    assert plan.engine == "trtllm" and plan.estimate.decode_breakdown_s["engine_overhead"] > 0
    assert plan.estimate.decode_step_s != generic.estimate.decode_step_s
    unfitted = plan_inference(llama_8b, "1xa100-80g", prompt_len=1024, output_len=128, batch=8, engine="trtllm")
    assert any("no fit on a100-80g" in note for note in unfitted.notes)


def test_an_unknown_engine_is_refused_by_name(capsys):
    with pytest.raises(PlanError, match="use one of generic, trtllm"):
        engine_fit("tgi", "h100-sxm")
    code = main(["serve-plan", "llama-3-8b", "--hw", "1xh100-sxm", "--prompt-len", "512", "--output-len", "64",
                 "--engine", "tgi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "unknown serving engine 'tgi'" in err[0]


def test_an_engines_default_cap_bounds_its_running_sequences(llama_8b):
    """vLLM runs at most --max-num-seqs sequences (256 by default) whatever the KV cache holds."""
    cluster = hardware.load("1xh100-sxm")
    vllm, _ = resolve_engine("vllm", "h100-sxm")
    roomy = ServingModel(llama_8b, cluster, prompt_len=128, output_len=128)
    capped = ServingModel(llama_8b, cluster, prompt_len=128, output_len=128, engine=vllm)
    assert vllm.max_sequences == 256 and roomy.max_sequences(1, 1) > 256 and capped.max_sequences(1, 1) == 256


def test_each_sequence_holds_its_kv_cache_in_whole_pages(llama_8b):
    """A sequence of 17 tokens holds two 16-token pages: as many sequences fit as 32-token ones."""
    from costmodel.inference import KV_BLOCK_TOKENS

    cluster = hardware.load("1xh100-sxm")
    odd = ServingModel(llama_8b, cluster, prompt_len=9, output_len=8)
    paged = ServingModel(llama_8b, cluster, prompt_len=16, output_len=16)
    assert KV_BLOCK_TOKENS == 16 and odd.max_sequences(1, 1) == paged.max_sequences(1, 1)


def test_an_engine_pages_its_kv_cache_in_its_own_blocks(llama_8b):
    """40 tokens hold three of vLLM's 16-token pages (the roofline's too) and two of TensorRT-LLM's 32."""
    from costmodel.simulate.serving import Replica

    cluster = hardware.load("1xh100-sxm")
    trtllm, _ = resolve_engine("trtllm", "h100-sxm")
    trtllm = dataclasses.replace(trtllm, kv_memory_of="total")  # the same memory as the roofline's, paged apart
    generic = ServingModel(llama_8b, cluster, prompt_len=20, output_len=20)
    paged = ServingModel(llama_8b, cluster, prompt_len=20, output_len=20, engine=trtllm)
    tokens = generic.kv_token_capacity(1, 1)
    assert trtllm.kv_block_tokens == 32 and tokens == paged.kv_token_capacity(1, 1)
    assert generic.max_sequences(1, 1) == int(tokens // 48) and paged.max_sequences(1, 1) == int(tokens // 64)
    assert Replica.of(paged, 1, 1).block_size == 32


def test_tensorrt_llm_s_kv_cache_takes_its_share_of_the_memory_loading_left_free():
    """vLLM's 0.9 is of the whole GPU, which the weights share; TensorRT-LLM's 0.9 is of what the
    weights, a prefill's workspace and the CUDA context left free, so a model that fills most of
    the GPU keeps more KV cache under TensorRT-LLM."""
    workload = resolve_workload("llama-3-70b", seq_len=1024, dtype="bf16")
    cluster = hardware.load("2xh100-sxm")
    kw = dict(prompt_len=1024, output_len=128, dtype="fp8")
    vllm = ServingModel(workload, cluster, engine=resolve_engine("vllm", "h100-sxm")[0], **kw)
    trtllm = ServingModel(workload, cluster, engine=resolve_engine("trtllm", "h100-sxm")[0], **kw)
    gpu, held = cluster.gpu.hbm_gb * 2**30, vllm.weights_per_gpu(2, 1) + vllm.workspace(2, 1)
    assert vllm.kv_budget(2, 1) == pytest.approx(0.9 * gpu - held)
    context = cluster.gpu.runtime_memory.cuda_context_mib * 2**20
    assert trtllm.kv_budget(2, 1) == pytest.approx(0.9 * (gpu - context - held))
    assert trtllm.kv_budget(2, 1) > vllm.kv_budget(2, 1) and trtllm.max_sequences(2, 1) > vllm.max_sequences(2, 1)


def test_a_gpu_without_a_fit_takes_its_architectures_and_says_so():
    """An H200 runs the H100's sm90 kernels: TensorRT-LLM's H100 fit prices it, in a note; a B200
    (sm100) has no fit of that architecture and is priced by the roofline plus the family's
    per-iteration host work."""
    h100, quiet = resolve_engine("trtllm", "h100-sxm")
    h200, note = resolve_engine("trtllm", hardware.load("8xh200").gpu)
    assert quiet == "" and h200.fit == h100.fit and "h100-sxm, the same sm90 architecture" in note
    b200, note = resolve_engine("trtllm", "b200")
    assert b200.fit is None and "generic roofline" in note and b200.kv_block_tokens == 32
    # the family's per-iteration overhead is host work, whatever the GPU: the roofline pays it too
    assert b200.step_overhead_ms == h100.fit.step_overhead_ms and "host work" in note
    assert resolve_engine("sglang", "h100-sxm")[0].step_overhead_ms == 0  # a family fitted nowhere


def test_an_engine_answers_to_its_aliases_and_a_published_row_to_its_spelling():
    """NIM runs TensorRT-LLM's engines; a row names its engine as its source wrote it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from published_serving import engine_family

    assert resolve_engine("NIM", "h100-sxm")[0] == resolve_engine("trtllm", "h100-sxm")[0]
    spelled = {"NIM 1.3.0": "trtllm", "TensorRT-LLM v0.12": "trtllm", "vLLM 0.6.0": "vllm-v0", "vllm v0.10.1": "vllm",
               "vllm(2024-10)": "vllm-v0", "turbomind": "lmdeploy", "sglang-0.3.0": "sglang", "mystery-1.0": "generic"}
    assert {name: engine_family({"engine": name}) for name in spelled} == spelled
    with pytest.raises(PlanError, match="trtllm"):
        resolve_engine("tensorrt", "h100-sxm")
