"""Serving cost model and deployment planner (costmodel/inference.py, planner/inference.py)."""
from __future__ import annotations

import math

import pytest

import hardware
from costmodel.inference import ServingModel
from costmodel.serving_memory import kv_bytes_per_token, kv_bytes_per_token_per_gpu, weight_bytes_per_gpu
from hardware.errors import InfeasibleError, PlanError
from planner.inference import InferencePlan, plan_inference
from planner.trace.workload_for import workload_for


@pytest.fixture(scope="module")
def llama2_70b():
    return workload_for("llama-2-70b", seq_len=2048)[0]


def test_llama2_70b_weights_and_kv(llama2_70b):
    # 69.0e9 params in bf16 = 138 GB; TP4 holds a quarter of every (shardable) layer.
    assert llama2_70b.params * 2 == pytest.approx(138e9, rel=0.005)
    assert weight_bytes_per_gpu(llama2_70b, 4, 1) == pytest.approx(34.5e9, rel=0.005)
    assert kv_bytes_per_token(llama2_70b) == 2 * 80 * 8 * 128 * 2 == 327_680
    assert kv_bytes_per_token_per_gpu(llama2_70b, 4, 1) == 327_680 / 4
    assert kv_bytes_per_token_per_gpu(llama2_70b, 4, 2) == 327_680 / 8
    # GQA: beyond tp = kv_heads = 8 each rank still keeps one KV head.
    assert kv_bytes_per_token_per_gpu(llama2_70b, 16, 1) == 2 * 80 * 1 * 128 * 2


def test_max_sequences_on_4x80gb(llama2_70b):
    sm = ServingModel(llama2_70b, hardware.load("4xh100-sxm"), prompt_len=2048, output_len=256)
    free = sm.capacity - weight_bytes_per_gpu(llama2_70b, 4, 1) - sm.workspace(4, 1)
    expected = math.floor(free / (81_920 * (2048 + 256)))
    assert sm.max_sequences(4, 1) == expected
    assert 150 < expected < 250  # ~37 GB of KV space at ~189 MB per 2304-token sequence
    est = sm.estimate(4, 1, 16)
    assert est.kv_cache_bytes_per_gpu == 16 * 81_920 * 2304
    assert est.fits and est.usd_per_million_output_tokens > 0


def _decode(workload, cluster, tps):
    sm = ServingModel(workload, cluster, prompt_len=2048, output_len=256)
    return {tp: sm.decode_iteration(tp, 1, 1)[0] for tp in tps}


def test_decode_falls_with_tp_until_all_reduce_dominates(llama2_70b):
    fast = _decode(llama2_70b, hardware.load("8xh100-sxm"), (1, 2, 4, 8))
    assert fast[1] > fast[2] > fast[4] > fast[8]
    # A slow link (40 us per collective step instead of 2.5): 160 all-reduces per token turn the curve.
    slow = _decode(llama2_70b, hardware.load("8xh100-sxm", intra_latency_us=40), (1, 2, 4, 8))
    assert slow[1] > slow[2]
    best = min(slow, key=slow.get)
    assert best in (2, 4) and slow[8] > slow[best]


def test_plan_meets_slo_and_round_trips(llama2_70b):
    plan = plan_inference(llama2_70b, "8xh100-sxm", prompt_len=2048, output_len=256, slo_tpot_ms=50, slo_ttft_ms=500)
    e = plan.estimate
    assert plan.feasible and e.tpot_s * 1e3 <= 50 and e.ttft_s * 1e3 <= 500
    assert plan.tp * plan.pp * plan.replicas == plan.gpus_used <= 8
    assert e.batch <= e.max_concurrent_sequences
    assert plan.tokens_per_s == pytest.approx(plan.replicas * e.batch / e.tpot_s)
    assert InferencePlan.from_json(plan.to_json()) == plan
    for alt in plan.alternatives:  # ranked: no alternative beats the choice on throughput
        assert alt.tokens_per_s <= plan.tokens_per_s * (1 + 1e-9)


def test_infeasible_slo_reports_best_achievable(llama2_70b):
    plan = plan_inference(llama2_70b, "8xh100-sxm", prompt_len=2048, output_len=256, slo_tpot_ms=2)
    assert not plan.feasible
    assert plan.best_achievable["tpot_ms"] > 2 and plan.best_achievable["tpot_tp"] == 8
    assert any("SLO cannot be met" in n for n in plan.notes)


def test_rate_mode_obeys_littles_law(llama2_70b):
    plan = plan_inference(llama2_70b, "8xh100-sxm", prompt_len=1024, output_len=256, request_rate=2.0, slo_tpot_ms=60)
    e = plan.estimate
    per_replica = 2.0 / plan.replicas
    assert e.batch == pytest.approx(per_replica * (e.ttft_s + 256 * e.tpot_s), rel=1e-3)
    assert plan.tokens_per_s == pytest.approx(2.0 * 256)
    cheap = plan_inference(llama2_70b, "8xh100-sxm", prompt_len=1024, output_len=256, request_rate=0.5,
                           slo_tpot_ms=60, objective="cost")
    assert cheap.gpus_used <= plan.gpus_used


def test_unpriced_gpu_and_nothing_fits(llama2_70b):
    plan = plan_inference(llama2_70b, "8xh200", prompt_len=512, output_len=128, objective="cost")
    if plan.estimate.usd_per_million_output_tokens is None:
        assert any("no price" in n for n in plan.notes)
    with pytest.raises(InfeasibleError):
        plan_inference(llama2_70b, "1xa100-40g", prompt_len=512, output_len=128)
    with pytest.raises(PlanError):
        plan_inference(llama2_70b, "8xh100-sxm", prompt_len=512, output_len=128, batch=4, request_rate=1.0)


@pytest.mark.parametrize("argv", [
    ["serve-plan", "llama-2-70b", "--hw", "8xh100-sxm", "--prompt-len", "0", "--output-len", "10"],
    ["serve-plan", "llama-2-70b", "--hw", "8xfoo", "--prompt-len", "10", "--output-len", "10"],
    ["serve-plan", "llama-2-70b", "--hw", "1xa100-40g", "--prompt-len", "10", "--output-len", "10"],
    ["serve-plan", "llama-2-70b", "--hw", "8xh100-sxm", "--prompt-len", "10", "--output-len", "10", "--tpot-ms", "-1"],
])
def test_cli_bad_input_is_one_line(argv, capsys):
    from parallax_cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err


def test_cli_serve_plan_prints_slo(capsys):
    from parallax_cli import main

    assert main(["serve-plan", "llama-2-70b", "--hw", "8xh100-sxm", "--prompt-len", "2048", "--output-len", "256",
                 "--tpot-ms", "50", "--ttft-ms", "500"]) == 0
    out = capsys.readouterr().out
    assert "meets the SLO" in out and "327,680" in out


def test_generation_equivalence_on_two_gloo_ranks():
    from executor.inference.generate import predicted_decode_step, run_generation

    result = run_generation("reference-tiny", tp=2, prompt_len=8, new_tokens=12, batch=2)
    assert result.ranks_agree
    assert result.equal, (result.tokens, result.reference_cached, result.reference_plain)
    assert result.decode_step_s > 0
    predicted = predicted_decode_step("reference-tiny", tp=2, prompt_len=8, new_tokens=12, batch=2)
    print(f"decode step: measured {result.decode_step_s * 1e3:.2f} ms, predicted {predicted * 1e3:.2f} ms "
          f"(cpu profile), all-reduce measured {result.all_reduce_s * 1e6:.0f} us")
    assert predicted > 0


def test_an_fp8_kv_cache_halves_its_bytes_and_is_refused_where_the_gpu_has_no_fp8(llama2_70b):
    assert kv_bytes_per_token(llama2_70b, "fp8") == kv_bytes_per_token(llama2_70b) / 2
    cluster = hardware.load("4xh100-sxm")
    sixteen, eight = (ServingModel(llama2_70b, cluster, prompt_len=2048, output_len=256, kv_dtype=kv)
                      for kv in (None, "fp8"))
    assert eight.max_sequences(4, 1) >= 2 * sixteen.max_sequences(4, 1) - 1
    assert eight.estimate(4, 1, 64).decode_breakdown_s["kv_cache"] == pytest.approx(
        sixteen.estimate(4, 1, 64).decode_breakdown_s["kv_cache"] / 2)
    plan = plan_inference("llama-2-70b", "4xh100-sxm", prompt_len=2048, output_len=256, batch=64, kv_dtype="fp8")
    assert plan.kv_dtype == "fp8" and InferencePlan.from_json(plan.to_json()).kv_dtype == "fp8"
    for hw, kv, field in (("4xa100-80g", "fp8", "kv_dtype"), ("4xh100-sxm", "int4", "kv_dtype")):
        with pytest.raises(PlanError) as refused:
            plan_inference("llama-2-70b", hw, prompt_len=2048, output_len=256, kv_dtype=kv)
        assert refused.value.field == field


def test_an_engines_fp8_kv_flag_is_read_as_the_plans(tmp_path, capsys):
    from parallax_cli import main

    for engine, line in (("vllm", "vllm serve m --tensor-parallel-size 4 --kv-cache-dtype fp8_e5m2"),
                         ("sglang", "python -m sglang.launch_server --tp-size 4 --kv-cache-dtype fp8_e4m3")):
        path = tmp_path / f"{engine}.sh"
        path.write_text(line)
        assert main(["serve-plan", "llama-2-70b", "--hw", "4xh100-sxm", "--prompt-len", "2048", "--output-len", "256",
                     "--from", str(path), "--json"]) == 0
        assert InferencePlan.from_json(capsys.readouterr().out).kv_dtype == "fp8", engine



def test_a_closed_loop_beyond_the_kv_cache_queues_instead_of_being_refused():
    """An engine admits what its KV cache holds and queues the rest: the batch is what fits,
    and a queued request's wait (Little's law) is in its TTFT."""
    kw = dict(prompt_len=128, output_len=2048, fixed={"tp": 1, "pp": 1, "replicas": 1})
    fits = plan_inference("llama-3-8b", "1xa100-80g", batch=16, **kw)
    cap = fits.estimate.max_concurrent_sequences
    over = plan_inference("llama-3-8b", "1xa100-80g", batch=cap + 20, **kw)
    full = plan_inference("llama-3-8b", "1xa100-80g", batch=cap, **kw)
    assert fits.estimate.queued_sequences == 0 and over.estimate.queued_sequences == 20
    assert over.estimate.batch == full.estimate.batch == cap
    assert over.tokens_per_s == pytest.approx(full.tokens_per_s)
    lifetime = full.estimate.ttft_s + 2048 * full.estimate.tpot_s
    assert over.estimate.ttft_s == pytest.approx(full.estimate.ttft_s + 20 / cap * lifetime)


def test_a_pinned_deployment_refuses_a_load_it_cannot_take_by_naming_the_load():
    """A deployment that fits but is pinned under a rate past its replicas' capacity, or a batch
    smaller than its replicas, is refused for that load (its capacity stated), never as a layout
    that does not fit; a rate just under the capacity it states is planned."""
    kw = dict(prompt_len=1000, output_len=200, fixed={"tp": 1, "replicas": 8})
    with pytest.raises(InfeasibleError) as over:
        plan_inference("llama-3-8b", "8xh100-sxm", request_rate=5000.0, **kw)
    capacity = over.value.report["capacity_requests_per_s"]
    assert over.value.field == "request_rate" and "overloads it" in str(over.value) and f"{capacity:.3g}" in str(over.value)
    assert (over.value.report["tp"], over.value.report["replicas"]) == (1, 8)
    assert plan_inference("llama-3-8b", "8xh100-sxm", request_rate=0.95 * capacity, **kw).replicas == 8
    with pytest.raises(PlanError) as few:
        plan_inference("llama-3-8b", "8xh100-sxm", batch=4, **kw)
    assert few.value.field == "replicas" and "--replicas 4 or fewer" in str(few.value)


def test_published_serving_prices_each_row_as_it_ran(tmp_path, capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import published_serving

    header = ("n_layers,hidden,heads,kv_heads,ffn_hidden,gated_mlp,vocab,n_experts,top_k,gpu,n_gpus,tp,pp,weights_dtype,"
              "kv_dtype,isl,osl,mode,load,engine,metric,value,source")
    llama7b = "32,4096,32,32,11008,true,32000,,,a100-80g,1,1,1"
    csv = tmp_path / "runs.csv"
    csv.write_text("\n".join([header, f"{llama7b},fp16,,128,128,concurrency,1,e,tpot_ms,30,s",
                              f"{llama7b},fp4,,128,128,max,,e,out_tok_s_total,100,s",
                              f"{llama7b},fp16,,,128,max,,e,out_tok_s_total,100,s",
                              f"{llama7b},int4,,128,128,concurrency,1,e,tpot_ms,30,s"]))
    assert published_serving.main(["--csv", str(csv)]) == 0
    out = capsys.readouterr().out
    assert "fp4 weights are not priced" in out and "request lengths are not stated" in out
    assert "MAPE:" in out and "over 2 rows (2 not predicted)" in out.splitlines()[-1]
    fp16, int4 = (published_serving.plan_of(dict(zip(header.split(","), f"{llama7b},{w},,128,128,concurrency,1,e,"
                                                                         "tpot_ms,30,s".split(","))))[0]
                  for w in ("fp16", "int4"))
    assert int4.quantization == "int4" and int4.estimate.tpot_s < 0.5 * fp16.estimate.tpot_s  # a quarter of the bytes


def test_a_published_rate_row_is_priced_by_the_event_simulation():
    """A request rate is queueing: its latencies are the simulated replicas' (mean unless the row
    states another statistic), not the closed form's."""
    import sys
    from pathlib import Path

    from planner.serving_load import load_report

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import published_serving

    keys = ("n_layers,hidden,heads,kv_heads,ffn_hidden,gated_mlp,vocab,n_experts,top_k,gpu,n_gpus,tp,pp,weights_dtype,"
            "kv_dtype,isl,osl,mode,load,engine,metric,value,source,statistic").split(",")
    row = dict(zip(keys, "32,4096,32,8,14336,true,128256,,,h100-sxm,2,1,1,bf16,,512,128,rate,20,vllm,ttft_ms,50,s,"
                         "median".split(",")))
    workload = published_serving.row_workload(row)
    plan, why = published_serving.plan_of(row, "vllm", workload)
    assert why == ""
    sim = load_report(workload, "2xh100-sxm", lengths=[(512, 128)], rates=[20.0], engine="vllm", top_k=1,
                      fixed={"tp": 1, "pp": 1, "replicas": 2}).layouts[0].points[0]
    assert sim.rate == 10.0  # each of the two replicas takes half the rate
    assert published_serving.predicted(plan, "ttft_ms", 128, row, "vllm", workload) == sim.ttft_ms.p50
    assert published_serving.predicted(plan, "tpot_ms", 128, {**row, "statistic": ""}, "vllm", workload) == \
        sim.tpot_ms.mean
    total = published_serving.predicted(plan, "out_tok_s_total", 128, row, "vllm", workload)
    assert total == pytest.approx(2 * sim.output_tokens_per_s)
    assert published_serving.plan_of({**row, "statistic": "p95"}, "vllm", workload)[1].startswith("unknown statistic")


def test_prompt_tokens_share_the_iteration_s_weight_read(llama2_70b):
    """Decoding sequences and prompt chunks run as one batch: alone, each is what it was priced
    at before; together they cost less than apart (one weight read, not two) and at least the
    longer of the two; and the continuous-batching TPOT is that mixed iteration."""
    sm = ServingModel(llama2_70b, hardware.load("8xh100-sxm"), prompt_len=2048, output_len=256)
    decode = sm.iteration(8, 1, 64)[0]
    assert decode == sm.decode_iteration(8, 1, 64)[0]
    prompt = sm.iteration(8, 1, 0, 2048)[0]
    assert prompt == pytest.approx(sm.prefill_latency(8, 1))
    mixed = sm.iteration(8, 1, 64, 2048)[0]
    weights = sm.iteration_stage(sm.stages(1)[0], 8, 0, 0)["weights"]
    assert max(decode, prompt) <= mixed < decode + prompt
    assert mixed == pytest.approx(decode + prompt - weights, rel=0.05)  # compute-bound: the prompt hides the read
    joining = 64 / 256  # a quarter of the iterations carry a prompt
    assert sm.estimate(8, 1, 64).tpot_s == pytest.approx(joining * mixed + (1 - joining) * decode)


def test_an_engine_that_prefills_apart_pays_both_passes(llama2_70b):
    """vLLM's V0 engine runs prompts in passes of their own: the prompt's pass adds to the decode's,
    weights read twice, and TPOT adds a prompt's pass per joining prompt."""
    from hardware.engines import resolve_engine

    cluster = hardware.load("8xh100-sxm")
    apart = ServingModel(llama2_70b, cluster, prompt_len=2048, output_len=256,
                         engine=resolve_engine("vllm-v0", "h100-sxm")[0])
    assert not apart.mixes_prefill
    decode, prompt = apart.iteration(8, 1, 64)[0], apart.prefill_occupancy(8, 1)  # the prompt's pass, no overhead
    assert apart.iteration(8, 1, 0, 2048)[0] == pytest.approx(prompt + apart.step_overhead)
    assert apart.iteration(8, 1, 64, 2048)[0] == pytest.approx(decode + prompt)  # one iteration's overhead
    assert apart.estimate(8, 1, 64).tpot_s == pytest.approx(decode + 64 / 256 * prompt)


def test_a_prompt_batched_with_decodes_waits_for_them_too(llama2_70b):
    """TTFT under continuous batching: the prefill, half a decode iteration to join, and (an
    engine that batches prompts with the decodes) what the other sequences' tokens add to the
    prompt's iteration; alone (batch 1) or prefilled apart, the prefill alone."""
    from hardware.engines import resolve_engine

    cluster = hardware.load("8xh100-sxm")
    mixed = ServingModel(llama2_70b, cluster, prompt_len=2048, output_len=256)
    apart = ServingModel(llama2_70b, cluster, prompt_len=2048, output_len=256,
                         engine=resolve_engine("vllm-v0", "h100-sxm")[0])
    for sm in (mixed, apart):
        assert sm.estimate(8, 1, 1).ttft_s == pytest.approx(sm.prefill_latency(8, 1) + 0.5 * sm.decode_iteration(8, 1, 1)[0])
    alone = apart.prefill_latency(8, 1) + 0.5 * apart.decode_iteration(8, 1, 128)[0]
    assert apart.estimate(8, 1, 128).ttft_s == pytest.approx(alone)
    assert mixed.estimate(8, 1, 128).ttft_s > alone


def test_a_decode_s_gemms_are_priced_as_a_prefill_s(llama2_70b):
    """The same kernels, one price: a decode step's GEMMs of B sequences take what a prefill's
    GEMMs of B tokens take, FP8 ones at the FP8 efficiency of a GEMM B rows tall, the LM head in
    bf16; a compute-bound step is at least that long."""
    cluster = hardware.load("2xh100-sxm")
    sm = ServingModel(llama2_70b, cluster, prompt_len=2048, output_len=256, dtype="fp8")
    block = next(layer for layer in llama2_70b.layers if layer.kind == "block")
    head = next(layer for layer in llama2_70b.layers if layer.kind == "head")
    eff, batch = cluster.gpu.efficiency, 1024
    size = min(block.matmul_min_dim / 2, batch) / (min(block.matmul_min_dim / 2, batch) + eff.matmul_half_dim)
    fp8 = batch * block.matmul_flops / sm.s / 2 / (cluster.gpu.peak_flops("fp8") * eff.fp8_matmul_max * size)
    assert sm._gemm_seconds(block, 2, batch) == pytest.approx(fp8)
    head_bf16 = sm._gemm_seconds(head, 2, batch) * cluster.gpu.peak_flops("bf16")
    assert head_bf16 == pytest.approx(batch * head.matmul_flops / sm.s / 2 / (
        eff.matmul_max * min(head.matmul_min_dim / 2, batch) / (min(head.matmul_min_dim / 2, batch) + eff.matmul_half_dim)))
    gemms = sum(n * sm._gemm_seconds(layer, 2, batch) for layer, n in sm.stages(1)[0])
    step = sm.iteration_stage(sm.stages(1)[0], 2, batch, 2048 + 128)
    assert step["weights"] + step["kv_cache"] + step["compute_excess"] >= gemms


def test_the_gemms_and_the_attention_are_each_their_own_roofline(llama2_70b):
    """A decode step runs its GEMMs and its attention as separate kernels: a batch large enough
    for the GEMMs to be compute-bound still reads the whole KV cache after them, so the step is
    the GEMMs' compute plus the cache's read, not the larger of the two (which priced MLPerf's
    70B FP8 offline rows 14-15% too fast)."""
    cluster = hardware.load("2xh100-sxm")
    sm = ServingModel(llama2_70b, cluster, prompt_len=2048, output_len=256, dtype="fp8")
    batch, context = 512, 2048 + 128
    runs = sm.stages(1)[0]
    gemms = sum(n * sm._gemm_seconds(layer, 2, batch) for layer, n in runs)
    step = sm.iteration_stage(runs, 2, batch, context)
    assert gemms > step["weights"]  # compute-bound GEMMs
    assert step["kv_cache"] > 0.3 * gemms
    assert step["weights"] + step["kv_cache"] + step["compute_excess"] >= gemms + step["kv_cache"]
