"""Priced once: the solver's linear coefficients are the estimator's terms, so on every
layout the space offers they price a partition as the estimator does, time and peak
memory alike; on a mixed cluster's pipeline split too, each rank on its own GPUs."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import hardware
from costmodel.estimate import estimate
from costmodel.terms import usable_memory_bytes
from hardware.mixed import load_mixed
from layout.axes import RECOMPUTE
from planner.mixed.layouts import pipeline_splits, rank_data
from planner.mixed.refine import counts_of
from planner.search.coefficients import block_span, stage_model_data
from planner.search.linear_model import linear_step
from planner.search.solver import StageModel
from planner.search.space import layouts, to_plan
from planner.trace.workload_for import workload_for

CASES = {"llama-3-8b": ("8xh100-sxm", 64), "mixtral-8x7b": ("16xh100-sxm", 64)}


@pytest.fixture(scope="module")
def spaces():
    out = {}
    for model, (hw, batch) in CASES.items():
        workload, _ = workload_for(model, seq_len=4096)
        cluster = hardware.load(hw)
        out[model] = (workload, cluster, batch, sorted(layouts(workload, cluster, batch), key=repr))
    return out


@settings(max_examples=40, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.generate])
@given(data=st.data())
def test_the_solvers_coefficients_price_a_layout_as_the_estimator_does(spaces, data):
    model = data.draw(st.sampled_from(sorted(CASES)))
    workload, cluster, batch, space = spaces[model]
    layout = data.draw(st.sampled_from(space))
    policy = data.draw(st.sampled_from(RECOMPUTE))
    plan = to_plan(layout, workload, cluster, global_batch=batch, dtype="bf16", recompute=policy, model=model)
    capacity = usable_memory_bytes(cluster, 0.1, plan, workload)
    first, last = block_span(workload)
    counts = [{policy: min(s.end, last) - max(s.start, first)} for s in plan.stages]
    step, headroom = linear_step(stage_model_data(workload, plan, cluster, capacity), counts, plan.pp, plan.vpp,
                                 plan.num_micro_batches)
    priced = estimate(workload, plan, cluster)
    # the solver holds the reservation (tensors and the caching allocator's cached blocks) to the GPU
    assert capacity - headroom == pytest.approx(priced.peak_reserved_bytes, rel=1e-6), plan.layout_tag
    # collectives enter the solver as their latency plus their least marginal cost (exact to
    # ~1e-6 of a step); offloaded pipelines' per-stage host-copy fills are a linear stand-in (10%)
    tolerance = 0.1 if plan.offload and plan.pp > 1 else 1e-4
    assert step == pytest.approx(priced.step_time_s, rel=tolerance), plan.layout_tag


def test_a_mixed_pipeline_split_is_priced_by_the_stage_model_as_by_the_estimator():
    from costmodel.transformer import TransformerDims, transformer_workload

    workload = transformer_workload(TransformerDims(name="gpt-3b", n_layers=24, hidden=3072, heads=24, vocab=50304,
                                                    seq_len=2048, biases=False, learned_positions=False))
    mixed = load_mixed("8xa100-80g+8xh100-sxm")
    splits = pipeline_splits(workload, mixed, global_batch=64, dtype="bf16", name="gpt-3b", reserve=0.1)
    for plan, order in sorted(splits, key=lambda po: po[0].estimate.step_time_s)[:4]:
        model = StageModel(rank_data(workload, plan, mixed, order, 0.1), plan.pp, plan.vpp, plan.num_micro_batches)
        for stage, counts in zip(model.n, counts_of(workload, plan)):
            for policy, n in counts.items():
                model.model.Add(stage[policy] == n)
        solution = model.solve(5.0)
        assert solution is not None
        assert solution.objective_s == pytest.approx(plan.estimate.step_time_s, rel=1e-4), plan.layout_tag


def test_the_solvers_coefficients_price_every_zbv_layout_as_the_estimator_does(spaces):
    """ZB-V's V (rank 0 holding the first and last stages, the turn handed over in place) priced
    alike by the solver's coefficients and the estimator, time and memory, on every such layout."""
    workload, cluster, batch, space = spaces["llama-3-8b"]
    zbv = [layout for layout in space if layout.schedule == "zbv"]
    assert zbv
    first, last = block_span(workload)
    for layout in zbv:
        plan = to_plan(layout, workload, cluster, global_batch=batch, dtype="bf16", recompute="none", model="llama-3-8b")
        capacity = usable_memory_bytes(cluster, 0.1, plan, workload)
        counts = [{"none": min(s.end, last) - max(s.start, first)} for s in plan.stages]
        step, headroom = linear_step(stage_model_data(workload, plan, cluster, capacity), counts, plan.pp, plan.vpp,
                                     plan.num_micro_batches)
        priced = estimate(workload, plan, cluster)
        assert capacity - headroom == pytest.approx(priced.peak_reserved_bytes, rel=1e-6), plan.layout_tag
        assert step == pytest.approx(priced.step_time_s, rel=0.1 if plan.offload else 1e-4), plan.layout_tag


def test_zero_threes_backward_end_is_priced_by_the_solver_as_by_the_estimator():
    """A tied table under ZeRO-3 at short sequences peaks at the root unit's backward end
    (`costmodel.peak.closing_moments`): the solver's closing constraint holds it as the
    estimator does, under every policy."""
    workload, _ = workload_for("llama-3.2-1b", seq_len=512)
    cluster = hardware.load("8xh100-sxm")
    layout = next(l for l in sorted(layouts(workload, cluster, 8), key=repr)
                  if l.dp == 8 and l.tp == 1 and l.pp == 1 and l.zero == 3 and l.micro_batch == 1)
    first, last = block_span(workload)
    for policy in RECOMPUTE:
        plan = to_plan(layout, workload, cluster, global_batch=8, dtype="bf16", recompute=policy, model="llama-3.2-1b")
        capacity = usable_memory_bytes(cluster, 0.1, plan, workload)
        data = stage_model_data(workload, plan, cluster, capacity)
        assert data.closes_above_states(0)
        _, headroom = linear_step(data, [{policy: last - first}], plan.pp, plan.vpp, plan.num_micro_batches)
        priced = estimate(workload, plan, cluster)
        assert capacity - headroom == pytest.approx(priced.peak_reserved_bytes, rel=1e-6), policy
