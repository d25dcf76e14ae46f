"""Mixture-of-experts configs as the executor runs them today: experts whole on every TP rank."""
import pytest

from costmodel.data_parallel import layer_params_on_rank

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mixtral_block():
    from planner.resolve import resolve_workload

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


def test_grouped_expert_gemms_backward_twice_their_forward():
    """The backward's weight gradients are grouped GEMMs whose groups split the contracted dim:
    counted once over it, not once per expert."""
    from planner.trace.workload_for import workload_for

    cfg = {"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
           "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000, "num_local_experts": 8,
           "num_experts_per_tok": 2}
    _, graph = workload_for(cfg, seq_len=128)
    flops = {"forward": 0.0, "backward": 0.0}
    for _, node in graph.graph.nodes(data=True):
        if node["op"].startswith("aten._grouped_mm"):
            flops[node["phase"]] += node["flops"]
    assert not graph.warnings
    if not flops["forward"]:  # a per-expert loop traces plain linears: nothing of this test to check
        pytest.skip("this transformers runs Mixtral's experts as a per-expert loop, not grouped GEMMs")
    assert flops["backward"] == pytest.approx(2 * flops["forward"])


def test_tp_splits_the_attention_but_not_the_experts(mixtral_block):
    whole = layer_params_on_rank(mixtral_block, 1)
    split = layer_params_on_rank(mixtral_block, 2)
    dense = mixtral_block.params - mixtral_block.expert_params
    assert whole - split == pytest.approx(dense / 2)


@pytest.fixture(scope="module")
def mixtral():
    from planner.resolve import resolve_workload

    return resolve_workload("mixtral-8x7b", seq_len=4096, dtype="bf16")


def _plan(workload, **kw):
    from layout.plan import Plan, uniform_stages

    kinds = [layer.kind for layer in workload.layers]
    return Plan(model="mixtral-8x7b", hardware="64xh100-sxm", global_batch=256, seq_len=4096, micro_batch=4,
                tp=1, pp=1, stages=uniform_stages(kinds, 1, "full"), **kw)


def test_expert_parallel_splits_the_experts_and_adds_all_to_alls(mixtral):
    import hardware
    from costmodel.estimate import estimate

    cluster = hardware.load("64xh100-sxm")
    one = estimate(mixtral, _plan(mixtral, dp=64, zero=1), cluster)
    eight = estimate(mixtral, _plan(mixtral, dp=64, zero=1, ep=8), cluster)
    assert one.breakdown_s["ep_comm"] == 0 < eight.breakdown_s["ep_comm"]
    weights = lambda e: e.stages[0].memory_bytes["weights"]  # noqa: E731
    experts = sum(l.expert_params * n for l, n in ((s.layer, s.count) for s in mixtral.segments))
    assert weights(one) - weights(eight) == pytest.approx(4 * experts * 7 / 8, rel=0.01)  # fp32 weights (autocast)


def test_estimate_and_simulator_agree_on_expert_parallel(mixtral):
    import hardware
    from costmodel.estimate import estimate
    from costmodel.simulate.step import simulate

    cluster = hardware.load("64xh100-sxm")
    plan = _plan(mixtral, dp=64, zero=1, ep=8)
    assert estimate(mixtral, plan, cluster).step_time_s == pytest.approx(simulate(mixtral, plan, cluster).step_time_s,
                                                                          rel=0.03)


def test_the_space_offers_ep_for_moe_only():
    import planner
    from hardware.errors import PlanError

    plan = planner.plan("mixtral-8x7b", "64xh100-sxm", global_batch=256, seq_len=4096, fixed={"ep": 8}, time_limit_s=20)
    assert plan.ep == 8 and plan.tp == plan.pp == 1
    with pytest.raises(PlanError, match="ep"):
        planner.plan("llama-3-8b", "8xh100-sxm", global_batch=64, seq_len=4096, fixed={"ep": 2, "tp": 1, "pp": 1})


def test_an_fp32_moe_traces_like_bf16_with_twice_the_bytes():
    """HF's experts run `aten._grouped_mm`, whose fake kernel takes bf16 only: fp32 (CPU
    profiles) traces through a bf16 stand-in and keeps its own bytes."""
    from planner.resolve import resolve_workload

    half, full = (resolve_workload("hf-mixtral-tiny", seq_len=16, dtype=d) for d in ("bf16", "fp32"))
    block = lambda w: next(l for l in w.layers if l.kind == "block")  # noqa: E731
    assert block(full).expert_flops == block(half).expert_flops > 0
    saved = lambda l: l.act_replicated + l.act_tp_sharded  # noqa: E731
    assert saved(block(full)) == pytest.approx(2 * saved(block(half)), rel=0.1)
    assert block(full).expert_dispatch_bytes == pytest.approx(2 * block(half).expert_dispatch_bytes)


def test_the_declaration_composes_ep_with_tp_pp_cp_but_not_sp_or_hybrid_sharding():
    from layout.layout import Layout
    from layout.rules import ModelFacts, layout_problem

    moe = ModelFacts(n_blocks=4, heads=8, kv_heads=4, vocab=1000, n_experts=8, name="moe")
    assert layout_problem(Layout(dp=4, tp=2, pp=2, ep=4), moe, 64) is None
    assert layout_problem(Layout(dp=2, cp=2, tp=1, pp=1, ep=4), moe, 64) is None
    assert layout_problem(Layout(dp=4, tp=2, pp=1, sp=True, ep=2), moe, 64).field == "sp"
    assert layout_problem(Layout(dp=4, tp=1, pp=1, zero=3, dp_shard=2, ep=2), moe, 64).field == "ep"
    assert layout_problem(Layout(dp=2, tp=1, pp=1, ep=4), moe, 64).field == "ep"
