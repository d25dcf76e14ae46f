"""Mixed-GPU clusters: hardware.mixed and planner.mixed."""
from __future__ import annotations

import pytest

from costmodel import TransformerDims, transformer_workload
from hardware.errors import HardwareError
from hardware.mixed import load_mixed
from planner.mixed.search import plan_hetero
from planner.mixed.layouts import hetero_candidates

SPEC = "8xa100-80g+8xh100-sxm"


@pytest.fixture(scope="module")
def gpt_3b():
    return transformer_workload(TransformerDims(name="gpt-3b", n_layers=24, hidden=3072, heads=24, vocab=50304,
                                                seq_len=2048, biases=False, learned_positions=False))


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


def test_pipeline_split_gives_fast_gpus_more_layers(gpt_3b):
    mixed = load_mixed(SPEC)
    cands = [c for c in hetero_candidates(gpt_3b, mixed, global_batch=64) if c.plan.mode == "pipeline-split"]
    best = min(cands, key=lambda c: c.step).plan
    per_stage = {b.group.split("x", 1)[1]: max(b.blocks_per_stage) for b in best.balance}
    assert per_stage["h100-sxm"] > per_stage["a100-80g"]
    assert sum(sum(b.blocks_per_stage) for b in best.balance) == gpt_3b.n_blocks
    for b in best.balance:
        assert b.peak_memory_gib <= b.capacity_gib


def test_mixed_never_slower_than_best_uniform_subset(gpt_3b):
    plan = plan_hetero(gpt_3b, SPEC, global_batch=64, seq_len=2048, time_limit_s=1.0)
    assert plan.subset_step_time_s, "each group alone should fit a 3B model"
    assert plan.step_time_s <= min(plan.subset_step_time_s.values()) * (1 + 1e-9)
    assert plan.uniform_step_time_s is not None and plan.step_time_s < plan.uniform_step_time_s
    if plan.mode == "data-split":  # the faster group's replicas run more micro-batches
        mb = {b.group.split("x", 1)[1]: b.micro_batches for b in plan.balance}
        assert mb["h100-sxm"] > mb["a100-80g"]
    assert sum(b.replicas * b.micro_batches for b in plan.balance) * plan.micro_batch == 64 or plan.mode != "data-split"


def test_cli_hetero_bad_spec_is_one_line(capsys):
    from parallax_cli import main

    assert main(["hetero-plan", "gpt2", "--hw", "8xa100-80g+", "--global-batch", "8", "--seq-len", "128"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err


def test_plan_is_the_one_door_for_mixed_clusters(gpt_3b, capsys):
    """`planner.plan` and `parallax plan` take a mixed spec; the pick is never slower than any
    single group's plan; what the mixed search does not offer is refused by name."""
    import planner
    from hardware.errors import PlanError
    from parallax_cli import main

    plan = planner.plan(gpt_3b, SPEC, global_batch=64, seq_len=2048, time_limit_s=1.0)
    assert plan.hardware == SPEC and plan.step_time_s <= min(plan.subset_step_time_s.values()) * (1 + 1e-9)
    with pytest.raises(PlanError) as refused:
        planner.plan(gpt_3b, SPEC, global_batch=64, seq_len=2048, fixed={"tp": 2})
    assert refused.value.field == "fixed"
    assert main(["plan", "llama-160m", "--hw", SPEC, "--global-batch", "64", "--seq-len", "1024", "--time-limit", "1"]) == 0
    assert "heterogeneity-aware" in capsys.readouterr().out
    assert main(["plan", "llama-160m", "--hw", SPEC, "--global-batch", "64", "--seq-len", "1024", "--tp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: fixed:") and "\n" not in err


def test_a_written_mixed_plan_is_refused_by_name_not_by_schema(tmp_path, capsys):
    """The mixed search's file is not yet a Plan the other commands take: they say so in one line."""
    from parallax_cli import main

    out = tmp_path / "mixed.json"
    assert main(["plan", "llama-160m", "--hw", SPEC, "--global-batch", "64", "--seq-len", "1024", "--time-limit", "1",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: plan:") and "mixed-cluster plan" in err and "\n" not in err
