"""Mixture-of-experts configs as the executor runs them today: experts whole on every TP rank."""
import pytest

from costmodel.data_parallel import layer_params_on_rank

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mixtral_block():
    from planner.api import resolve_workload

    cfg = {"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
           "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000, "num_local_experts": 8,
           "num_experts_per_tok": 2}
    workload = resolve_workload(cfg, seq_len=128, dtype="bf16")
    return next(layer for layer in workload.layers if layer.kind == "block")


def test_the_tracer_finds_the_experts_and_their_tokens(mixtral_block):
    expert_weights = 8 * (2 * 512 * 256 + 256 * 512)
    assert mixtral_block.expert_params == expert_weights
    assert mixtral_block.expert_tokens == 128 * 2 / 8
    # top-2 of 8: the expert GEMMs do 2 tokens' worth of the three projections per token
    assert mixtral_block.expert_flops == pytest.approx(2 * 128 * 2 * 3 * 512 * 256)


def test_tp_splits_the_attention_but_not_the_experts(mixtral_block):
    whole = layer_params_on_rank(mixtral_block, 1)
    split = layer_params_on_rank(mixtral_block, 2)
    dense = mixtral_block.params - mixtral_block.expert_params
    assert whole - split == pytest.approx(dense / 2)
