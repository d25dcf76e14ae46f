"""TP overlap (Megatron-LM's --tp-comm-overlap, torchtitan's async TP): a pinned recipe axis,
priced by chunking SP's collectives behind the GEMMs, never chosen by the planner nor run here."""
import pytest

import hardware
import planner
from costmodel.compute import Context, exposed_tp_time, forward_parts, tp_collective_time
from formats import export, megatron
from hardware.errors import PlanError
from layout.layout import Layout
from layout.rules import ModelFacts, layout_problem, structural_problem

KW = dict(global_batch=64, seq_len=8192, time_limit_s=3)
PINS = {"stack": "fused", "tp": 8, "sp": True, "pp": 1, "zero": 1}


def test_overlap_needs_sp_and_a_stack_that_runs_it():
    assert structural_problem(Layout(tp=2, tp_overlap=True)).field == "tp_overlap"  # no sp
    assert structural_problem(Layout(tp=1, sp=True, tp_overlap=True, stack="fused")).field == "tp_overlap"  # no TP
    assert structural_problem(Layout(tp=2, sp=True, tp_overlap=True)).field == "tp_overlap"  # eager
    assert structural_problem(Layout(tp=2, sp=True, tp_overlap=True, stack="fused")) is None
    compiled = Layout(tp=2, sp=True, tp_overlap=True, stack="compile")
    assert structural_problem(compiled) is None
    refused = layout_problem(compiled, ModelFacts(n_blocks=4, heads=8, kv_heads=8), seq_len=64)
    assert refused.field == "tp_overlap" and "priced, not run" in refused.problem


def test_the_planner_prices_it_only_when_pinned():
    plain = planner.plan("llama-3-70b", "64xh100-sxm", fixed=PINS, **KW)
    overlapped = planner.plan("llama-3-70b", "64xh100-sxm", fixed={**PINS, "tp_overlap": True}, **KW)
    assert not plain.tp_overlap and overlapped.tp_overlap and "+overlap" in overlapped.layout_tag
    assert overlapped.estimate.step_time_s < plain.estimate.step_time_s
    assert overlapped.estimate.breakdown_s["tp_comm"] < plain.estimate.breakdown_s["tp_comm"]
    with pytest.raises(PlanError) as refused:
        planner.plan("llama-3-70b", "64xh100-sxm", fixed={"tp_overlap": True}, **KW)  # the eager stack
    assert refused.value.field == "tp_overlap"


def test_what_stays_exposed_is_the_first_chunk_or_what_outlasts_the_gemms():
    from planner.resolve import resolve_workload

    workload = resolve_workload("llama-3-70b", seq_len=8192, dtype="bf16")
    block = next(layer for layer in workload.layers if layer.kind == "block")
    cluster = hardware.load("8xh100-sxm").for_stack("fused")
    from costmodel.collectives import group_of

    ctx = Context(cluster=cluster, dtype="bf16", tp=8, sp=True, micro_batch=1, tp_group=group_of(8, 1, cluster),
                  stack="fused", tp_overlap=True)
    comm, gemm = tp_collective_time(block, ctx), forward_parts(block, ctx)[0]
    assert comm < gemm  # at 8K tokens the chunks hide behind the GEMMs: the first one waits
    assert exposed_tp_time(comm, block, ctx, 1.0) == pytest.approx(comm / 8)
    assert exposed_tp_time(3 * gemm, block, ctx, 1.0) == pytest.approx(2 * gemm)
    synchronous = Context(**{**ctx.__dict__, "tp_overlap": False})
    assert exposed_tp_time(comm, block, synchronous, 1.0) == comm


def test_megatron_and_torchtitan_state_it():
    fused = planner.plan("llama-3-70b", "64xh100-sxm", fixed={**PINS, "tp_overlap": True}, **KW)
    text = export(fused, "megatron").text
    assert "--tp-comm-overlap" in text.splitlines()
    assert megatron.read(text).axes["tp_overlap"] is True
    compiled = planner.plan("llama-3-70b", "64xh100-sxm",
                            fixed={**PINS, "stack": "compile", "zero": 3, "tp_overlap": True}, **KW)
    text = export(compiled, "torchtitan", lossy=True).text  # (torchtitan's own names for the rest)
    assert "--compile.enable-async-tensor-parallel" in text.splitlines()
    lost = export(fused, "deepspeed", lossy=True).lost  # DeepSpeed has no such switch: a loss it must accept
    assert any(item.startswith("tp_overlap:") for item in lost)


def test_dtensor_sp_runs_a_gather_per_column_split_linear():
    """Under DTensor's SP (the eager stack) each column-split linear all-gathers its own input (q, k,
    v, gate and up: 5 in a Llama block) and each row-split one reduce-scatters its output (o, down);
    the backward runs each one's mirror. A profile of llama-160m tp2+sp pp2 on 4 gloo CPU ranks
    counted 86 all-gathers a step on its first rank: 6 blocks x 2 micro-batches x (5 + 2), and the
    embedding's 2. Megatron's SP (the fused stack) gathers once per shared input, the volume of the
    all-reduces it replaces."""
    from costmodel.collectives import all_gather, all_reduce, group_of, reduce_scatter
    from costmodel.compute import tp_backward_collective_time
    from planner.resolve import resolve_workload

    workload = resolve_workload("llama-3-8b", seq_len=4096, dtype="bf16")
    block = next(layer for layer in workload.layers if layer.kind == "block")
    assert (block.tp_allreduces_fwd, block.tp_allreduces_bwd) == (2, 5)
    cluster = hardware.load("8xh100-sxm")
    group = group_of(8, 1, cluster)
    eager = Context(cluster=cluster, dtype="bf16", tp=8, sp=True, micro_batch=1, tp_group=group, stack="eager")
    nbytes = block.tp_comm_bytes
    gather, scatter = all_gather(nbytes, group, cluster), reduce_scatter(nbytes, group, cluster)
    assert tp_collective_time(block, eager) == pytest.approx(5 * gather + 2 * scatter)
    assert tp_backward_collective_time(block, eager) == pytest.approx(5 * scatter + 2 * gather)
    fused = Context(**{**eager.__dict__, "stack": "fused"})
    assert tp_collective_time(block, fused) == pytest.approx(2 * all_reduce(nbytes, group, cluster))
    plain = Context(**{**eager.__dict__, "sp": False})
    assert tp_backward_collective_time(block, plain) == pytest.approx(5 * all_reduce(nbytes, group, cluster))


def test_loss_parallel_reduces_three_values_per_token_in_forward_only():
    """torch's loss parallelism (what the executor computes a TP head's loss with) all-reduces the
    logits' maximum, their exponentials' sum and the target's logit over TP in forward, and nothing
    in backward: counted here on torch's own loss under its fake process group, and priced as that
    many all-reduces of one fp32 per token, on the eager stack's TP head only."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from costmodel.collectives import all_reduce, group_of
    from costmodel.compute import layer_parts, loss_parallel_time
    from costmodel.loss import LOSS_PARALLEL_ALL_REDUCES
    from planner.resolve import resolve_workload

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        logits = distribute_tensor(torch.randn(64, 32, requires_grad=True), mesh, [Shard(1)])
        forward, backward = CommDebugMode(), CommDebugMode()
        with loss_parallel():
            with forward:
                loss = F.cross_entropy(logits, torch.randint(0, 32, (64,)))
            with backward:
                loss.backward()
    finally:
        dist.destroy_process_group()
    assert sum(forward.get_comm_counts().values()) == LOSS_PARALLEL_ALL_REDUCES
    assert sum(backward.get_comm_counts().values()) == 0

    workload = resolve_workload("llama-3-8b", seq_len=4096, dtype="bf16")
    head = next(layer for layer in workload.layers if layer.kind == "head")
    cluster = hardware.load("8xh100-sxm")
    group = group_of(8, 1, cluster)
    eager = Context(cluster=cluster, dtype="bf16", tp=8, sp=True, micro_batch=2, tp_group=group, seq_len=4096)
    reduces = loss_parallel_time(head, eager)
    assert reduces == pytest.approx(3 * all_reduce(2 * 4096 * 4, group, cluster))
    unknown_length = Context(**{**eager.__dict__, "seq_len": None})
    assert layer_parts(head, eager).plain.tp_comm == pytest.approx(layer_parts(head, unknown_length).plain.tp_comm + reduces)
    assert loss_parallel_time(head, Context(**{**eager.__dict__, "stack": "fused"})) == 0.0
    assert loss_parallel_time(head, Context(**{**eager.__dict__, "tp": 1})) == 0.0
