"""The step simulator: textbook schedules, overlap accounting, traces, and agreement with `estimate`."""
from __future__ import annotations

import json

import pytest

import hardware
from costmodel import TransformerDims, estimate, transformer_workload
from layout.plan import Plan, StagePlan
from layout.plan import uniform_stages
from costmodel.simulate.step import simulate
from costmodel.simulate.trace_export import chrome_trace, write_chrome_trace
from costmodel.workload import LayerProfile, Segment, Workload
from hardware.errors import PlanError

LLAMA70 = TransformerDims(n_layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=128256,
                          seq_len=4096, gated_mlp=True, dropout=False, biases=False, learned_positions=False)
GPT3 = TransformerDims(n_layers=96, hidden=12288, heads=96, vocab=50257, seq_len=2048)


@pytest.fixture(scope="module")
def llama():
    return transformer_workload(LLAMA70)


def synthetic(n_layers: int) -> Workload:
    """Identical blocks with no communication at all: only the schedule shapes the step."""
    block = LayerProfile(name="blk", kind="block", params=1_000_000, matmul_flops=1e13, matmul_min_dim=8192,
                         act_tp_sharded=1e6, act_input=1e5)
    return Workload(name="synthetic", seq_len=1024, segments=[Segment(layer=block, count=n_layers)])


def plan_for(workload, hw, *, dp=1, tp=1, pp=1, m=8, schedule="1f1b", vpp=1, policy="none", zero=0, mb=1, sp=False, stages=None):
    kinds = [layer.kind for layer in workload.layers]
    return Plan(model=workload.name, hardware=hw.spec(), global_batch=m * dp * mb, seq_len=workload.seq_len,
                dp=dp, tp=tp, pp=pp, micro_batch=mb, schedule=schedule, vpp=vpp, zero=zero, sp=sp,
                stages=stages or uniform_stages(kinds, pp * vpp, policy))


# --- schedules ----------------------------------------------------------------

@pytest.mark.parametrize("schedule, pp, m, vpp", [
    ("1f1b", 4, 8, 1), ("1f1b", 4, 16, 1), ("1f1b", 8, 8, 1), ("gpipe", 4, 8, 1),
    ("interleaved", 4, 8, 2), ("interleaved", 4, 16, 3), ("interleaved", 2, 4, 4),
])
def test_textbook_bubble(schedule, pp, m, vpp):
    hw = hardware.load(f"{pp}xh100-sxm")
    w = synthetic(pp * vpp * 3)
    sim = simulate(w, plan_for(w, hw, pp=pp, m=m, schedule=schedule, vpp=vpp), hw)
    assert sim.bubble_fraction == pytest.approx((pp - 1) / (vpp * m), rel=1e-9)
    assert all(rank.exposed_comm_s["pp"] == 0 and rank.exposed_comm_s["dp"] == 0 for rank in sim.ranks)


def test_schedule_orders_respect_dependencies():
    hw = hardware.load("4xh100-sxm")
    w = synthetic(24)
    sim = simulate(w, plan_for(w, hw, pp=4, m=8, schedule="interleaved", vpp=2), hw)
    times = {e.name: (e.start, e.start + e.duration) for e in sim.events if e.stream == "compute"}
    for j in range(8):
        for s in range(1, 8):
            assert times[f"F{j} s{s}"][0] >= times[f"F{j} s{s - 1}"][1]
            assert times[f"B{j} s{s - 1}"][0] >= times[f"B{j} s{s}"][1]


def test_interleaved_needs_whole_groups():
    hw = hardware.load("4xh100-sxm")
    w = synthetic(16)
    with pytest.raises(PlanError):
        simulate(w, plan_for(w, hw, pp=4, m=6, schedule="interleaved", vpp=2), hw)


# --- non-uniform stages and checkpointing ---------------------------------------

def _stages(bounds, policies=None):
    return [StagePlan(start=a, end=b, recompute=(policies or {}).get(i, ["none"] * (b - a)))
            for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def test_slowest_stage_sets_the_pace():
    hw = hardware.load("4xh100-sxm")
    w = synthetic(12)
    bounds = [0, 2, 4, 10, 12]  # stage 2 holds 6 of 12 layers
    # the fused stack spreads no once-a-step work (autocast's first cast, adding into .grad) over the
    # micro-batches, so a micro-batch costs the same at 8 and 16 of them
    steps = {m: simulate(w, plan_for(w, hw, pp=4, m=m, stages=_stages(bounds)).with_overrides(stack="fused"), hw)
             for m in (8, 16)}
    slow = steps[8].ranks[2]
    per_micro_batch = slow.busy_s / 8
    assert steps[16].pipeline_s - steps[8].pipeline_s == pytest.approx(8 * per_micro_batch, rel=1e-9)
    uniform = simulate(w, plan_for(w, hw, pp=4, m=8).with_overrides(stack="fused"), hw)
    assert steps[8].step_time_s > uniform.step_time_s
    assert steps[8].bubble_fraction == pytest.approx(steps[8].pipeline_s / slow.busy_s - 1)


def test_per_layer_checkpointing_trades_time_for_memory():
    hw = hardware.load("4xh100-sxm")
    w = synthetic(12)
    plain = simulate(w, plan_for(w, hw, pp=4, m=8), hw)
    mixed = _stages([0, 3, 6, 9, 12], {0: ["full", "full", "none"]})
    ckpt = simulate(w, plan_for(w, hw, pp=4, m=8, stages=mixed), hw)
    assert ckpt.ranks[0].recompute_s > 0 and ckpt.ranks[1].recompute_s == 0
    assert ckpt.ranks[0].busy_s > plain.ranks[0].busy_s
    assert ckpt.ranks[0].peak_memory_bytes < plain.ranks[0].peak_memory_bytes
    assert ckpt.ranks[1].peak_memory_bytes == plain.ranks[1].peak_memory_bytes


# --- memory -----------------------------------------------------------------------

@pytest.mark.parametrize("schedule, vpp", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_memory_timeline_peaks_match_in_flight_formula(llama, schedule, vpp):
    hw = hardware.load("64xh100-sxm")
    plan = plan_for(llama, hw, dp=2, tp=8, pp=4, m=16, schedule=schedule, vpp=vpp, policy="selective")
    sim, est = simulate(llama, plan, hw), estimate(llama, plan, hw)
    assert sim.peak_memory_bytes == pytest.approx(est.peak_memory_bytes, rel=1e-9)
    rank0 = sim.ranks[0]
    assert rank0.memory_timeline[-1][1] == pytest.approx(sum(rank0.static_memory.values()))
    assert 0 < rank0.peak_memory_time_s < sim.pipeline_s


# --- communication overlap --------------------------------------------------------

@pytest.mark.parametrize("dp, tp, pp, zero, schedule, vpp, compression", [
    (2, 8, 4, 0, "1f1b", 1, "none"), (4, 8, 2, 3, "1f1b", 1, "none"), (8, 4, 2, 2, "gpipe", 1, "none"),
    (2, 8, 4, 1, "interleaved", 2, "int8"), (64, 1, 1, 3, "1f1b", 1, "none"), (8, 8, 1, 0, "1f1b", 1, "none"),
])
def test_exposed_communication_is_never_negative(llama, dp, tp, pp, zero, schedule, vpp, compression):
    hw = hardware.load("64xh100-sxm")
    plan = plan_for(llama, hw, dp=dp, tp=tp, pp=pp, m=16, zero=zero, schedule=schedule, vpp=vpp, policy="full")
    plan = plan.model_copy(update={"compression": compression})
    sim = simulate(llama, plan, hw)
    for rank in sim.ranks:
        assert all(0 <= v <= sim.step_time_s for v in rank.exposed_comm_s.values()), rank.exposed_comm_s
        assert rank.idle_s >= 0
    assert all(v >= 0 for v in sim.breakdown_s.values())
    assert sum(sim.breakdown_s.values()) == pytest.approx(sim.step_time_s, rel=1e-9)


def test_gradient_buckets_overlap_the_last_backward(llama):
    hw = hardware.load("64xh100-sxm")
    sim = simulate(llama, plan_for(llama, hw, dp=8, tp=8, pp=1, m=8), hw)
    buckets = [e for e in sim.events if e.kind == "dp"]
    last_b = max(e.start + e.duration for e in sim.events if e.name.startswith("B"))
    assert len(buckets) > 1
    assert min(e.start for e in buckets) < last_b  # the first buckets start before backward ends
    total = sum(e.duration for e in buckets)
    assert sim.breakdown_s["dp_comm"] < total


# --- trace ------------------------------------------------------------------------

def test_chrome_trace_is_valid_json_with_named_events(llama, tmp_path):
    hw = hardware.load("64xh100-sxm")
    sim = simulate(llama, plan_for(llama, hw, dp=2, tp=8, pp=4, m=8), hw)
    path = write_chrome_trace(sim, tmp_path / "trace.json")
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    names = {e["name"] for e in complete}
    assert {"F3 s1", "B3 s1", "optimizer"} <= names
    assert any(n.startswith("allreduce bucket") for n in names)
    assert any(n.startswith("send act") for n in names) and any(n.startswith("tp F") for n in names)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    procs = {e["pid"] for e in events if e["name"] == "process_name"}
    assert procs == {0, 1, 2, 3}
    threads = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in complete} <= threads
    assert chrome_trace(sim)["otherData"]["step_time_s"] == sim.step_time_s


# --- agreement with the analytic estimate ------------------------------------------

AGREEMENT = [
    ("llama", 64, dict(dp=2, tp=8, pp=4, m=128, policy="selective")),
    ("llama", 64, dict(dp=2, tp=8, pp=4, m=64, schedule="gpipe", policy="full")),
    ("llama", 64, dict(dp=2, tp=8, pp=4, m=64, schedule="interleaved", vpp=2, zero=1, sp=True, policy="selective")),
    ("llama", 64, dict(dp=8, tp=8, pp=1, m=32, zero=1, policy="full")),
    ("llama", 64, dict(dp=8, tp=4, pp=2, m=32, zero=2, policy="full")),
    ("llama", 64, dict(dp=4, tp=8, pp=2, m=16, zero=3, mb=4, policy="none")),
    ("gpt3", 1024, dict(dp=16, tp=8, pp=8, m=192, policy="selective")),
    # zero-bubble: the estimate's ramp fill (costmodel.terms.bubble_fill) against the played ZB1P order
    ("llama", 64, dict(dp=2, tp=8, pp=4, m=32, schedule="zero-bubble", zero=1, policy="none")),
    ("llama", 64, dict(dp=2, tp=8, pp=4, m=32, schedule="zero-bubble", vpp=2, policy="none")),
    ("gpt3", 1024, dict(dp=16, tp=8, pp=8, m=64, schedule="zero-bubble", vpp=3, zero=1, policy="none")),
    # ZB-V: its fill (3 W per rank) against torch's V order played, the turn's hand-over in place
    ("llama", 64, dict(dp=2, tp=8, pp=4, m=32, schedule="zbv", vpp=2, zero=1, policy="none")),
    ("gpt3", 1024, dict(dp=16, tp=8, pp=8, m=64, schedule="zbv", vpp=2, zero=1, policy="none")),
]


@pytest.mark.parametrize("model, gpus, layout", AGREEMENT)
def test_simulation_agrees_with_estimate_on_uniform_plans(llama, model, gpus, layout):
    w = llama if model == "llama" else transformer_workload(GPT3)
    hw = hardware.load(f"{gpus}xh100-sxm")
    plan = plan_for(w, hw, **layout)
    sim, est = simulate(w, plan, hw), estimate(w, plan, hw)
    # zero-bubble: the estimate fills the ramp with a closed form (2 W per rank), the played order with whole ops
    tolerance = 0.035 if plan.splits_backward else 0.03
    assert sim.step_time_s == pytest.approx(est.step_time_s, rel=tolerance)
