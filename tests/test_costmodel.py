"""Textbook cases the cost model must reproduce, and its invariants."""
import math

import pytest

import hardware
from costmodel import estimate
from layout.plan import Plan
from costmodel import collectives as coll
from costmodel.memory import activation_bytes, model_state_bytes
from layout.plan import StagePlan, uniform_stages
from hardware.errors import PlanError


@pytest.mark.parametrize("zero, expected_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_model_states(zero, expected_gb):
    # Rajbhandari et al. 2020, Fig. 1: 7.5B parameters, 64 GPUs, mixed-precision Adam (Megatron's split).
    total = sum(model_state_bytes(7.5e9, "bf16", zero, 64, "fused").values()) / 1e9
    assert total == pytest.approx(expected_gb, abs=0.05)


@pytest.mark.parametrize("zero, expected_gb, gathered_gb", [(0, 120, 0), (1, 60.94, 0), (2, 1.875, 15), (3, 1.875, 0)])
def test_autocast_model_states(zero, expected_gb, gathered_gb):
    """The executor's split of the same 16 bytes: fp32 weights (the master) and gradients, 8 bytes
    of AdamW moments; ZeRO-1 keeps the unsharded fp32 weights, so it holds more than Megatron's;
    FSDP2's ZeRO-2 shards them at rest and holds the gathered bf16 copy through the step."""
    from costmodel.memory import gathered_weight_bytes

    states = model_state_bytes(7.5e9, "bf16", zero, 64)
    assert sum(states.values()) / 1e9 == pytest.approx(expected_gb, abs=0.01)
    assert states["weights"] == (7.5e9 * 4 if zero < 2 else 7.5e9 * 4 / 64)
    assert gathered_weight_bytes(7.5e9, "bf16", zero, 64) / 1e9 == pytest.approx(gathered_gb)


def _block(workload):
    return next(layer for layer in workload.layers if layer.kind == "block")


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_korthikanti_activations_no_parallel_sequence(gpt_22b, tp):
    s, h, a = 2048, 6144, 64
    expected = s * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    assert activation_bytes(_block(gpt_22b), "none", tp=tp, sp=False, micro_batch=1) == pytest.approx(expected)


def test_korthikanti_activations_sequence_parallel_and_selective(gpt_22b):
    s, h, a, t = 2048, 6144, 64, 8
    block = _block(gpt_22b)
    assert activation_bytes(block, "none", tp=t, sp=True, micro_batch=1) == pytest.approx(s * h * (34 / t + 5 * a * s / (h * t)))
    assert activation_bytes(block, "selective", tp=t, sp=True, micro_batch=1) == pytest.approx(s * h * 34 / t)
    assert activation_bytes(block, "full", tp=1, sp=False, micro_batch=3) == pytest.approx(3 * 2 * s * h)


def _chunks_at_peak(schedule: str, rank: int, pp: int, vpp: int, m: int) -> float:
    """The most chunk activations a rank holds at once in the modelled order, per chunk."""
    from costmodel.simulate.schedule import held_at_peak, rank_order

    return held_at_peak(rank_order(schedule, rank, pp, m, vpp)) / vpp


@pytest.mark.parametrize("pp, vpp, m", [(2, 2, 2), (2, 2, 4), (4, 2, 8), (4, 3, 12), (4, 2, 16), (8, 2, 16)])
def test_the_orders_hold_what_the_papers_warm_ups_say(pp, vpp, m):
    """Each order's peak, per chunk, is its paper's warm-up count: GPipe every micro-batch,
    1F1B pp - rank (Narayanan et al. 2021), interleaved 1F1B 2*(pp-rank-1) + (vpp-1)*pp chunk
    forwards and its steady forward, ZB1P (vpp-1)*pp + (pp-rank-1) warm-up forwards and the rank + 1
    steps its weight gradients trail by, ZB-V min(2*pp, m + rank + 1, 2*m) chunks."""
    for rank in range(pp):
        assert _chunks_at_peak("gpipe", rank, pp, 1, m) == m
        assert _chunks_at_peak("1f1b", rank, pp, 1, m) == min(m, pp - rank)
        assert _chunks_at_peak("interleaved", rank, pp, vpp, m) == min(m * vpp, 2 * (pp - rank - 1) + (vpp - 1) * pp + 1) / vpp
        warmup = min(m * vpp, (vpp - 1) * pp + (pp - rank - 1))
        assert _chunks_at_peak("zero-bubble", rank, pp, vpp, m) == (warmup + min(m * vpp - warmup, rank + 1)) / vpp
        assert _chunks_at_peak("zbv", rank, pp, 2, m) == min(2 * pp, m + rank + 1, 2 * m) / 2
    if m > pp:  # more than 1F1B's first rank
        assert _chunks_at_peak("interleaved", 0, pp, vpp, m) > pp


@pytest.mark.parametrize("pp, vpp, m", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 4, 8), (4, 2, 12), (8, 2, 8)])
def test_zero_bubble_holds_each_chunk_from_its_forward_to_its_weight_gradients(pp, vpp, m):
    """A zero-bubble rank holds a chunk's activations until its weight gradients (W) run: the
    priced count is the most chunks forwarded and not yet through W in the schedule's order."""
    from costmodel.simulate.schedule import zero_bubble

    for rank in range(pp):
        live = peak = 0
        for op in zero_bubble(rank, pp, m, vpp):
            live += {"F": 1, "W": -1}.get(op.phase, 0)
            peak = max(peak, live)
        assert _chunks_at_peak("zero-bubble", rank, pp, vpp, m) == peak / vpp


@pytest.mark.parametrize("pp, vpp, m", [(2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 4, 8)])
def test_the_zero_bubble_order_is_torchs(pp, vpp, m):
    """costmodel.simulate.schedule.zero_bubble is torch's ScheduleInterleavedZeroBubble order,
    action for action (input-gradient backwards as "B", weight gradients as "W")."""
    import torch
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    from costmodel.simulate.schedule import zero_bubble

    class Stage:  # what the schedule's constructor reads of its stages
        def __init__(self, index):
            self.group_size, self.group_rank, self.stage_index = pp, index % pp, index
            self.num_stages, self.is_first, self.is_last = pp * vpp, index == 0, index == pp * vpp - 1
            self.submod = torch.nn.Linear(1, 1)

    names = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    for rank in range(pp):
        schedule = ScheduleInterleavedZeroBubble([Stage(rank + c * pp) for c in range(vpp)], m,
                                                 loss_fn=lambda out, target: out.sum())
        theirs = [(names[a.computation_type.name], a.microbatch_index, a.stage_index)
                  for a in schedule.pipeline_order[rank] if a is not None]
        assert theirs == [tuple(op) for op in zero_bubble(rank, pp, m, vpp)]


@pytest.mark.parametrize("schedule, rank, held", [
    ("interleaved", 3, [((4, 4), (1, 1)), ((5, 5), (0, 0))]), ("interleaved", 0, [((7, 7), (4, 4)), ((8, 8), (3, 3))]),
    ("zbv", 0, [((7, 7), (1, 1)), ((8, 8), (0, 0))]), ("zbv", 3, [((4, 4), (4, 4)), ((5, 5), (3, 3))]),
    ("zero-bubble", 3, [((4, 4), (4, 1)), ((5, 4), (3, 1)), ((5, 5), (3, 0)), ((6, 4), (2, 1)), ((6, 5), (2, 0)),
                        ((7, 4), (1, 1)), ((7, 5), (1, 0)), ((8, 5), (0, 0))]),
    ("1f1b", 3, [((1, 1),)]), ("gpipe", 3, [((8, 8),)])])
def test_a_ranks_peak_is_where_its_stages_weights_put_it(schedule, rank, held):
    """A rank's chunks hold unlike counts, and which moment is its peak depends on what each
    stage keeps (pp 4, two chunks a rank, eight micro-batches): an interleaved last rank holds
    (4, 1) micro-batches of its stages 3 and 7, or (5, 0) a step later; ZB-V's rank 0 (7, 1) or
    (8, 0) of its stages 0 and 7. Under a split backward the outputs (the head's logits) go at the
    input gradients, the activations at the weights'. With the stages alike, the peak is the
    order's most chunks held; with the head's stage ten times heavier, the moment holding more of
    it wins."""
    from costmodel.in_flight import fewest_in_flight, rank_holdings, saved_at_peak
    from costmodel.simulate.schedule import held_at_peak, rank_order

    pp, vpp, m = 4, 1 if schedule in ("1f1b", "gpipe") else 2, 8
    holdings = rank_holdings(schedule, rank, pp, vpp, m)
    assert [tuple((saved, outputs) for _, saved, outputs in h) for h in holdings] == held
    stages = [s for s, _, _ in holdings[0]]
    alike = saved_at_peak(holdings, dict.fromkeys(stages, 1.0), {})
    assert alike == held_at_peak(rank_order(schedule, rank, pp, m, vpp))
    heavy_last = {s: 10.0 if s == stages[-1] else 1.0 for s in stages}
    assert saved_at_peak(holdings, heavy_last, {}) == max(sum(heavy_last[s] * n for s, n, _ in h) for h in holdings)
    least, extra = fewest_in_flight(schedule, rank, pp, vpp, m)
    assert least == max(min(n for _, n, _ in h) for h in holdings)
    for first in range(1, 8):  # every split of 8 blocks between two stages holds at least the bound
        blocks = dict(zip(stages, (first, 8 - first))) if len(stages) == 2 else {stages[0]: 8}
        assert saved_at_peak(holdings, blocks, {}) >= least * 8 + extra


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 2), (2, 4), (3, 5), (4, 4), (4, 8), (4, 9), (8, 16)])
def test_the_zbv_order_is_torchs_and_its_peak_is_priced(pp, m):
    """costmodel.simulate.schedule.zbv is torch's ScheduleZBVZeroBubble order, action for action,
    each rank's two chunks placed in a V (stages r and 2*pp-1-r, as layout.axes.stage_rank places
    them); the priced activations in flight are the most chunks forwarded and not yet through W."""
    import torch
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    from costmodel.simulate.schedule import held_at_peak, zbv
    from layout.axes import stage_rank

    class Stage:  # what the schedule's constructor reads of its stages
        def __init__(self, index):
            self.group_size, self.group_rank, self.stage_index = pp, stage_rank("zbv", pp, index), index
            self.num_stages, self.is_first, self.is_last = 2 * pp, index == 0, index == 2 * pp - 1
            self.submod = torch.nn.Linear(1, 1)

    names = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    for rank in range(pp):
        stages = [s for s in range(2 * pp) if stage_rank("zbv", pp, s) == rank]
        assert stages == [rank, 2 * pp - 1 - rank]
        schedule = ScheduleZBVZeroBubble([Stage(s) for s in stages], m, loss_fn=lambda out, target: out.sum())
        theirs = [(names[a.computation_type.name], a.microbatch_index, a.stage_index)
                  for a in schedule.pipeline_order[rank] if a is not None]
        order = zbv(rank, pp, m)
        assert theirs == [tuple(op) for op in order]
        assert _chunks_at_peak("zbv", rank, pp, 2, m) == held_at_peak(order) / 2
    if m >= 2 * pp:  # every rank at 1F1B's first rank's peak: pp micro-batches of its layers
        assert [_chunks_at_peak("zbv", r, pp, 2, m) for r in range(pp)] == [pp] * pp


@pytest.fixture(scope="module")
def cluster16():
    return hardware.load("16xa100-80g")


def test_group_placement(cluster16):
    assert coll.group_of(8, 1, cluster16) == coll.Group(8, 8)  # TP inside a node
    assert coll.group_of(2, 8, cluster16) == coll.Group(2, 1)  # DP across nodes when tp fills a node
    assert coll.group_of(4, 2, cluster16) == coll.Group(4, 4)


def _plan(workload, cluster, **kw):
    defaults = dict(model=workload.name, hardware=cluster.spec(), global_batch=32, seq_len=workload.seq_len, dp=1, tp=1, pp=1,
                    micro_batch=1, schedule="1f1b", vpp=1)
    defaults.update(kw)
    policy = defaults.pop("recompute", "none")
    stages = uniform_stages([l.kind for l in workload.layers], defaults["pp"] * defaults["vpp"], policy)
    return Plan(stages=stages, **defaults)


def test_plan_round_trips_through_json(llama_70b):
    cluster = hardware.load("64xh100-sxm")
    plan = _plan(llama_70b, cluster, dp=2, tp=8, pp=4, sp=True, recompute="selective", global_batch=64)
    plan = plan.model_copy(update={"estimate": estimate(llama_70b, plan, cluster)})
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert estimate(llama_70b, again, cluster).step_time_s == pytest.approx(plan.estimate.step_time_s)


def test_step_time_parts_add_up(llama_70b):
    cluster = hardware.load("64xh100-sxm")
    est = estimate(llama_70b, _plan(llama_70b, cluster, dp=2, tp=8, pp=4, recompute="full", global_batch=64), cluster)
    assert sum(est.breakdown_s.values()) == pytest.approx(est.step_time_s)
    assert all(v >= 0 for v in est.breakdown_s.values())
    assert 0 < est.mfu < 1


def test_pipeline_bubble_is_textbook_for_uniform_blocks():
    """Compute-only uniform stages: bubble / (m * T) = (p-1)/(v*m)."""
    from costmodel import TransformerDims, transformer_workload

    # a 2-token vocabulary makes the embedding and head negligible next to the blocks
    blocks_only = transformer_workload(TransformerDims(n_layers=24, hidden=2048, heads=16, vocab=2, seq_len=2048))
    cluster = hardware.load("8xh100-sxm", nic_gbps=1e6, intra_gbps=1e6)
    for vpp, m in ((1, 8), (2, 8), (3, 12)):
        plan = _plan(blocks_only, cluster, pp=4, dp=2, global_batch=2 * m, schedule="interleaved" if vpp > 1 else "1f1b", vpp=vpp)
        est = estimate(blocks_only, plan, cluster)
        work = est.step_time_s - est.breakdown_s["bubble"] - est.breakdown_s["dp_comm"] - est.breakdown_s["optimizer"]
        assert est.breakdown_s["bubble"] / work == pytest.approx((4 - 1) / (vpp * m), rel=0.03)


def test_ranks_sharing_cores_refill_the_pipeline_bubble():
    """CPU ranks time-sliced on shared cores (Node.oversubscription): ranks idle in the bubble
    hand their cores to the busy ones, so the step lies between the all-busy closed form and
    the throughput bound m * T; with a share of exactly 1 the played schedule is the closed form."""
    from costmodel import TransformerDims, transformer_workload
    from costmodel.terms import price_ranks
    from costmodel.shared_cores import shared_core_pipeline_time

    blocks_only = transformer_workload(TransformerDims(n_layers=24, hidden=2048, heads=16, vocab=2, seq_len=2048))
    base = hardware.load("8xh100-sxm", nic_gbps=1e6, intra_gbps=1e6)
    assert base.node.oversubscription is None

    def shared(over):
        node = base.node.model_copy(update={"oversubscription": over,
                                            "sources": base.node.sources | {"oversubscription": "test"}})
        return base.model_copy(update={"node": node})

    m = 8
    plan = _plan(blocks_only, base, pp=4, dp=2, global_batch=2 * m)
    closed = estimate(blocks_only, plan, base)
    _, ranks = price_ranks(blocks_only, plan, base)
    T = ranks[0].per_micro_batch
    assert shared_core_pipeline_time(ranks, plan, shared(1 + 1e-12)) == pytest.approx((m + 3) * T, rel=0.01)
    fast = estimate(blocks_only, plan, shared(2.0))
    assert m * T < fast.step_time_s - fast.breakdown_s["dp_comm"] - fast.breakdown_s["optimizer"] < (m + 3) * T
    assert fast.step_time_s < closed.step_time_s
    flat = _plan(blocks_only, base, dp=8, global_batch=16)  # no pipeline: every rank always busy
    assert estimate(blocks_only, flat, shared(2.0)).step_time_s == estimate(blocks_only, flat, base).step_time_s


def test_more_nic_bandwidth_never_slows_a_step(llama_70b):
    plan_kw = dict(dp=4, tp=8, pp=2, global_batch=64, recompute="selective")
    times = []
    for gbps in (50, 100, 200, 400, 800):
        cluster = hardware.load("64xh100-sxm", nic_gbps=gbps)
        times.append(estimate(llama_70b, _plan(llama_70b, cluster, **plan_kw), cluster).step_time_s)
    assert times == sorted(times, reverse=True)


def test_full_recompute_trades_time_for_memory(gpt_22b):
    cluster = hardware.load("8xa100-80g")
    none = estimate(gpt_22b, _plan(gpt_22b, cluster, tp=8, global_batch=4, micro_batch=4), cluster)
    full = estimate(gpt_22b, _plan(gpt_22b, cluster, tp=8, global_batch=4, micro_batch=4, recompute="full"), cluster)
    assert full.step_time_s > none.step_time_s
    assert full.peak_memory_bytes < none.peak_memory_bytes
    assert full.tflops_per_gpu_hw > full.tflops_per_gpu_model


def test_hand_written_plan_with_uneven_stages(llama_70b):
    cluster = hardware.load("8xh100-sxm")
    n = llama_70b.n_layers
    stages = [StagePlan(start=0, end=30, recompute=["full"] * 30), StagePlan(start=30, end=n, recompute=["none"] * (n - 30))]
    plan = Plan(model="x", hardware="8xh100-sxm", global_batch=8, seq_len=4096, dp=1, tp=4, pp=2, micro_batch=1, stages=stages)
    est = estimate(llama_70b, plan, cluster)
    assert est.stages[0].forward_s < est.stages[1].forward_s


def test_plan_that_does_not_cover_the_model_is_refused(llama_70b):
    cluster = hardware.load("8xh100-sxm")
    stages = [StagePlan(start=0, end=10, recompute=["none"] * 10)]
    plan = Plan(model="x", hardware="8xh100-sxm", global_batch=8, seq_len=4096, dp=1, tp=8, pp=1, micro_batch=1, stages=stages)
    with pytest.raises(PlanError, match="stages"):
        estimate(llama_70b, plan, cluster)
    bad_tp = _plan(llama_70b, hardware.load("6xcpu") if False else cluster, tp=8, dp=1).model_copy(update={"tp": 3, "dp": 1})
    with pytest.raises(PlanError):
        estimate(llama_70b, bad_tp, cluster)


@pytest.mark.parametrize("field, value", [("global_batch", 7), ("vpp", 2)])
def test_inconsistent_plan_json_is_refused(llama_70b, field, value):
    cluster = hardware.load("8xh100-sxm")
    data = _plan(llama_70b, cluster, tp=8, global_batch=8, micro_batch=2).model_dump()
    data[field] = value
    with pytest.raises(Exception):
        Plan.model_validate(data)


def test_cost_is_priced_in_dollars(llama_70b):
    cluster = hardware.load("64xh100-sxm")
    est = estimate(llama_70b, _plan(llama_70b, cluster, dp=8, tp=8, global_batch=64, recompute="full"), cluster)
    assert est.usd_per_hour == pytest.approx(64 * cluster.price_per_gpu_hour)
    tokens = 64 * 4096
    assert est.usd_per_million_tokens == pytest.approx(est.usd_per_hour / 3600 * est.step_time_s / tokens * 1e6)
    assert math.isfinite(est.usd_per_million_tokens)


def _host(cluster, gbps=1.0):
    """`cluster` with a host allocator that maps tensors of 32 MiB and more fresh at `gbps`."""
    gpu = cluster.gpu.model_copy(update={"fresh_page_gbps": gbps, "fresh_page_min_bytes": 32 * 2 ** 20})
    return cluster.model_copy(update={"gpu": gpu})


def test_fresh_pages_cost_only_tensors_the_host_allocator_maps_again():
    from costmodel.compute import fresh_page_time
    cpu = hardware.load("4xcpu")
    assert fresh_page_time(1e9, 1, cpu) == 0.0  # no figure: a caching allocator
    host = _host(cpu)
    assert fresh_page_time(1e9, 2, host) == pytest.approx(2.0)
    assert fresh_page_time(16 * 2 ** 20, 1, host) == 0.0  # under the mmap threshold: reused heap


def test_fresh_pages_slow_the_embedding_backward_and_fsdp_gathers_on_a_host():
    """gpt2's [50257, 768] table gradient and a ZeRO-3 unit above the threshold are mapped
    again every micro-batch on a host; a GPU profile's estimate does not change."""
    from planner.resolve import resolve_workload
    workload = resolve_workload("gpt2", seq_len=128, dtype="fp32")
    embedding = workload.layers[0]
    assert embedding.largest_weight == 50257 * 768
    assert workload.layers[-1].largest_weight == 50257 * 768  # the tied head's gradient copy
    import planner
    cpu = hardware.load("4xcpu")
    plan = planner.plan("gpt2", cpu, global_batch=8, seq_len=128, dtype="fp32", fixed=dict(dp=4, zero=3), top_k=1)
    plain = estimate(workload, plan, cpu)
    slow = estimate(workload, plan, _host(cpu, gbps=0.5))
    # the table's two fresh gradients (head, embedding) per micro-batch, the embedding unit's
    # two gathers of two buffers each and its reduce-scatter's one, at 0.5 GB/s
    table = 50257 * 768 * 4
    expected = (2 + 5) * table / 0.5e9 * plan.num_micro_batches
    assert slow.step_time_s - plain.step_time_s == pytest.approx(expected, rel=0.25)


def test_optimizer_step_is_a_memory_moment_torchs_adamw_sets():
    """torch's AdamW makes sqrt(v) and its quotient per tensor on cpu (twice the largest
    weight) and sqrt(v) for every owned weight at once on cuda (foreach); the fused stack's
    multi-tensor Adam makes none."""
    from costmodel.memory import optimizer_step_bytes
    assert optimizer_step_bytes(1e6, 5e5, "cpu") == 2 * 4 * 5e5
    assert optimizer_step_bytes(1e6, 5e5, "cuda") == 4 * 1e6
    assert optimizer_step_bytes(1e6, 5e5, "cuda", stack="fused") == 0.0


def test_a_cpu_pipeline_stage_holding_the_tied_head_peaks_in_its_optimizer_step():
    import planner
    cpu = hardware.load("4xcpu")
    plan = planner.plan("gpt2", cpu, global_batch=8, seq_len=128, dtype="fp32",
                        fixed=dict(pp=4, dp=1, tp=1, schedule="1f1b", micro_batch=1), top_k=1)
    last = plan.estimate.stages[-1].memory_bytes
    states = last["weights"] + last["gradients"] + last["optimizer"]
    # the head's copy of the table, twice, and the stage's 8 input buffers, one per micro-batch (torch's PipelineStage)
    held = 2 * 4 * 50257 * 768 + 8 * 128 * 768 * 4
    assert last["activations"] == pytest.approx(held)
    assert sum(last.values()) == pytest.approx(states + held)


def test_tp_splits_the_weights_gemm_dimension_never_the_tokens():
    """A short micro-batch's tokens set a GEMM's size; TP shrinks only the weights' side."""
    from costmodel.compute import Context, gemm_efficiency, forward_parts
    from costmodel.transformer import TransformerDims, transformer_workload
    cpu = hardware.load("4xcpu")
    block = transformer_workload(TransformerDims(name="t", n_layers=1, hidden=768, heads=12, vocab=1000,
                                                 seq_len=64, ffn_hidden=3072)).layers[1]
    kw = dict(cluster=cpu, dtype="fp32", sp=False, tp_group=coll.Group(1, 1))
    one = Context(tp=1, micro_batch=1, seq_len=64, **kw)
    four = Context(tp=4, micro_batch=1, seq_len=64, **kw)
    g1, g4 = forward_parts(block, one)[0], forward_parts(block, four)[0]
    # both GEMMs are 64 tokens wide (768/4 = 192 > 64): a quarter of the FLOPs at the same efficiency
    assert g4 == pytest.approx(g1 / 4)
    unknown = Context(tp=1, micro_batch=1, **kw)
    assert forward_parts(block, unknown)[0] < g1  # 768 wide when the tokens are not known
    assert gemm_efficiency(one, 64) < gemm_efficiency(one, 768)


@pytest.mark.parametrize("schedule, vpps", [("1f1b", [1]), ("interleaved", [2, 3]), ("zero-bubble", [1, 2, 3]),
                                            ("zbv", [2])])
def test_a_long_step_holds_no_moment_its_first_rounds_do_not(schedule, vpps):
    """`rank_holdings` reads a step of many micro-batches off an order of three rounds
    (`moment_micro_batches`): the whole order's moments, Pareto-reduced by hand, are the same."""
    from costmodel.in_flight import moment_micro_batches, rank_holdings
    from costmodel.simulate.schedule import forward_moments, rank_order
    from layout.axes import stage_rank

    for pp in (2, 3, 4):
        for vpp in vpps:
            for m in range(1, 12 * pp + 2):
                if schedule == "interleaved" and m % pp:
                    continue
                for rank in range(pp):
                    stages = [s for s in range(pp * vpp) if stage_rank(schedule, pp, s) == rank]
                    moments = {tuple((s, flat[2 * i], flat[2 * i + 1]) for i, s in enumerate(stages))
                               for flat in forward_moments(rank_order(schedule, rank, pp, m, vpp), stages)}
                    top = {h for h in moments if not any(g != h and all(a[1] >= b[1] and a[2] >= b[2]
                                                                         for a, b in zip(g, h)) for g in moments)}
                    assert set(rank_holdings(schedule, rank, pp, vpp, m)) == top, (pp, vpp, m, rank)
    assert moment_micro_batches(schedule, 4, 2, 100) == 12


def test_the_bounds_fewest_in_flight_is_the_orders_from_two_rounds_on():
    """`fewest_in_flight` answers a step of 2*pp micro-batches or more in closed form: it is what
    the orders' moments give (the most held of a rank's least-held stage, and the rest of that
    moment's micro-batches), for every rank, schedule and depth."""
    from costmodel.in_flight import _long_step_least, least_held_moment, rank_holdings

    for schedule, vpps in (("gpipe", [1]), ("1f1b", [1]), ("interleaved", [2, 3]), ("zero-bubble", [1, 2, 3]),
                           ("zbv", [2])):
        for vpp in vpps:
            for pp in range(1, 7):
                for m in range(2 * pp, 4 * pp + 2):
                    if schedule == "interleaved" and m % pp:
                        continue
                    for rank in range(pp):
                        holding = least_held_moment(rank_holdings(schedule, rank, pp, vpp, m))
                        least = min(n for _, n, _ in holding)
                        order = (least, sum(n for _, n, _ in holding) - least * len(holding))
                        assert _long_step_least(schedule, rank, pp, vpp, m) == order, (schedule, vpp, pp, m, rank)


@pytest.mark.parametrize("stack", ["eager", "fused"])
def test_a_pipeline_stage_holds_a_receive_buffer_per_micro_batch(stack):
    """torch 2.13's PipelineStage keeps an input buffer per micro-batch on every stage but the first
    and an output-gradient buffer on every stage but the last; Megatron's (the fused stack's)
    receives are each dropped once used. Eight more micro-batches add eight of each."""
    from layout.layout import Layout
    from planner.search.space import to_plan
    from planner.trace.workload_for import workload_for

    workload, _ = workload_for("llama-160m", seq_len=512)
    cluster = hardware.load("8xh100-sxm")
    layout = Layout(dp=1, tp=2, sp=True, pp=4, schedule="1f1b", zero=1, micro_batch=1, stack=stack)

    def peaks(batch: int) -> list[float]:
        plan = to_plan(layout, workload, cluster, global_batch=batch, dtype="bf16", recompute="none",
                       model="llama-160m")
        return [sum(s.memory_bytes.values()) for s in estimate(workload, plan, cluster).stages]

    grown = [b - a for a, b in zip(peaks(16), peaks(24))]
    buffer = 512 * 768 * 4 / 2  # one sequence's hidden states, fp32 under autocast, split over TP by SP
    expected = [8 * buffer, 16 * buffer, 16 * buffer, 8 * buffer] if stack == "eager" else [0.0] * 4
    assert grown == pytest.approx(expected, abs=1.0)
