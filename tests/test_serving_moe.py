"""A served mixture of experts reads the experts its tokens are routed to (costmodel/experts.py),
not every expert's weights on every decode step."""
from __future__ import annotations

import pytest

import hardware
from costmodel.experts import _busiest_rank, expert_share_read, routed_top_k, weights_read
from costmodel.experts import expert_load
from costmodel.inference import ServingModel
from hardware.errors import FormatError, PlanError

transformers = pytest.importorskip("transformers")

EXPERTS, TOP_K = 8, 2


CONFIG = {"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
          "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000, "num_local_experts": EXPERTS,
          "num_experts_per_tok": TOP_K}


@pytest.fixture(scope="module")
def mixtral():
    from planner.resolve import resolve_workload

    return resolve_workload(CONFIG, seq_len=128, dtype="bf16")


def _block(workload):
    return next(layer for layer in workload.layers if layer.kind == "block")


def test_one_token_reads_its_top_k_experts_and_a_large_batch_all(mixtral):
    block = _block(mixtral)
    assert routed_top_k(block, EXPERTS, mixtral.seq_len) == TOP_K
    assert expert_share_read(block, EXPERTS, mixtral.seq_len, 1) == pytest.approx(TOP_K / EXPERTS)
    assert expert_share_read(block, EXPERTS, mixtral.seq_len, 4) == pytest.approx(1 - (1 - TOP_K / EXPERTS) ** 4)
    assert expert_share_read(block, EXPERTS, mixtral.seq_len, 10_000) == pytest.approx(1.0)


def test_a_dense_layer_reads_all_its_weights(mixtral):
    embedding = next(layer for layer in mixtral.layers if layer.kind == "embedding")
    assert expert_share_read(embedding, EXPERTS, mixtral.seq_len, 1) == 1.0
    load = expert_load(embedding, EXPERTS, mixtral.seq_len, 1, 2, expert_parallel=True)
    assert weights_read(embedding, 123.0, 1, load) == 123.0


def test_a_tp_rank_reads_its_dense_slice_and_its_slice_of_the_routed_experts(mixtral):
    block, tp = _block(mixtral), 2
    dense = (block.params - block.expert_params) / tp
    load = expert_load(block, EXPERTS, mixtral.seq_len, 1, tp, expert_parallel=False)
    read = weights_read(block, block.params / tp, tp, load)
    assert read == pytest.approx(dense + block.expert_params / tp * TOP_K / EXPERTS)


def test_decode_steps_grow_with_the_batch_until_every_expert_is_read(mixtral):
    """At batch 1 a step streams the dense weights and a quarter of the experts; the weights'
    part of a step then grows with the experts touched, up to all of them."""
    model = ServingModel(mixtral, hardware.load("1xh100-sxm"), prompt_len=128, output_len=64)
    stages = model.stages(1)
    weights = [model.iteration_stage(stages[0], 1, b, 160)["weights"] for b in (1, 2, 8, 64, 512)]
    assert weights == sorted(weights) and weights[0] < weights[-1]
    block = _block(mixtral)
    read = sum(n * (layer.params - layer.expert_params * (1 - TOP_K / EXPERTS))
               for layer, n in stages[0] if layer.kind != "embedding")
    assert weights[0] == pytest.approx(read * mixtral.dtype_bytes / model.hbm, rel=0.05)  # and the activations' bytes
    assert block.expert_params > 0.9 * block.params


def test_serving_engines_split_each_expert_over_tp_where_the_executor_keeps_them_whole(mixtral):
    """vLLM's, SGLang's and TensorRT-LLM's fused MoE kernels split every expert over the TP
    ranks (their weights are priced so): a prompt's expert GEMMs halve at tp=2. Training's
    executor runs the experts whole on every TP rank."""
    from dataclasses import replace

    from costmodel.compute import forward_parts

    block = _block(mixtral)
    model = ServingModel(mixtral, hardware.load("2xh100-sxm"), prompt_len=128, output_len=64)
    served = [forward_parts(block, replace(model.ctx(tp), expert_share=1 / tp, expert_slices=tp))[0] for tp in (1, 2)]
    trained = [forward_parts(block, replace(model.ctx(tp), expert_share=1.0, expert_slices=1))[0] for tp in (1, 2)]
    experts = served[0] - served[1]
    assert served[1] < served[0] and trained[1] > served[1]
    assert trained[0] - trained[1] < experts  # only the dense GEMMs split under training's TP


def test_expert_parallel_waits_for_the_busiest_rank():
    """One token's two experts land on one of two ranks (4 experts each) with probability 12/28:
    that rank then reads two experts and does all the work, else one and half."""
    weights, work = _busiest_rank(EXPERTS, TOP_K, 1, 2)
    same = 12 / 28
    assert weights == pytest.approx((1 + same) / EXPERTS, rel=0.06)
    assert work == pytest.approx(same + (1 - same) / 2, rel=0.06)
    weights, work = _busiest_rank(EXPERTS, TOP_K, 4096, 2)  # many tokens: every expert, nearly even
    assert weights == pytest.approx(0.5) and 0.5 < work < 0.52


def test_a_small_batch_decodes_slower_with_whole_experts(mixtral):
    cluster = hardware.load("2xh100-sxm")
    split = ServingModel(mixtral, cluster, prompt_len=128, output_len=64)
    whole = split.with_expert_parallel(True)
    assert whole.decode_iteration(2, 1, 1)[0] > split.decode_iteration(2, 1, 1)[0]
    assert whole.weights_per_gpu(2, 1) == split.weights_per_gpu(2, 1)  # four whole experts or half of eight


def test_the_planner_prices_both_placements_and_honours_a_pin():
    from planner.inference import InferencePlan, plan_inference

    both = plan_inference(CONFIG, "2xh100-sxm", prompt_len=128, output_len=64, batch=8, top_k=8)
    placements = {(p.tp, p.expert_parallel) for p in (both, *both.alternatives)}
    assert (2, True) in placements and (2, False) in placements and (1, True) not in placements
    pinned = plan_inference(CONFIG, "2xh100-sxm", prompt_len=128, output_len=64, batch=8, expert_parallel=True)
    assert pinned.expert_parallel and pinned.tp == 2
    assert InferencePlan.from_json(pinned.to_json()).expert_parallel
    with pytest.raises(PlanError, match="expert_parallel"):
        plan_inference(CONFIG, "1xh100-sxm", prompt_len=128, output_len=64, batch=8, expert_parallel=True)
    with pytest.raises(PlanError, match="no experts"):
        plan_inference("llama-160m", "2xh100-sxm", prompt_len=128, output_len=64, batch=8, expert_parallel=True)


@pytest.mark.parametrize("engine, line", [("vllm", "--enable-expert-parallel"), ("sglang", "--ep-size 2"),
                                          ("trtllm", "--ep_size 2")])
def test_each_engine_states_expert_parallelism_and_reads_it_back(engine, line):
    from formats.serving import engine_pins, export
    from planner.inference import plan_inference

    plan = plan_inference(CONFIG, "2xh100-sxm", prompt_len=128, output_len=64, batch=8, expert_parallel=True)
    text = export(plan, engine, lossy=True).text
    assert line in text.splitlines() and engine_pins(text, engine).expert_parallel
    split = export(plan.model_copy(update={"expert_parallel": False}), engine, lossy=True).text
    assert not engine_pins(split, engine).expert_parallel
    if engine != "vllm":
        with pytest.raises(FormatError, match="as wide as TP"):
            engine_pins(text.replace(line, line[:-1] + "3"), engine)
