"""The precision policy and the gradient accumulation policy: refused by name where no stack runs
them, priced by what they hold and send, and held to the dry run on fake tensors (the executor's
runs against a single-process reference are in test_executor.py)."""
from __future__ import annotations

import warnings

import pytest

import hardware
from costmodel.estimate import estimate
from costmodel.memory import plan_state_bytes, reduce_bytes
from executor.measure.dry_run import dry_run
from hardware.errors import InfeasibleError, PlanError
from layout.layout import Layout
from layout.plan import Plan
from planner import plan as make_plan
from planner.search.space import to_plan
from planner.trace.workload_for import workload_for

from conftest import NEVER_S


@pytest.fixture(scope="module")
def llama():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        workload, _ = workload_for("llama-3-8b", seq_len=4096, dtype="bf16")
    return workload, hardware.load("8xh100-sxm")


def _plan(llama, recompute="full", dtype="bf16", **axes) -> Plan:
    workload, cluster = llama
    return to_plan(Layout(**axes), workload, cluster, global_batch=16, dtype=dtype, recompute=recompute,
                   model="llama-3-8b")


@pytest.mark.parametrize("pins, field", [
    ({"dtype": "fp32", "master_dtype": "bf16", "optimizer_dtype": "bf16"}, "master_dtype"),
    ({"master_dtype": "bf16"}, "optimizer_dtype"),  # torch's AdamW keeps its moments in the weights' dtype
    ({"dtype": "fp16", "master_dtype": "bf16", "optimizer_dtype": "bf16"}, "master_dtype"),
    ({"reduce_dtype": "fp16"}, "reduce_dtype"),  # a 16-bit reduction is the compute's own type
    ({"zero": 0, "reduce_dtype": "bf16"}, "reduce_dtype"),  # DDP reduces in the weights' dtype
    ({"zero": 1, "accumulation": "hold_unsharded"}, "accumulation"),
    ({"zero": 3, "pp": 2, "accumulation": "hold_unsharded"}, "accumulation"),
    ({"zero": 3, "ddp_bucket_view": False}, "ddp_bucket_view"),  # only DDP has buckets
    ({"tp": 2, "ddp_bucket_view": False}, "ddp_bucket_view"),
])
def test_a_recipe_no_stack_runs_is_refused_by_name(pins, field):
    dtype = pins.pop("dtype", "bf16")
    with pytest.raises(PlanError) as refused:
        make_plan("llama-3-8b", "8xh100-sxm", global_batch=16, seq_len=4096, dtype=dtype, fixed=pins)
    assert refused.value.field == field
    with pytest.raises(ValueError, match=field):  # and a plan file stating it
        Plan(model="gpt2", hardware="8xh100-sxm", global_batch=8, seq_len=64, dtype=dtype, dp=8,
             stages=[{"start": 0, "end": 3, "recompute": ["none"] * 3}], **{"zero": 3, **pins})


def test_megatrons_optimizer_keeps_moments_apart_from_the_weights(llama):
    """The fused stack prices fp32 master weights beside bf16 moments (Megatron's precision-aware
    optimizer): 2 + 2 + 4 + 2*2 bytes per parameter, against 2 + 2 + 12."""
    fused = _plan(llama, dp=8, zero=1, stack="fused")
    assert plan_state_bytes(fused) == (2, 2, 12)
    assert plan_state_bytes(fused.with_overrides(optimizer_dtype="bf16")) == (2, 2, 8)


def test_bf16_states_halve_the_states_and_the_wire(llama):
    fp32 = _plan(llama, dp=8, zero=3)
    bf16 = fp32.with_overrides(master_dtype="bf16", optimizer_dtype="bf16")
    assert sum(plan_state_bytes(fp32)) == 16 and sum(plan_state_bytes(bf16)) == 8
    states = ("weights", "gradients", "optimizer")
    a, b = (estimate(llama[0], p, llama[1]).stages[0].memory_bytes for p in (fp32, bf16))
    assert sum(b[k] for k in states) == pytest.approx(sum(a[k] for k in states) / 2)
    ddp = fp32.with_overrides(zero=0)
    assert reduce_bytes(ddp) == 4 and reduce_bytes(ddp.with_overrides(master_dtype="bf16", optimizer_dtype="bf16")) == 2
    assert reduce_bytes(fp32) == 4 and reduce_bytes(fp32.with_overrides(reduce_dtype="bf16")) == 2


def test_holding_gradients_trades_their_memory_for_fewer_reduce_scatters(llama):
    each = _plan(llama, dp=8, zero=3, micro_batch=1)  # two micro-batches per step
    hold = each.with_overrides(accumulation="hold_unsharded")
    workload, cluster = llama
    a, b = estimate(workload, each, cluster), estimate(workload, hold, cluster)
    params = sum(layer.params for layer in workload.layers)
    held = b.stages[0].memory_bytes["buffers"] - a.stages[0].memory_bytes["buffers"]
    assert held == pytest.approx(params * reduce_bytes(hold), rel=0.02)  # the whole model's unsharded, in fp32
    assert b.breakdown_s["zero_comm"] <= a.breakdown_s["zero_comm"]


def test_a_pinned_bf16_recipe_fits_where_fp32_states_do_not():
    """An 8B model on one H200: 16 bytes per parameter leave no room at 8K tokens, 8 do."""
    pins = {"recompute": "full", "micro_batch": 1}
    with pytest.raises(InfeasibleError):
        make_plan("llama-3-8b", "1xh200", global_batch=8, seq_len=8192, fixed={**pins, "offload": False},
                  time_limit_s=NEVER_S)
    ok = make_plan("llama-3-8b", "1xh200", global_batch=8, seq_len=8192,
                   fixed={**pins, "master_dtype": "bf16", "optimizer_dtype": "bf16", "offload": False})
    assert ok.master_dtype == "bf16" and ok.estimate.peak_memory_bytes <= ok.estimate.memory_capacity_bytes


def test_the_search_bounds_a_layouts_states_at_its_recipes_bytes(llama):
    """The search drops a layout whose states cannot fit before pricing it; it reads the recipe's
    bytes per parameter. llama-3-8b with bf16 states on one H100 fits unoffloaded (8 bytes a
    parameter); bounded at fp32's 16, that layout was dropped and the pick was offloaded, 1.5
    times slower. Offloaded, the host holds the recipe's bytes and steps AdamW over them."""
    pins = {"master_dtype": "bf16", "optimizer_dtype": "bf16"}
    pick = make_plan("llama-3-8b", "1xh100-sxm", global_batch=8, seq_len=2048, fixed=pins)
    assert not pick.offload and pick.master_dtype == "bf16"
    offloaded = _plan(llama, dp=8, zero=3, offload=True, micro_batch=1)
    fp32, bf16 = (estimate(llama[0], p, llama[1]) for p in (offloaded, offloaded.with_overrides(**pins)))
    assert bf16.host_memory_bytes == pytest.approx(fp32.host_memory_bytes / 2)
    assert bf16.breakdown_s["optimizer"] == pytest.approx(fp32.breakdown_s["optimizer"] / 2, rel=0.05)


def test_held_gradients_and_bf16_states_match_the_dry_run():
    """FSDP2 holding its unsharded gradients (in fp32, the reduce dtype) beside bf16 weights and
    moments, over TP with SP, on llama-3.2-1b (its head tied to the embedding, one weight however
    TP splits it): the peak and each category as the executor's appliers hold them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small = workload_for("llama-3.2-1b", seq_len=4096, dtype="bf16")[0], hardware.load("8xh100-sxm")
    plan = _plan(small, dp=4, tp=2, sp=True, zero=3, micro_batch=1, master_dtype="bf16", optimizer_dtype="bf16",
                 accumulation="hold_unsharded").model_copy(update={"model": "llama-3.2-1b"})
    (rank,) = dry_run(plan).ranks
    assert abs(rank.error) <= 0.05, (rank.measured_peak, rank.predicted_peak)
    for name, measured in rank.at_peak.items():
        assert abs(rank.predicted.get(name, 0.0) - measured) <= max(0.10 * measured, 0.01 * rank.measured_peak), name
    assert rank.at_peak["buffers"] > rank.at_peak["weights"] + rank.at_peak["optimizer"]  # the held copy dominates


@pytest.mark.parametrize("zero, accumulation, kept_in", [(2, "hold_unsharded", "buffers"), (1, "reduce_each", "gradients")])
def test_an_untied_tables_gradient_is_kept_whole_under_tp(zero, accumulation, kept_in):
    """Over TP4 with SP, on llama-160m (an untied head), DTensor's embedding backward makes the
    whole table's gradient, and it is kept as made, the whole table in fp32 on every TP rank
    (`held_gradient_shards`): by FSDP2 holding its unsharded gradients, and by `.grad` under
    ZeRO-1. Priced as its shard, these read -15.7% and -15.2% at 256 tokens; at 128 tokens they
    read +0.01% and -0.07%, ZeRO-1's with the embedding's whole new gradient beside autocast's
    pile (`cast_back_bytes`; -5.9% without it); the category holding it is exact."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small = workload_for("llama-160m", seq_len=128, dtype="bf16")[0], hardware.load("8xh100-sxm")
    plan = _plan(small, recompute="none", dp=2, tp=4, sp=True, zero=zero, micro_batch=1, accumulation=accumulation)
    (rank,) = dry_run(plan.model_copy(update={"model": "llama-160m"})).ranks
    assert abs(rank.error) <= 0.01, (rank.measured_peak, rank.predicted_peak)
    table = 32000 * 768 * 4  # the whole table's fp32 gradient
    assert rank.at_peak[kept_in] >= table
    assert rank.predicted[kept_in] == pytest.approx(rank.at_peak[kept_in], rel=0.02)


def test_a_checkpoint_holds_the_recipes_weights_and_moments(llama):
    """What the Young/Daly interval writes: 12 bytes per parameter with fp32 weights and moments
    (the executor's DCP checkpoint), 6 in bf16, 14 for Megatron's 16-bit weights beside fp32 state."""
    from costmodel.goodput import plan_checkpoint_bytes

    eager = _plan(llama, dp=8, zero=3)
    assert plan_checkpoint_bytes(eager) == 12
    assert plan_checkpoint_bytes(eager.with_overrides(master_dtype="bf16", optimizer_dtype="bf16")) == 6
    assert plan_checkpoint_bytes(eager.with_overrides(stack="fused", zero=1)) == 14
    assert plan_checkpoint_bytes(eager.with_overrides(stack="fused", zero=1, dtype="fp8")) == 14


def test_autocast_prices_casting_its_weights_back_and_accumulation_prices_each_added_micro_batch(llama):
    """Autocast over fp32 weights runs a ToCopyBackward0 per cast weight every backward, and each
    micro-batch after the first adds its gradient into `.grad`: both memory-bound, both priced."""
    from costmodel.compute import cast_back_time, memory_bandwidth
    from costmodel.accumulation import accumulation_bytes_per_param
    from costmodel.layout import layout_of

    workload, cluster = llama
    block = next(layer for layer in workload.layers if layer.kind == "block")
    zero1 = _plan(llama, dp=8, zero=1, micro_batch=1)  # two micro-batches, autocast over fp32 weights
    seconds = cast_back_time(block, layout_of(zero1, cluster, workload).ctx)
    assert seconds == pytest.approx(block.params * (2 + 4) / memory_bandwidth(cluster.gpu))
    gathered = zero1.with_overrides(zero=3)  # FSDP2 gathers bf16 weights: no autocast cast
    bf16 = zero1.with_overrides(master_dtype="bf16", optimizer_dtype="bf16")
    for plan in (gathered, bf16):
        assert cast_back_time(block, layout_of(plan, cluster, workload).ctx) == 0.0
    assert accumulation_bytes_per_param(zero1) == 3 * 4  # one added micro-batch, fp32 gradients whole
    assert accumulation_bytes_per_param(gathered) == pytest.approx(3 * 4 / 8)  # FSDP2 adds its shard
    assert accumulation_bytes_per_param(zero1.with_overrides(micro_batch=2)) == 0.0  # one micro-batch
    assert accumulation_bytes_per_param(zero1.with_overrides(stack="fused")) == 0.0  # inside Megatron's GEMM
    # each of the two micro-batches carries half the step's first cast and of its one accumulation
    ctx = layout_of(zero1, cluster, workload).ctx
    assert ctx.first_cast_seconds == pytest.approx((4 + 2) / 2 / memory_bandwidth(cluster.gpu))
    assert ctx.accumulation_seconds == pytest.approx(3 * 4 / 2 / memory_bandwidth(cluster.gpu))
    assert layout_of(bf16, cluster, workload).ctx.first_cast_seconds == 0.0


@pytest.mark.parametrize("micro_batch", [2, 1])  # one micro-batch a step, then two accumulated into .grad
def test_ddps_bucket_copies_hold_a_second_gradient_copied_twice_a_step(llama, micro_batch):
    """torch DDP's default (gradient_as_bucket_view False): its buckets beside the gradients. At
    the optimizer step both are there; at the activation peak the buckets alone, unless
    micro-batches accumulate into .grad. Each step copies every gradient in and back (four more
    passes of its bytes). The solver's coefficients price it as the estimator does."""
    from costmodel.compute import memory_bandwidth
    from costmodel.terms import usable_memory_bytes
    from planner.search.coefficients import block_span, stage_model_data
    from planner.search.linear_model import linear_step

    workload, cluster = llama
    views = _plan(llama, dp=8, micro_batch=micro_batch)
    copies = views.with_overrides(ddp_bucket_view=False)
    assert copies.copies_into_buckets and "bucket-copies" in copies.layout_tag
    params = sum(layer.params for layer in workload.layers)
    a, b = (estimate(workload, p, cluster) for p in (views, copies))
    held = b.stages[0].memory_bytes["gradients"] - a.stages[0].memory_bytes["gradients"]
    assert held == pytest.approx(params * 4)  # fp32 copies, at the step (an 8B's peak over DDP)
    passes = b.breakdown_s["optimizer"] - a.breakdown_s["optimizer"]
    assert passes == pytest.approx(4 * 4 * params / memory_bandwidth(cluster.for_stack(copies.stack).gpu), rel=1e-6)
    capacity = usable_memory_bytes(cluster, 0.1, copies, workload)
    first, last = block_span(workload)
    counts = [{"full": min(s.end, last) - max(s.start, first)} for s in copies.stages]
    step, headroom = linear_step(stage_model_data(workload, copies, cluster, capacity), counts, 1, 1,
                                 copies.num_micro_batches)
    assert capacity - headroom == pytest.approx(b.peak_reserved_bytes, rel=1e-6)
    assert step == pytest.approx(b.step_time_s, rel=1e-4)
