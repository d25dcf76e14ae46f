"""A served mixture of experts reads the experts its tokens are routed to (costmodel/experts.py),
not every expert's weights on every decode step."""
from __future__ import annotations

import pytest

import hardware
from costmodel.experts import expert_share_read, routed_top_k, weights_read
from costmodel.inference import ServingModel

transformers = pytest.importorskip("transformers")

EXPERTS, TOP_K = 8, 2


@pytest.fixture(scope="module")
def mixtral():
    from planner.resolve import resolve_workload

    cfg = {"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
           "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000, "num_local_experts": EXPERTS,
           "num_experts_per_tok": TOP_K}
    return resolve_workload(cfg, seq_len=128, dtype="bf16")


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
    assert weights_read(embedding, 123.0, 1, EXPERTS, mixtral.seq_len, 1) == 123.0


def test_a_tp_rank_reads_its_dense_slice_and_its_slice_of_the_routed_experts(mixtral):
    block, tp = _block(mixtral), 2
    dense = (block.params - block.expert_params) / tp
    read = weights_read(block, block.params / tp, tp, EXPERTS, mixtral.seq_len, 1)
    assert read == pytest.approx(dense + block.expert_params / tp * TOP_K / EXPERTS)


def test_decode_steps_grow_with_the_batch_until_every_expert_is_read(mixtral):
    """At batch 1 a step streams the dense weights and a quarter of the experts; the weights'
    part of a step then grows with the experts touched, up to all of them."""
    model = ServingModel(mixtral, hardware.load("1xh100-sxm"), prompt_len=128, output_len=64)
    stages = model.stages(1)
    weights = [model.decode_stage(stages[0], 1, b, 160)["weights"] for b in (1, 2, 8, 64, 512)]
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
    served = [forward_parts(block, model.ctx(tp))[0] for tp in (1, 2)]
    trained = [forward_parts(block, replace(model.ctx(tp), experts_split=False))[0] for tp in (1, 2)]
    experts = served[0] - served[1]
    assert served[1] < served[0] and trained[1] > served[1]
    assert trained[0] - trained[1] < experts  # only the dense GEMMs split under training's TP
