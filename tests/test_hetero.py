"""Mixed-GPU clusters: hardware.mixed, plans with groups (layout.groups), their pricing
(costmodel.mixed), simulation (costmodel.simulate.mixed) and search (planner.mixed)."""
from __future__ import annotations

import pytest

from costmodel import TransformerDims, transformer_workload
from costmodel.estimate import estimate
from layout.plan import Plan
from costmodel.simulate.step import simulate
from hardware.errors import HardwareError, PlanError
from hardware.mixed import load_mixed
from planner.mixed.layouts import data_splits, pipeline_splits
from planner.mixed.search import plan_mixed
from planner.request import PlanRequest

SPEC = "8xa100-80g+8xh100-sxm"


@pytest.fixture(scope="module")
def gpt_3b():
    return transformer_workload(TransformerDims(name="gpt-3b", n_layers=24, hidden=3072, heads=24, vocab=50304,
                                                seq_len=2048, biases=False, learned_positions=False))


@pytest.fixture(scope="module")
def picked(gpt_3b):
    # a limit the search never reaches on this machine: the pick must not depend on its speed
    return plan_mixed(gpt_3b, SPEC, PlanRequest(global_batch=64, seq_len=2048, time_limit_s=20.0))


def test_mixed_cluster_network_and_errors():
    mixed = load_mixed("16xa100-80g+8xh100-sxm")
    assert mixed.n_gpus == 24 and mixed.spec() == "16xa100-80g+8xh100-sxm"
    assert mixed.nic_gbps == min(g.nic_gbps for g in mixed.groups)
    assert mixed.slowest().gpu.name == "a100-80g"
    uniform = mixed.as_uniform()
    assert uniform.n_gpus == 24 and uniform.gpu.name == "a100-80g" and uniform.nic_gbps == mixed.nic_gbps
    for bad in ("16xa100-80g+", "8xa100-80g+8xa100-80g", "16xa100-80g+7xh100-sxm", "8xa100-80g+8xfoo"):
        with pytest.raises(HardwareError):
            load_mixed(bad)


def test_pipeline_split_gives_fast_gpus_more_blocks(gpt_3b):
    mixed = load_mixed(SPEC)
    pipes = pipeline_splits(gpt_3b, mixed, global_batch=64, dtype="bf16", name="gpt-3b", reserve=0.1)
    best = min((p for p, _ in pipes), key=lambda p: p.estimate.step_time_s)
    blocks = {g.group.split("x", 1)[1]: max(g.blocks_per_stage) for g in best.estimate.groups}
    assert blocks["h100-sxm"] > blocks["a100-80g"]
    assert sum(sum(g.blocks_per_stage) for g in best.estimate.groups) == gpt_3b.n_blocks
    assert all(g.fits for g in best.estimate.groups)


def test_the_pick_is_never_slower_than_the_side_search_subsets_or_uniform(gpt_3b, picked):
    """CP-SAT refines the single-policy balance (phase 1, the side search it replaced) and the
    pick is the fastest of everything priced: never slower than phase 1, any single group or the
    uniform plan that ignores the difference."""
    mixed = load_mixed(SPEC)
    kw = dict(global_batch=64, dtype="bf16", name="gpt-3b", reserve=0.1)
    side = [p for p, _ in pipeline_splits(gpt_3b, mixed, **kw)] + data_splits(gpt_3b, mixed, **kw)
    step = picked.estimate.step_time_s
    assert step <= min(p.estimate.step_time_s for p in side) * (1 + 1e-9)
    assert all(step <= a.estimate.step_time_s * (1 + 1e-9) for a in picked.alternatives)
    assert any(not a.groups for a in picked.alternatives), "each group alone is planned and compared"
    assert any("ignores the difference" in note and "x this plan" in note for note in picked.notes)
    assert picked.solver.status == "mixed" and picked.solver.gap is None  # no bound is claimed


def test_cp_sat_refines_a_pipeline_split(gpt_3b):
    """The stage model with per-rank coefficients finds what the single-policy balance cannot
    (it balances on the same coefficients, so the deep pipelines are where blocks of
    unequal stages leave the model room)."""
    from planner.mixed.refine import refine
    from planner.search.coefficients import LayerTimes

    mixed = load_mixed(SPEC)
    pipes = pipeline_splits(gpt_3b, mixed, global_batch=64, dtype="bf16", name="gpt-3b", reserve=0.1)
    gains = []
    deep = [po for po in pipes if po[0].pp >= 8]
    for plan, order in sorted(deep, key=lambda po: po[0].estimate.step_time_s)[:6]:
        better = refine(gpt_3b, plan, mixed, order, 0.1, LayerTimes())
        assert better.estimate.step_time_s <= plan.estimate.step_time_s
        gains.append(plan.estimate.step_time_s - better.estimate.step_time_s)
    assert max(gains) > 0


def test_a_mixed_plan_round_trips_and_enters_every_door(gpt_3b, picked):
    again = Plan.from_json(picked.to_json())
    assert again == picked and again.groups and again.split in ("data", "pipeline")
    cluster = again.cluster()
    assert cluster.spec() in (SPEC, "+".join(reversed(SPEC.split("+"))))
    est = estimate(gpt_3b, again, cluster)
    assert est.step_time_s == pytest.approx(picked.estimate.step_time_s, rel=1e-9)
    assert {g.group for g in est.groups} == set(SPEC.split("+"))
    assert sum(g.gpus for g in est.groups) == 16
    sim = simulate(gpt_3b, again, cluster)
    assert sim.step_time_s == pytest.approx(est.step_time_s, rel=0.10)
    assert {g.group for g in sim.groups} == set(SPEC.split("+"))


def test_both_splits_simulate_per_group(gpt_3b):
    mixed = load_mixed(SPEC)
    kw = dict(global_batch=64, dtype="bf16", name="gpt-3b", reserve=0.1)
    data = min(data_splits(gpt_3b, mixed, **kw), key=lambda p: p.estimate.step_time_s)
    sim = simulate(gpt_3b, data, mixed)
    assert all(g.own is not None for g in sim.groups)  # each group's replica played on its own GPUs
    assert sim.step_time_s == max(g.own.step_time_s for g in sim.groups)
    assert sim.step_time_s == pytest.approx(data.estimate.step_time_s, rel=0.10)
    pipe = min((p for p, _ in pipeline_splits(gpt_3b, mixed, **kw)), key=lambda p: p.estimate.step_time_s)
    sim = simulate(gpt_3b, pipe, mixed)
    assert sorted(r for g in sim.groups for r in g.pipeline_ranks) == list(range(pipe.pp))
    assert sim.step_time_s == pytest.approx(pipe.estimate.step_time_s, rel=0.10)


def _mixed_plan(**changes) -> dict:
    plan = dict(model="gpt-3b", hardware=SPEC, global_batch=64, seq_len=2048, dp=8, tp=1, pp=2, micro_batch=1,
                stages=[{"start": 0, "end": 10, "recompute": ["none"] * 10},
                        {"start": 10, "end": 26, "recompute": ["none"] * 16}],
                groups=[{"hardware": "8xa100-80g", "stages": [0], "replicas": list(range(8))},
                        {"hardware": "8xh100-sxm", "stages": [1], "replicas": list(range(8))}])
    return {**plan, **changes}


def test_groups_are_validated(gpt_3b):
    plan = Plan.model_validate(_mixed_plan())
    assert plan.split == "pipeline"
    est = estimate(gpt_3b, plan, plan.cluster())
    assert [g.ranks for g in est.groups] == ["0-7", "8-15"]
    bad_tilings = [
        [{"hardware": "8xa100-80g", "stages": [0], "replicas": list(range(8))}],  # one group
        [{"hardware": "8xa100-80g", "stages": [0], "replicas": list(range(8))},
         {"hardware": "8xh100-sxm", "stages": [0], "replicas": list(range(8))}],  # stage 1 held by nobody
        [{"hardware": "8xa100-80g", "stages": [0, 1], "replicas": list(range(4))},
         {"hardware": "8xh100-sxm", "stages": [1], "replicas": list(range(4, 8))}],  # neither split
    ]
    for groups in bad_tilings:
        with pytest.raises(ValueError):
            Plan.model_validate(_mixed_plan(groups=groups))
    wrong_size = Plan.model_validate(_mixed_plan(hardware="16xa100-80g+8xh100-sxm", groups=[
        {"hardware": "16xa100-80g", "stages": [0], "replicas": list(range(8))},
        {"hardware": "8xh100-sxm", "stages": [1], "replicas": list(range(8))}]))
    with pytest.raises(PlanError) as refused:
        estimate(gpt_3b, wrong_size, wrong_size.cluster())
    assert refused.value.field == "groups"
    import hardware

    with pytest.raises(PlanError) as one_type:
        estimate(gpt_3b, plan, hardware.load("16xh100-sxm"))
    assert one_type.value.field == "hardware"


def test_plan_is_the_one_door_for_mixed_clusters(gpt_3b, capsys):
    """`planner.plan` and `parallax plan` take a mixed spec; what the mixed search does not offer
    is refused by name."""
    import planner
    from parallax_cli import main

    plan = planner.plan(gpt_3b, SPEC, global_batch=64, seq_len=2048, time_limit_s=1.0)
    assert isinstance(plan, Plan) and plan.estimate.fits
    with pytest.raises(PlanError) as refused:
        planner.plan(gpt_3b, SPEC, global_batch=64, seq_len=2048, fixed={"tp": 2})
    assert refused.value.field == "fixed"
    assert main(["plan", "llama-160m", "--hw", SPEC, "--global-batch", "64", "--seq-len", "1024", "--tp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: fixed:") and "\n" not in err


def test_cli_plans_estimates_simulates_and_dry_runs_a_mixed_plan(tmp_path, capsys):
    from parallax_cli import main

    out, html = tmp_path / "mixed.json", tmp_path / "report.html"
    assert main(["plan", "llama-160m", "--hw", SPEC, "--global-batch", "64", "--seq-len", "1024", "--time-limit", "1",
                 "--out", str(out)]) == 0
    assert "GPU groups" in capsys.readouterr().out
    plan = Plan.from_json(out.read_text())
    assert plan.groups or plan.hardware in SPEC.split("+")
    assert main(["estimate", "llama-160m", "--hw", SPEC, "--plan", str(out)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(out), "--report", str(html)]) == 0
    printed = capsys.readouterr().out
    if plan.groups:
        assert "GPU groups" in printed and "group 8x" in html.read_text()


def test_cli_hetero_bad_spec_is_one_line(capsys):
    from parallax_cli import main

    assert main(["hetero-plan", "gpt2", "--hw", "8xa100-80g+", "--global-batch", "8", "--seq-len", "128"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err


def test_dry_run_measures_each_group_against_its_own_memory():
    """The executor's appliers on fake tensors for a pipeline split: each pipeline rank beside
    its own group's capacity (40 GB A100s hold stage 0, 80 GB H100s stage 1)."""
    from executor.measure.dry_run import dry_run

    plan = Plan(model="reference-tiny", hardware="2xa100-40g+2xh100-sxm", global_batch=8, seq_len=16, dtype="fp32",
                dp=2, tp=1, pp=2, zero=2, micro_batch=1,
                stages=[{"start": 0, "end": 2, "recompute": ["none"] * 2},
                        {"start": 2, "end": 6, "recompute": ["none"] * 4}],
                groups=[{"hardware": "2xa100-40g", "stages": [0], "replicas": [0, 1]},
                        {"hardware": "2xh100-sxm", "stages": [1], "replicas": [0, 1]}])
    result = dry_run(plan)
    capacity = {r.pp_rank: r.capacity for r in result.ranks}
    assert capacity[0] < capacity[1]
    assert [g.group for g in result.plan.estimate.groups] == ["2xa100-40g", "2xh100-sxm"]
    assert all(r.measured_peak > 0 and r.predicted_peak > 0 for r in result.ranks)
