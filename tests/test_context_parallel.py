"""Context parallelism in the plan, the search and the cost model (the runs are in test_executor)."""
import pytest

import hardware
import planner
from costmodel.estimate import estimate
from layout.plan import Plan, uniform_stages
from costmodel.simulate.step import simulate
from executor.apply.context_parallel import chunk_index
from planner.resolve import resolve_workload


@pytest.fixture(scope="module")
def long_llama():
    return resolve_workload("llama-3-8b", seq_len=131072, dtype="bf16")


def _plan(workload, cluster, **kw):
    kinds = [layer.kind for layer in workload.layers]
    kw.setdefault("pp", 1)
    return Plan(model="llama-3-8b", hardware=cluster.spec(), global_batch=64, seq_len=workload.seq_len, micro_batch=1,
                stages=uniform_stages(kinds, kw["pp"], "full"), **kw)


def test_128k_llama_plans_context_parallel_with_tp_inside_the_node(long_llama):
    """Golden: a 128K-token llama-3-8b on 64 H100s shards the sequence rather than the model across nodes."""
    plan = planner.plan("llama-3-8b", "64xh100-sxm", global_batch=64, seq_len=131072, time_limit_s=20)
    assert plan.cp > 1
    assert plan.tp * plan.pp <= 8 and plan.pp == 1
    assert plan.n_gpus == 64 and plan.estimate.fits


def test_cp_divides_activations_and_adds_the_key_value_gathers(long_llama):
    cluster = hardware.load("64xh100-sxm")
    one = estimate(long_llama, _plan(long_llama, cluster, dp=8, tp=8, zero=3), cluster)
    four = estimate(long_llama, _plan(long_llama, cluster, dp=2, cp=4, tp=8, zero=3), cluster)
    act = lambda e: e.stages[0].memory_bytes["activations"]  # noqa: E731
    # a quarter of the tokens' activations, and at most one rebuilt layer's gathered keys and values
    # and its queries' mask bias over the whole sequence (the next test's terms, for one of 32 layers)
    kv = 2 * 8 * 128 * 131072 * 2
    rebuilt = kv * (4 * 4 - 1) / 4 / 8 + 131072 / 4 * 131072 * 2
    assert act(one) / 4 * 0.98 <= act(four) <= act(one) / 4 + rebuilt
    # a quarter of the tokens' TP collectives, plus the key/value gathers
    assert four.breakdown_s["tp_comm"] > one.breakdown_s["tp_comm"] / 4 * 1.05


def test_unrecomputed_cp_attention_keeps_the_gathered_keys_and_values(long_llama):
    """The attention saves for its backward the whole sequence's keys and values repeated to every
    query head (32 of llama-3-8b's 8 kv heads: 4 groups), less the rank's own already counted, and
    the mask of its queries over the sequence as a bf16 bias, whole on every TP rank."""
    cluster = hardware.load("64xh100-sxm")
    plans = {cp: _plan(long_llama, cluster, dp=8 // cp, cp=cp, tp=8, zero=3) for cp in (1, 4)}
    for plan in plans.values():
        plan.stages[0].recompute[:] = ["none"] * len(plan.stages[0].recompute)
    one, four = (estimate(long_llama, plans[cp], cluster).stages[0].memory_bytes["activations"] for cp in (1, 4))
    kv = 2 * 8 * 128 * 131072 * 2  # one sequence's keys and values of one layer: 8 kv heads of 128, bf16
    gathered = kv * (4 * 4 - 1) / 4 / 8 * 32  # repeated to 4 groups over 4 ranks, less its own; tp=8; 32 layers
    bias = 131072 / 4 * 131072 * 2 * 32  # the rank's queries x the sequence's keys, bf16, in each of 32 layers
    assert four == pytest.approx(one / 4 + gathered + bias, rel=0.02)


def test_estimate_and_simulator_agree_on_cp_plans(long_llama):
    cluster = hardware.load("64xh100-sxm")
    for kw in (dict(dp=2, cp=16, tp=2, sp=True, zero=2), dict(dp=4, cp=4, tp=4, zero=3, dp_shard=16)):
        plan = _plan(long_llama, cluster, **kw)
        est, sim = estimate(long_llama, plan, cluster).step_time_s, simulate(long_llama, plan, cluster).step_time_s
        assert est == pytest.approx(sim, rel=0.03), kw


def test_cp_needs_two_chunks_per_rank_and_no_pipeline(long_llama):
    cluster = hardware.load("64xh100-sxm")
    with pytest.raises(ValueError, match="2\\*cp"):
        Plan(model="m", hardware="64xh100-sxm", global_batch=8, seq_len=100, dp=1, tp=8, pp=1, cp=8, micro_batch=1,
             stages=uniform_stages(["embedding", "block", "head"], 1))
    from hardware.errors import PlanError

    with pytest.raises(PlanError, match="cp"):
        planner.plan("llama-3-8b", cluster, global_batch=64, seq_len=131072, fixed={"cp": 4, "pp": 2})


def test_chunks_balance_the_causal_work():
    cp, seq = 4, 64
    chunks = [chunk_index(seq, cp, r) for r in range(cp)]
    assert sorted(int(i) for c in chunks for i in c) == list(range(seq))
    work = [int(sum(c + 1)) for c in chunks]  # keys each query attends to
    assert len(set(work)) == 1
