"""Offload (FSDP2's CPUOffloadPolicy) as a dimension of the space: priced, searched only where
it wins, refused by name where the profile cannot price it. The executor's runs of it are in
test_executor.py (against the single-process reference)."""
from __future__ import annotations

import pytest

import hardware
import planner
from costmodel.estimate import estimate
from costmodel.offload import HOST_ADAMW_FRESH_BYTES, HOST_ADAMW_TRAFFIC_BYTES
from hardware.errors import InfeasibleError, PlanError
from planner.resolve import resolve_workload

from conftest import NEVER_S


def _with_host_memory(spec: str, gb: float):
    cluster = hardware.load(spec)
    node = cluster.node.model_copy(update={"host_memory_gb": gb})
    return cluster.model_copy(update={"node": node})


@pytest.fixture(scope="module")
def llama_70b():
    return resolve_workload("llama-3-70b", seq_len=4096, dtype="bf16")


def test_a_model_that_fits_only_offloaded_is_planned_offloaded(llama_70b):
    """llama-3-70b's 16 bytes of states per parameter (1.13 TB) overflow eight 40 GB A100s; with
    2 TB of host memory (a DGX A100's option) offloaded ZeRO-3 fits, host traffic priced."""
    plan = planner.plan(llama_70b, _with_host_memory("8xa100-40g", 2048), global_batch=64, seq_len=4096, top_k=1,
                        fixed=dict(dp=8))
    est = plan.estimate
    assert plan.offload and plan.zero >= 2 and est.fits
    assert est.host_memory_bytes == pytest.approx(16 * llama_70b.params, rel=0.01)
    assert 0 < est.host_copy_s < est.step_time_s
    owned = llama_70b.params / plan.shard_degree
    host_per_rank = 409.6e9 / 8
    # the host AdamW (FSDP2's gradient copies on the GPU come with each reduce-scatter, not the step)
    assert est.breakdown_s["optimizer"] == pytest.approx(HOST_ADAMW_TRAFFIC_BYTES * owned / host_per_rank, rel=0.02)
    # each micro-batch after the first adds its reduce-scattered fp32 shard into the host's (FSDP2's foreach_reduce),
    # priced in the backward at the host's bandwidth
    from costmodel.accumulation import accumulation_seconds_per_param
    assert plan.num_micro_batches > 1
    host = accumulation_seconds_per_param(plan, _with_host_memory("8xa100-40g", 2048))
    assert host * llama_70b.params == pytest.approx((plan.num_micro_batches - 1) * 3 * 4 * owned / host_per_rank)
    state_free = max(s.memory_bytes["weights"] + s.memory_bytes["optimizer"] for s in est.stages)
    assert state_free == 0.0  # no states on the GPUs


def test_a_measured_hosts_fresh_pages_slow_the_offloaded_adamw(llama_70b):
    """The host AdamW's two temporaries per parameter are mapped afresh each step: priced at the
    host's measured fresh-page rate where the profile has one, nothing where it does not."""
    plan = planner.plan(llama_70b, _with_host_memory("8xa100-40g", 2048), global_batch=64, seq_len=4096, top_k=1,
                        fixed=dict(dp=8, zero=3, offload=True))
    cluster = _with_host_memory("8xa100-40g", 2048)
    faster = cluster.model_copy(update={"node": cluster.node.model_copy(update={"host_fresh_page_gbps": 10.0})})
    plain, paged = estimate(llama_70b, plan, cluster), estimate(llama_70b, plan, faster)
    owned = llama_70b.params / plan.shard_degree
    extra = paged.breakdown_s["optimizer"] - plain.breakdown_s["optimizer"]
    assert extra == pytest.approx(HOST_ADAMW_FRESH_BYTES * owned / 10e9, rel=0.02)


def test_the_hosts_memory_bounds_offload(llama_70b):
    with pytest.raises(InfeasibleError, match="host memory per node"):
        planner.plan(llama_70b, "8xa100-40g", global_batch=64, seq_len=4096, time_limit_s=NEVER_S)  # 1 TB hosts


def test_offload_is_not_chosen_where_the_states_fit():
    plan = planner.plan("llama-3-8b", "64xh100-sxm", global_batch=256, seq_len=4096, top_k=1)
    assert not plan.offload


def test_offloaded_step_pays_for_its_copies_and_host_optimizer():
    workload = resolve_workload("llama-3-8b", seq_len=4096, dtype="bf16")
    cluster = hardware.load("8xa100-80g")
    plain = planner.plan(workload, cluster, global_batch=16, seq_len=4096, top_k=1,
                         fixed=dict(dp=8, zero=3, micro_batch=1, offload=False, recompute="full"))
    moved = plain.model_copy(update={"offload": True})
    a, b = estimate(workload, plain, cluster), estimate(workload, moved, cluster)
    assert b.step_time_s > a.step_time_s and b.peak_memory_bytes < a.peak_memory_bytes
    assert b.breakdown_s["optimizer"] > a.breakdown_s["optimizer"]


def test_pinned_offload_needs_zero_2_or_3_and_host_figures():
    with pytest.raises(PlanError, match="offload"):
        planner.plan("reference-tiny", "4xcpu", global_batch=8, seq_len=16, dtype="fp32",
                     fixed=dict(dp=4, zero=1, offload=True))
    cluster = hardware.load("8xmi300x")
    assert cluster.node.host_memory_gb is None
    with pytest.raises((PlanError, InfeasibleError)):
        planner.plan("llama-3-8b", cluster, global_batch=64, seq_len=4096, fixed=dict(offload=True))
