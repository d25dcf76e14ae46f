"""The host's floor under eager PyTorch: a layer runs no faster than the host issues its aten ops
(`costmodel.compute.host_issue_time`). The op counts are the tracer's; here they are held to what
the executor's modules dispatch on this CPU, and the floor to the cost model's composition."""
from __future__ import annotations

import pytest
import torch
from torch.distributed._composable import checkpoint

import hardware
from costmodel.compute import host_issue_time, layer_parts, layer_time
from costmodel.layout import layout_of
from executor.apply.layers import layer_map
from executor.measure.microbench import CountOps
from executor.runtime.models import build_model
from layout.layout import Layout
from planner.search.space import to_plan
from planner.trace.workload_for import workload_for

MODEL, SEQ = "llama-160m", 16


def _dispatched(checkpointed: bool) -> tuple[int, int, int]:
    """(forward, backward, blocks) aten ops of one fp32 step of the executor's model."""
    model = build_model(MODEL)
    blocks = layer_map(model).block_names
    if checkpointed:
        for name in blocks:
            checkpoint(model.get_submodule(name), use_reentrant=False)
    tokens = torch.randint(0, 100, (1, SEQ))
    forward, backward = CountOps(), CountOps()
    with forward:
        out = model(tokens)
        loss = (out.logits if hasattr(out, "logits") else out).float().mean()
    with backward:
        loss.backward()
    return forward.ops, backward.ops, len(blocks)


@pytest.fixture(scope="module")
def block():
    workload, _ = workload_for(MODEL, seq_len=SEQ, dtype="fp32")
    return workload, next(s.layer for s in workload.segments if s.layer.kind == "block")


def test_the_traced_op_counts_are_what_the_executor_dispatches(block):
    """Per block, within a quarter: the forward's ops, the backward's, and what full
    recomputation adds to the backward (the forward again, and a detach of each saved tensor)."""
    workload, layer = block
    fwd, bwd, n = _dispatched(checkpointed=False)
    _, bwd_checkpointed, _ = _dispatched(checkpointed=True)
    fixed = [s.layer for s in workload.segments if s.layer.kind != "block"]
    per_block_fwd = (fwd - sum(layer.host_ops_forward for layer in fixed)) / n
    per_block_bwd = (bwd - sum(layer.host_ops_backward for layer in fixed)) / n
    assert per_block_fwd == pytest.approx(layer.host_ops_forward, rel=0.25)
    assert per_block_bwd == pytest.approx(layer.host_ops_backward, rel=0.25)
    assert (bwd_checkpointed - bwd) / n == pytest.approx(layer.host_ops_forward + layer.host_ops_saved, rel=0.25)


def _ctx(workload, us: float | None, stack: str = "eager"):
    cluster = hardware.load("1xh200")
    cluster = cluster.model_copy(update={"gpu": cluster.gpu.model_copy(update={"host_op_us": us})})
    plan = to_plan(Layout(dp=1, zero=3, micro_batch=1, stack=stack), workload, cluster, global_batch=1, dtype="bf16",
                   recompute="none", model=MODEL)
    return layout_of(plan, cluster, workload).ctx


def test_a_slow_host_floors_each_phase_and_a_replay(block):
    workload, layer = block
    slow, unmeasured = _ctx(workload, 1000.0), _ctx(workload, None)
    plain = layer_parts(layer, slow).plain
    assert plain.forward == pytest.approx(layer.host_ops_forward * 1e-3)
    assert plain.backward == pytest.approx(layer.host_ops_backward * 1e-3)
    replay = (layer.host_ops_forward + layer.host_ops_saved) * 1e-3
    assert layer_time(layer, slow, "full").recompute == pytest.approx(replay)
    assert layer_time(layer, slow, "op").recompute == pytest.approx(replay)
    assert layer_parts(layer, unmeasured).plain.forward < plain.forward / 100  # nothing where the profile has no cost


def test_compiled_kernels_are_not_floored_by_the_traced_ops(block):
    workload, _ = block
    assert host_issue_time(1000, _ctx(workload, 1000.0, stack="compile")) == 0.0
    assert host_issue_time(1000, _ctx(workload, 1000.0)) == pytest.approx(1.0)


def test_calibrate_measures_a_per_op_host_cost():
    """What `calibrate` records as `gpu.host_op_us` on a GPU, run here on the CPU (whose device is
    its host, so it is not recorded for CPU profiles)."""
    from executor.measure.microbench import host_op_seconds

    seconds = host_op_seconds("cpu", torch.float32, budget_s=0.05)
    assert 0 < seconds < 0.1
