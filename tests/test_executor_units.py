"""Executor pieces that need no process group: validation, style derivation, layer mapping."""
from __future__ import annotations

import pytest
import torch

from layout.plan import Plan
from executor.apply.layers import layer_map
from executor.runtime.models import build_model
from executor.apply.pipeline import cut
from planner.trace.tp_styles import analyse_tp
from executor.apply.validate import validate
from hardware.errors import PlanError

from test_executor import make_plan


@pytest.mark.parametrize("change, field", [
    (dict(tp=3), "tp"),                       # 4 heads
    (dict(pp=7, n_layers=7), "pp"),           # more stages than the 6 layers
    (dict(n_layers=5), "stages"),             # last stage ends before the head
    (dict(dp=2, tp=2, sp=True, pp=2, vpp=3, schedule="interleaved"), "pp"),  # 12 virtual stages, 4 blocks
])
def test_validate_refuses_plans_that_do_not_fit(change, field):
    with pytest.raises(PlanError) as info:
        validate(make_plan("reference-tiny", **change), build_model("reference-tiny"))
    assert info.value.field == field


def test_validate_refuses_what_the_declaration_excludes():
    """The executor's refusals come from planner.executable, which the planner's space reads too."""
    with pytest.raises(PlanError) as info:
        validate(make_plan("hf-gpt2-tiny", tp=2), build_model("hf-gpt2-tiny"))
    assert info.value.field == "tp"
    compressed = make_plan("reference-tiny", dp=2, zero=1).with_overrides(compression="int8")
    with pytest.raises(PlanError) as info:
        validate(compressed, build_model("reference-tiny"))
    assert info.value.field == "compression"


def test_validate_refuses_world_size_mismatch_and_accepts_a_good_plan():
    model = build_model("reference-tiny")
    validate(make_plan("reference-tiny", dp=2), model, world_size=2)
    with pytest.raises(PlanError) as info:
        validate(make_plan("reference-tiny", dp=2), model, world_size=3)
    assert info.value.field == "dp*cp*tp*pp"


def test_run_refuses_before_launching():
    from executor.runtime.config import RunConfig
    from executor.runtime.launch import run

    with pytest.raises(PlanError):
        run(make_plan("reference-tiny", tp=3), RunConfig(steps=1))


@pytest.mark.parametrize("name, prefix", [("reference-tiny", "layers.0."), ("hf-llama-tiny", "model.model.layers.0.")])
def test_tp_styles_follow_the_data_flow(name, prefix):
    model = build_model(name)
    analysis = analyse_tp(model, torch.randint(0, 100, (2, 8)))
    styles = {k[len(prefix):]: v for k, v in analysis.styles.items() if k.startswith(prefix)}
    assert all(styles[f"{a}.{p}_proj"] == "colwise" for a in ("attn", "self_attn") if f"{a}.q_proj" in styles
               for p in "qkv")
    assert [v for k, v in styles.items() if k.endswith(("o_proj", "down_proj"))] == ["rowwise", "rowwise"]
    assert any(k.endswith("lm_head") for k in analysis.model_outputs)


def test_layer_map_and_pipeline_cut_keep_names():
    model = build_model("hf-gpt2-tiny")
    lmap = layer_map(model)
    assert lmap.n_layers == 6 and lmap.pre == ("model.transformer.wte", "model.transformer.wpe")
    names = {n for n, _ in model.named_parameters()}
    middle = cut(model, lmap, 2, 4)
    kept = {n for n, _ in middle.named_parameters()}
    assert kept and kept < names
    assert all(n.startswith(("model.transformer.h.1.", "model.transformer.h.2.")) for n in kept)
    hidden = torch.randn(2, 8, 64)
    assert middle(hidden).shape == hidden.shape


# ---------------------------------------------------------------- measurement and prediction


def test_memory_tracker_follows_in_place_storage_resizes():
    """FSDP2 frees unsharded parameters with untyped_storage().resize_(0): the count must drop."""
    from executor.measure.memory import LiveBytes

    tracker = LiveBytes()
    with tracker:
        t = torch.ones(1024)  # 4 KiB created inside the mode
        assert tracker.live == 4096
        t.untyped_storage().resize_(0)
        assert tracker.live == 0
        t.untyped_storage().resize_(8192)
        assert tracker.live == 8192
    assert tracker.peak == 8192
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_  # patch removed on exit


def test_memory_tracker_counts_a_dtensor_parameter_by_its_local_shard():
    from executor.measure.memory import _local

    class Wrapped:  # stands in for a DTensor: the local shard under _local_tensor
        _local_tensor = torch.nn.Parameter(torch.ones(8))

    assert _local(Wrapped()) is Wrapped._local_tensor
    assert _local(torch.ones(3)) is not None


def test_link_fit_reproduces_the_cost_models_all_reduce():
    from costmodel.collectives import Group, all_reduce
    from executor.measure.microbench import link_from_all_reduce
    from hardware import load

    cluster = load("4xcpu")
    node = cluster.node.model_copy(update={"link_gbps": 1.5, "link_latency_us": 2000.0, "fabric": "pcie"})
    eff = cluster.gpu.efficiency.model_copy(update={"intra_node_bw": 1.0})  # as calibrate writes it
    truth = cluster.model_copy(update={"node": node, "gpu": cluster.gpu.model_copy(update={"efficiency": eff})})
    curve = {s: all_reduce(s, Group(4, 4), truth) for s in (2 ** 16, 2 ** 20, 8 * 2 ** 20, 32 * 2 ** 20)}
    bw, latency = link_from_all_reduce(curve, 4)
    assert bw == pytest.approx(1.5e9, rel=0.1)
    assert latency == pytest.approx(2e-3, rel=0.1)


def test_fit_half_dim_is_flat_when_small_sizes_are_not_slower():
    from executor.measure.microbench import fit_half_dim

    assert fit_half_dim({256: 2e10, 512: 1.9e10, 1024: 1.8e10}) == (2e10, 0.0)
    peak, half = fit_half_dim({d: 1e12 * d / (d + 128) for d in (128, 256, 512, 1024)})
    assert peak == pytest.approx(1e12, rel=1e-6) and half == pytest.approx(128, rel=1e-6)


def test_comm_overlap_and_optimizer_speed_are_priced():
    """Collectives that cannot overlap compute are exposed; a slower optimizer costs more; None keeps the old model."""
    from costmodel.estimate import estimate
    from hardware import load

    cluster = load("4xcpu")
    plan = Plan(
        model="gpt-85m", hardware="4xcpu", global_batch=8, seq_len=256, dtype="fp32", dp=4, tp=1, pp=1, zero=3,
        micro_batch=2,
        stages=[{"start": 0, "end": 14, "recompute": ["none"] * 14}])
    workload = _workload(plan)
    base = estimate(workload, plan, cluster)

    def with_eff(**eff):
        e = cluster.gpu.efficiency
        e = e.model_copy(update={**eff, "sources": {**e.sources, **{k: "test" for k in eff}}})
        return cluster.model_copy(update={"gpu": cluster.gpu.model_copy(update={"efficiency": e})})

    serial = estimate(workload, plan, with_eff(comm_overlap=0.0))
    assert serial.breakdown_s["zero_comm"] >= base.breakdown_s["zero_comm"]
    assert serial.breakdown_s["zero_comm"] > 0
    slow = estimate(workload, plan, with_eff(optimizer=0.25))
    # the AdamW traffic takes 4x as long; FSDP2's gradient copies are its reduce-scatters', not the step's
    from costmodel.data_parallel import reduction_copy_passes

    assert reduction_copy_passes(plan) == 0  # zero 3 reduces through FSDP2
    assert reduction_copy_passes(plan.with_overrides(zero=0)) == 2  # DDP divides its buckets in place
    assert slow.breakdown_s["optimizer"] == pytest.approx(4 * base.breakdown_s["optimizer"])


def _workload(plan):
    """The one workload of the model: what plan, estimate and the run report price."""
    from planner.trace.workload_for import workload_for

    return workload_for(plan.model, seq_len=plan.seq_len, dtype=plan.dtype)[0]


def test_prediction_keeps_each_tp_ranks_vocabulary_shard_of_the_logits():
    """The executor's loss is torch's loss parallelism: the logits, their log-probabilities and
    their gradients are split over the vocabulary like the head's weight, never whole on a rank."""
    plan = Plan(model="gpt-85m", hardware="4xcpu", global_batch=8, seq_len=256, dtype="fp32", dp=1, tp=4, pp=1, micro_batch=8,
                stages=[{"start": 0, "end": 14, "recompute": ["none"] * 14}])
    head = _workload(plan).segments[-1].layer
    logits_fp32 = 256 * 8192 * 4
    assert head.act_tp_sharded >= logits_fp32 and head.act_replicated < logits_fp32 and head.act_transient_tp == "S"


def test_prediction_prices_the_tp_collectives_the_executor_issues():
    """DTensor TP on the reference GPT (separate q/k/v projections): a block all-reduces twice in
    forward and four times in backward (6 gloo all-reduces counted with torch.profiler); the head
    all-reduces its input gradient and keeps its logits split over the vocabulary (no all-gather:
    the loss is torch's loss parallelism); the embedding layer reduces
    in forward only, once per table: the tokens' and the learned positions', both split rowwise."""
    plan = Plan(model="gpt-85m", hardware="4xcpu", global_batch=8, seq_len=256, dtype="fp32", dp=1, tp=4, pp=1, micro_batch=8,
                stages=[{"start": 0, "end": 14, "recompute": ["none"] * 14}])
    layers = {seg.layer.kind: seg.layer for seg in _workload(plan).segments}
    assert (layers["block"].tp_allreduces_fwd, layers["block"].tp_allreduces_bwd) == (2, 4)
    assert (layers["embedding"].tp_allreduces_fwd, layers["embedding"].tp_allreduces_bwd) == (2, 0)
    head = layers["head"]
    assert (head.tp_allreduces_fwd, head.tp_allreduces_bwd) == (0, 1)


def test_storage_write_measurement_is_bounded_and_leaves_nothing(tmp_path):
    from executor.measure.microbench import storage_write_bytes_per_s

    rate = storage_write_bytes_per_s(str(tmp_path), mbytes=16, budget_s=2.0)
    assert rate > 0 and list(tmp_path.iterdir()) == []


def test_fresh_page_rate_is_measured_on_cpu_only():
    from executor.measure.microbench import fresh_page_bytes_per_s
    rate = fresh_page_bytes_per_s("cpu", mbytes=40)
    assert rate is not None and 0 < rate < float("inf")
    assert fresh_page_bytes_per_s("cuda") is None


def test_a_calibrated_gpu_records_its_arch_and_runtime_memory(monkeypatch):
    """On CUDA, calibrate names the architecture (so a calibrated profile prices the attention kernel
    torch dispatches there, not the math path), what the runtime holds outside torch's tensors and
    what the host spends issuing an op."""
    from costmodel.attention import AttentionCall, sdpa_backend
    from executor.measure.calibrate import cuda_runtime
    from hardware import load

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    fields, sources = cuda_runtime("cuda", [{"runtime_memory": (500 * 2**20, 32 * 2**20), "host_op": 20e-6}],
                                   "measured")
    catalog = load("h200").gpu
    gpu = type(catalog).model_validate({**catalog.model_dump(), **fields, "sources": {**catalog.sources, **sources}})
    assert gpu.arch == "sm90" and gpu.runtime_memory.bytes()["cuda_context"] == 500 * 2**20
    assert gpu.host_op_us == pytest.approx(20.0) and "host_op_us" in gpu.sources
    call = AttentionCall(heads=32, kv_heads=8, head_dim=64, value_dim=64, q_len=2048, kv_len=2048, dtype="bfloat16",
                         mask="causal", dropout=False, layout="bshd")
    assert sdpa_backend(call, gpu) != "math"
    assert cuda_runtime("cpu", [], "measured") == ({}, {})


class _Attention(torch.nn.Module):
    """One attention core on 8 positions: `dropout` > 0 sends torch's CPU dispatcher to the math path."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.qkv, self.dropout = torch.nn.Linear(16, 48), dropout

    def forward(self, x):
        q, k, v = self.qkv(x).view(1, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)
        return out.transpose(1, 2).reshape(1, 8, 16)


def _saved_bytes_and_grads(module, x):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t
    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    out.sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return sum(saved), grads


@pytest.mark.parametrize("dropout, math", [(0.0, False), (0.1, True)])
def test_selective_recomputes_the_attention_core_only_on_the_math_path(dropout, math):
    """Megatron's selective as priced: on the math path the s x s scores are dropped and rebuilt
    (same gradients, dropout included); a fused kernel keeps no scores and runs as without it."""
    from executor.apply.recompute import recompute_attention_core, runs_on_math_path

    plain, x = _Attention(dropout), torch.randn(1, 8, 16)
    q = torch.randn(1, 2, 8, 8)
    assert runs_on_math_path(q, q, q, dropout_p=dropout, is_causal=True) == math
    kept, reference = _saved_bytes_and_grads(plain, x)
    recompute_attention_core(plain)
    selective, grads = _saved_bytes_and_grads(plain, x)
    assert all(torch.allclose(a, b) for a, b in zip(grads, reference))
    scores = 2 * 8 * 8 * 4  # one fp32 [heads, s, s] tensor
    assert (kept - selective >= scores) if math else selective == kept


def test_op_policy_recompute_decides_as_its_forward_whether_or_not_torch_asks_again(monkeypatch):
    """torch before 2.12 asks the policy again during the recompute (torch 2.13 replays): each pass
    counts its own multiplies, so the recompute keeps exactly the products the forward saved."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import CheckpointPolicy

    from executor.apply import recompute

    monkeypatch.setattr(recompute, "create_selective_checkpoint_contexts", lambda policy: policy)
    policy, mm = recompute._save_products(), recompute.MULTIPLY
    forward = [policy(SimpleNamespace(is_recompute=False), mm) for _ in range(7)]  # a Llama block's seven
    again = [policy(SimpleNamespace(is_recompute=True), mm) for _ in range(7)]
    assert forward == again
    assert forward[:2] == [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE]


def test_a_gpu_hosts_figures_are_measured_for_offload():
    """A GPU's ranks measure the host for offload: the pinned link (the slower way), the host
    memory's copy bandwidth summed over ranks, and its fresh pages (the host AdamW's temporaries)."""
    from executor.measure.calibrate import host_figures

    ranks = [{"host_link": 50e9, "host_memory": 100e9, "host_fresh_pages": 10e9},
             {"host_link": 54e9, "host_memory": 80e9, "host_fresh_pages": 12e9}]
    fields, sources = host_figures("cuda", ranks, copy_bw=3e12, memory_gb=141.0, when="measured")
    assert fields["host_link_gbps"] == pytest.approx(52.0) and fields["host_memory_gbps"] == pytest.approx(180.0)
    assert fields["host_fresh_page_gbps"] == pytest.approx(11.0) and fields["host_memory_gb"] > 0
    assert set(sources) == set(fields)
    cpu, _ = host_figures("cpu", [{}], copy_bw=10e9, memory_gb=16.0, when="measured")
    assert "host_fresh_page_gbps" not in cpu and cpu["host_link_gbps"] == pytest.approx(10.0)


def test_a_pipeline_step_keeps_no_outputs_the_plan_does_not_price():
    """torch's schedules keep every micro-batch's output on the last stage (and concatenate them)
    unless told not to: the executor asks only for the losses."""
    from types import SimpleNamespace

    import torch

    from executor.runtime.train import _pipeline_step
    from layout.layout import Layout

    calls = []

    class Schedule:
        def step(self, *args, **kwargs):
            calls.append(kwargs)
            if "losses" in kwargs:
                kwargs["losses"].extend([torch.tensor(2.0), torch.tensor(4.0)])

    run, plan = SimpleNamespace(schedule=Schedule()), Layout(pp=2)  # the last stage on rank 1
    loss = _pipeline_step(run, plan, torch.zeros(2, 4), torch.zeros(2, 4), pp_rank=1)
    assert _pipeline_step(run, plan, torch.zeros(2, 4), None, pp_rank=0) is None
    assert float(loss) == 3.0 and all(call["return_outputs"] is False for call in calls)


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_fsdp2s_copies_on_the_computing_stream_are_priced_each_gather_and_hand_off(micro_batches):
    """FSDP2 copies each gather's flat output into the parameters' storage, and each unit's
    gradients into the reduce-scatter's flat input, on the stream that computes: nothing hides
    them, however long the compute; ZeRO-3 gathers twice a micro-batch and hands over once, so
    they grow with the micro-batches. One offloaded rank runs them too; Megatron's buffers
    (the fused stack) are the collectives' own."""
    from costmodel.compute import LayerTime, memory_bandwidth
    from costmodel.data_parallel import sharded_exposed
    from costmodel.layout import layout_of
    from hardware import load

    cluster = load("8xh100-sxm")
    plan = Plan(model="gpt-85m", hardware="8xh100-sxm", global_batch=8 * micro_batches, seq_len=256, dtype="bf16", dp=8,
                zero=3, micro_batch=1, stages=[{"start": 0, "end": 14, "recompute": ["none"] * 14}])
    long = LayerTime(forward=1e3, backward=1e3, recompute=0.0, tp_comm=0.0)  # hides every collective
    params = 1e9
    bandwidth = memory_bandwidth(cluster.gpu)
    per_micro_batch = params * (2 * 2 * 2 + (2 + 4)) / bandwidth  # 2 gathers' bf16 copy-out, bf16 -> fp32 copy-in
    for layout in (plan, plan.with_overrides(dp=1, global_batch=micro_batches, offload=True)):
        assert layout.num_micro_batches == micro_batches
        exposed = sharded_exposed(params, long, layout, layout_of(layout, cluster))
        assert exposed == pytest.approx(per_micro_batch, rel=1e-9)  # each micro-batch's share
    fused = plan.with_overrides(stack="fused")
    assert sharded_exposed(params, long, fused, layout_of(fused, cluster)) == 0.0
