"""Executor equivalence: every layout trains like one process with the same seed.

Each launch (torch.multiprocessing.spawn, file:// rendezvous, gloo) runs many
layouts one after the other in the same process group, so that the whole file
stays within a few minutes on two cores. Ranks write losses and unsharded
parameters to files; the test process compares them with a single-process run.
"""
from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from layout.plan import Plan
from executor.apply.materialize import lm_loss
from executor.runtime.models import build_model, vocab_size
from executor.runtime.train import global_batch

STEPS = 3
SEQ = 16
GLOBAL_BATCH = 8
# Attention key biases have an exactly zero true gradient (softmax ignores a
# per-row constant): AdamW turns float rounding noise into updates of up to lr
# there, so they are not compared. A few other entries have a near-zero gradient,
# noise-driven updates of up to ~1e-4. A missing gradient reduction moves
# parameters by ~lr = 1e-3 per step, far above.
PARAM_ATOL = 2e-4


MIXED_DATA_SPLIT = [{"hardware": "2xa100-80g", "stages": [0], "replicas": [0, 1]},
                    {"hardware": "2xh100-sxm", "stages": [0], "replicas": [2, 3]}]
MIXED_PIPELINE_SPLIT = [{"hardware": "2xa100-80g", "stages": [0], "replicas": [0, 1]},
                        {"hardware": "2xh100-sxm", "stages": [1], "replicas": [0, 1]}]


def make_plan(model: str, dp=1, tp=1, pp=1, zero=0, sp=False, micro_batch=None, schedule="1f1b", vpp=1,
              recompute="none", n_layers=6, dp_shard=None, cp=1, ep=1, offload=False, dp_micro_batches=None,
              bounds=None, groups=None, **recipe) -> Plan:
    """A plan with evenly cut stages over the expanded layer list (embedding, 4 blocks, head);
    `recipe`: the compute dtype (fp32 unless given) and the precision and accumulation axes."""
    n_stages = pp * vpp
    bounds = bounds or [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    stages = [{"start": a, "end": b, "recompute": [recompute] * (b - a)} for a, b in zip(bounds, bounds[1:])]
    micro = micro_batch or GLOBAL_BATCH // (dp * max(pp, 1) * (2 if pp > 1 else 1))
    hardware = "+".join(g["hardware"] for g in groups) if groups else "cpu"
    return Plan(model=model, hardware=hardware, global_batch=GLOBAL_BATCH, seq_len=SEQ, dp=dp, tp=tp, pp=pp,
                sp=sp, zero=zero, micro_batch=max(micro, 1), schedule=schedule, vpp=vpp, stages=stages,
                dp_shard=dp_shard, cp=cp, ep=ep, offload=offload, dp_micro_batches=dp_micro_batches, groups=groups,
                **{"dtype": "fp32", **recipe})


def _worker(rank: int, world: int, init_file: str, cases: list[tuple[str, str]], out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from executor.runtime.compare import full_parameters
    from executor.apply.materialize import materialize_rank
    from executor.runtime.mesh import coords, init_distributed
    from executor.runtime.train import train_steps

    init_distributed(timeout_s=120, init_method=f"file://{init_file}", rank=rank, world_size=world)
    for label, plan_json in cases:
        plan = Plan.from_json(plan_json)
        frames = int(torch._dynamo.utils.counters["frames"]["ok"])  # frames dynamo has compiled in this process
        try:
            model = build_model(plan.model, seed=0, trust_module=True)  # the tests trust their own factories
            vocab = vocab_size(model)
            run = materialize_rank(plan, model)
            result = train_steps(run, plan, STEPS, seed=0, vocab=vocab)
            params = full_parameters(run.modules, run.tied_aliases)
            at = coords(run.mesh)
            compiled = int(torch._dynamo.utils.counters["frames"]["ok"]) - frames
            if at["dp"] == 0 and at["tp"] == 0:
                torch.save({"params": params, "result": result, "replicated": run.tp_replicated, "compiled": compiled},
                           os.path.join(out_dir, f"{label}.rank{rank}.pt"))
        except Exception as error:  # recorded, so that one broken layout names itself
            with open(os.path.join(out_dir, f"{label}.rank{rank}.error"), "w") as fh:
                fh.write(f"{type(error).__name__}: {error}")
            raise
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(world: int, cases: dict[str, Plan]) -> str:
    """Run every case on `world` processes; return the folder with their results."""
    out_dir = tempfile.mkdtemp(prefix="parallax-exec-")
    init_file = os.path.join(out_dir, "rendezvous")
    items = [(label, plan.to_json()) for label, plan in cases.items()]
    mp.spawn(_worker, args=(world, init_file, items, out_dir), nprocs=world, join=True)
    return out_dir


def reference(model_name: str, plan: Plan) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same model and data in one process, whole global batch at once, in the plan's
    precision: autocast to its compute dtype, its weights (and so AdamW's moments) in its master dtype."""
    from executor.apply.data_parallel import cast_master_weights
    from executor.runtime.train import precision

    torch.set_num_threads(1)
    model = cast_master_weights(build_model(model_name, seed=0, trust_module=True), plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        tokens = global_batch(plan, step, 0, vocab_size(model))
        with precision(plan, torch.device("cpu")):
            logits = model(tokens[:, :-1])
        loss = lm_loss(logits, tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def collect(out_dir: str, label: str) -> tuple[list[float], dict[str, torch.Tensor], list[str]]:
    errors = [f for f in os.listdir(out_dir) if f.startswith(label + ".") and f.endswith(".error")]
    assert not errors, open(os.path.join(out_dir, errors[0])).read()
    files = sorted(f for f in os.listdir(out_dir) if f.startswith(label + ".rank") and f.endswith(".pt"))
    assert files, f"{label}: no results written"
    params, losses, replicated = {}, None, []
    for name in files:
        data = torch.load(os.path.join(out_dir, name))
        params.update(data["params"])
        losses = data["result"]["losses"]
        replicated = data["replicated"]
    return losses, params, replicated


# bf16 compute: GEMM outputs rounded to 8 bits of mantissa, whose sums differ with the split of the
# batch, so AdamW turns the noise of near-zero gradients into updates of up to lr per step, either
# way; bf16 weights add a rounding step of 2^-8 of each. A missing reduction moves most entries.
TOLERANCES = {("fp32", "fp32"): (1e-4, 1e-5, PARAM_ATOL), ("bf16", "fp32"): (2e-3, 1e-3, 1e-3),
              ("bf16", "bf16"): (2e-3, 1e-3, 1e-3)}  # (loss rtol, loss atol, parameter atol)
STRAY_SHARE = 0.01  # bf16 runs: entries allowed beyond the parameter atol, each still within 2 lr per step


def assert_equivalent(out_dir: str, label: str, plan: Plan, cache: dict) -> list[str]:
    key = (plan.model, plan.dtype, plan.master_dtype)
    if key not in cache:
        cache[key] = reference(plan.model, plan)
    ref_losses, ref_params = cache[key]
    losses, params, replicated = collect(out_dir, label)
    loss_rtol, loss_atol, param_atol = TOLERANCES[(plan.dtype, plan.master_dtype)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=loss_rtol, atol=loss_atol,
                               msg=lambda m: f"{label} losses: {m}")
    assert set(params) == set(ref_params), f"{label}: parameter names differ: {set(params) ^ set(ref_params)}"
    strays, entries = 0, 0
    for name, value in ref_params.items():
        assert params[name].dtype == value.dtype, f"{label} {name}: {params[name].dtype}, not {value.dtype}"
        if name.endswith("k_proj.bias"):  # an exactly zero true gradient: AdamW's updates of it are rounding noise
            continue
        if plan.dtype == "fp32":
            torch.testing.assert_close(params[name], value, rtol=1e-4, atol=param_atol, msg=lambda m: f"{label} {name}: {m}")
            continue
        gap, size = (params[name].float() - value.float()).abs(), value.float().abs()
        strays, entries = strays + int((gap > param_atol + 1.6e-2 * size).sum()), entries + gap.numel()
        assert (gap <= 2 * STEPS * 1e-3 + 1.6e-2 * size).all(), f"{label} {name}: {gap.max()} off"
    assert strays <= STRAY_SHARE * entries, f"{label}: {strays} of {entries} entries off"
    return replicated


def _cases(model: str, names: tuple[str, ...]) -> dict[str, Plan]:
    table = {
        "dp": dict(dp=2), "zero1": dict(dp=2, zero=1), "zero2": dict(dp=2, zero=2), "zero3": dict(dp=2, zero=3),
        "tp": dict(tp=2), "tp_sp": dict(tp=2, sp=True),
        "pp_gpipe": dict(pp=2, schedule="gpipe"), "pp_1f1b": dict(pp=2, schedule="1f1b"),
        "pp_interleaved": dict(pp=2, schedule="interleaved", vpp=2),
        "pp_zero_bubble": dict(pp=2, schedule="zero-bubble", vpp=2), "pp_zero_bubble_1": dict(pp=2, schedule="zero-bubble"),
        "pp_tp_zero_bubble": dict(pp=2, tp=2, schedule="zero-bubble", vpp=2),
        "pp_dp_zero_bubble_zero1": dict(pp=2, dp=2, schedule="zero-bubble", vpp=2, zero=1),
        # ZB-V: two chunks per rank in a V, the first and last stages (a tied head's two copies) on rank 0
        "pp_zbv": dict(pp=2, schedule="zbv", vpp=2), "pp_dp_zbv_zero1": dict(pp=2, dp=2, schedule="zbv", vpp=2, zero=1),
        "dp_full_ac": dict(dp=2, recompute="full"), "zero3_full_ac": dict(dp=2, zero=3, recompute="full"),
        "tp_selective_ac": dict(tp=2, recompute="selective"), "pp_selective_ac": dict(pp=2, recompute="selective"),
        "tp_sp_op_ac": dict(tp=2, sp=True, recompute="op"), "zero3_op_ac": dict(dp=2, zero=3, recompute="op"),
        "dp_tp": dict(dp=2, tp=2), "dp_tp_zero3": dict(dp=2, tp=2, zero=3, recompute="full"),
        "pp_dp": dict(pp=2, dp=2), "pp_dp_zero3": dict(pp=2, dp=2, zero=3, recompute="selective"),
        "pp_dp_interleaved_zero1": dict(pp=2, dp=2, schedule="interleaved", vpp=2, zero=1),
        "pp_dp_interleaved": dict(pp=2, dp=2, schedule="interleaved", vpp=2),
        "dp_tp_zero1": dict(dp=2, tp=2, zero=1), "pp_tp_sp": dict(pp=2, tp=2, sp=True),
        "pp_tp_sp_interleaved_ac": dict(pp=2, tp=2, sp=True, schedule="interleaved", vpp=2, recompute="full"),
        # hybrid sharding: shard over pairs, replicate across the two pairs, two micro-batches accumulated
        "hsdp": dict(dp=4, zero=3, dp_shard=2, micro_batch=GLOBAL_BATCH // 8),
        "zero3_accumulate": dict(dp=2, zero=3, micro_batch=GLOBAL_BATCH // 4),
        # gradient accumulation holding FSDP2's unsharded gradients, reduced once in the last micro-batch
        "zero3_hold": dict(dp=2, zero=3, micro_batch=GLOBAL_BATCH // 4, accumulation="hold_unsharded"),
        # precision policies: bf16 compute with fp32 weights reduced in fp32 (the default) or bf16; bf16 weights
        # and moments over DDP, FSDP2 and holding their unsharded gradients
        "zero3_bf16": dict(dp=2, zero=3, dtype="bf16"),
        "zero3_bf16_reduce_bf16": dict(dp=2, zero=3, dtype="bf16", reduce_dtype="bf16"),
        "dp_bf16_states": dict(dp=2, dtype="bf16", master_dtype="bf16", optimizer_dtype="bf16"),
        # torch DDP's own default: a bucket copy beside every gradient, two micro-batches accumulated into .grad
        "dp_bucket_copies": dict(dp=2, ddp_bucket_view=False, micro_batch=GLOBAL_BATCH // 4),
        "pp_bf16_states": dict(pp=2, dtype="bf16", master_dtype="bf16", optimizer_dtype="bf16"),  # bf16 between stages
        "zero2_bf16_states_hold": dict(dp=2, zero=2, dtype="bf16", master_dtype="bf16", optimizer_dtype="bf16",
                                       micro_batch=GLOBAL_BATCH // 4, accumulation="hold_unsharded"),
        # context parallel: each sequence over 2 ranks, keys and values all-gathered
        "cp": dict(cp=2), "cp_dp_zero3_ac": dict(cp=2, dp=2, zero=3, recompute="full", micro_batch=GLOBAL_BATCH // 4),
        "cp_tp": dict(cp=2, tp=2, sp=True),
        # expert parallel: each rank holds half the experts, tokens exchanged by all-to-all
        "ep": dict(dp=2, ep=2), "ep_zero1": dict(dp=4, ep=2, zero=1, micro_batch=GLOBAL_BATCH // 8),
        "ep_zero3": dict(dp=4, ep=2, zero=3, micro_batch=GLOBAL_BATCH // 8, recompute="full"),
        # expert parallel composed: inside pipeline stages, beside TP (experts whole per TP rank), over CP ranks
        "ep_pp": dict(dp=2, ep=2, pp=2), "ep_pp_zero1": dict(dp=2, ep=2, pp=2, zero=1),
        "ep_tp": dict(dp=2, ep=2, tp=2), "ep_cp": dict(dp=2, cp=2, ep=4),
        # offload: FSDP2's CPUOffloadPolicy (unpinned on CPU), over dp, over one rank beside TP or pipelines
        "zero3_offload": dict(dp=2, zero=3, offload=True), "zero2_offload": dict(dp=2, zero=2, offload=True),
        "tp_offload": dict(tp=2, zero=3, offload=True), "pp_offload": dict(pp=2, zero=3, offload=True),
        "zero3_offload_accumulate": dict(dp=2, zero=3, offload=True, micro_batch=GLOBAL_BATCH // 4),
        # mixed-cluster plans (with groups, 2 slower + 2 faster GPUs): 2+2 replicas running 1 and 3
        # micro-batches a step (the faster pair takes three quarters of the batch), and a pipeline
        # whose stages hold 1 and 3 of the 4 blocks
        "uneven_shares": dict(dp=4, micro_batch=1, dp_micro_batches=[1, 1, 3, 3], groups=MIXED_DATA_SPLIT),
        "uneven_shares_zero1": dict(dp=4, zero=1, micro_batch=1, dp_micro_batches=[1, 1, 3, 3], groups=MIXED_DATA_SPLIT),
        "stage_split_1_3": dict(pp=2, dp=2, bounds=[0, 2, 6], groups=MIXED_PIPELINE_SPLIT),
        # the compile stack: each block's forward torch.compile'd (inductor's C++), its checkpoint traced within
        "zero3_op_ac_compile": dict(dp=2, zero=3, recompute="op", stack="compile"),
        "tp_sp_full_ac_compile": dict(tp=2, sp=True, recompute="full", stack="compile"),
        "pp_1f1b_compile": dict(pp=2, schedule="1f1b", stack="compile"),
    }
    return {f"{model}-{name}": make_plan(model, **table[name]) for name in names}


def _check_all(world: int, cases: dict[str, Plan]) -> dict[str, list[str]]:
    out_dir, cache = launch(world, cases), {}
    return {label: assert_equivalent(out_dir, label, plan, cache) for label, plan in cases.items()}


COMPILED = ("zero3_op_ac_compile", "tp_sp_full_ac_compile", "pp_1f1b_compile")


def test_reference_gpt_two_ranks_matches_single_process():
    """Every 2-rank layout of the reference GPT in one launch, the compile stack's among them: the
    eager reference against compiled blocks (the first two steps run eagerly under the CPU's memory
    tracker, executor.measure.memory; the third compiled, which each compiled case must show)."""
    cases = {**_cases("reference-tiny", ("dp", "zero1", "zero2", "zero3", "zero3_accumulate", "cp", "tp", "tp_sp",
                                         "pp_gpipe", "pp_1f1b", "pp_interleaved", "dp_full_ac", "zero3_full_ac",
                                         "tp_selective_ac", "pp_selective_ac", "pp_zero_bubble", "pp_zero_bubble_1", "pp_zbv",
                                         "zero3_hold", "zero3_bf16", "zero3_bf16_reduce_bf16", "dp_bf16_states",
                                         "dp_bucket_copies", "zero2_bf16_states_hold", *COMPILED)),
             # a head tied to the embedding stays one weight when TP splits both
             **_cases("reference-tiny-tied", ("tp", "tp_sp", "zero3", "pp_zbv"))}
    out_dir, cache = launch(2, cases), {}
    for label, plan in cases.items():
        assert_equivalent(out_dir, label, plan, cache)
        if plan.stack == "compile":
            compiled = torch.load(os.path.join(out_dir, f"{label}.rank0.pt"))["compiled"]
            assert compiled > 0, f"{label}: no frame was compiled"


def test_four_rank_layouts_match_single_process():
    # plain dp x tp and pp x dp run inside their ZeRO variants' compositions
    _check_all(4, {**_cases("reference-tiny", ("dp_tp_zero3", "pp_dp_zero3", "pp_dp_interleaved_zero1",
                                               "dp_tp_zero1", "pp_tp_sp", "pp_tp_sp_interleaved_ac", "hsdp",
                                               "cp_dp_zero3_ac", "cp_tp", "pp_dp_zero_bubble_zero1", "pp_tp_zero_bubble",
                                               "pp_dp_zbv_zero1")),
                   # the HF model's own paths (rotary, its attention registry) in compositions; its plain dp x tp and
                   # pp x dp are the reference's above
                   **_cases("hf-llama-tiny", ("pp_dp_interleaved", "pp_tp_sp", "cp_dp_zero3_ac", "cp_tp",
                                              "pp_dp_zero_bubble_zero1"))})


def test_hf_and_users_models_two_ranks_match_single_process():
    """One launch (the suite's time) for the models written by others: HF's Llama, GPT-2 (its Conv1D
    projections) and Mixtral (data and expert parallel), and a plain-PyTorch module that `parallax plan
    --module examples.llama_module:build_tiny` plans (its blocks take cos and sin beside the hidden
    states; the executor builds it through the factory and cuts it into stages with stand-ins for
    what another stage owns)."""
    _check_all(2, {**_cases("hf-llama-tiny", ("dp", "zero3", "cp", "tp", "tp_sp", "pp_1f1b", "pp_interleaved",
                                              "pp_zero_bubble", "pp_zbv", "tp_selective_ac", "zero3_full_ac", "tp_sp_op_ac",
                                              "zero3_op_ac")),
                   **_cases("hf-gpt2-tiny", ("dp", "zero2", "pp_gpipe", "pp_interleaved", "dp_full_ac",
                                             "pp_bf16_states")),
                   **_cases("hf-mixtral-tiny", ("dp", "ep")),
                   **_cases("examples.llama_module:build_tiny", ("dp", "pp_gpipe", "zero3"))})


def test_zero_bubble_is_refused_where_its_split_backward_does_not_run():
    """FSDP2's sharded gradients, SP and recomputation under the zero-bubble schedule: refused
    by the rulebook before launch (measured wrong or failing on CPU), never offered."""
    from executor.apply.validate import validate
    from hardware.errors import PlanError

    model = build_model("reference-tiny")
    for schedule in ("zero-bubble", "zbv"):
        for pins, field in ((dict(pp=2, dp=2, zero=3), "zero"), (dict(pp=2, tp=2, sp=True), "sp"),
                            (dict(pp=2, recompute="full"), "recompute")):
            with pytest.raises(PlanError) as refused:
                validate(make_plan("reference-tiny", schedule=schedule, vpp=2, **pins), model)
            assert refused.value.field == field
    from layout.layout import Layout
    from layout.rules import structural_problem

    assert structural_problem(Layout(pp=2, schedule="zbv", vpp=1)).field == "vpp"  # ZB-V: two chunks per rank


def test_hf_mixtral_expert_parallel_matches_single_process():
    """Its 2-rank layouts run in test_hf_and_users_models_two_ranks_match_single_process."""
    _check_all(4, _cases("hf-mixtral-tiny", ("ep_zero1", "ep_zero3", "ep_pp", "ep_pp_zero1", "ep_tp", "ep_cp")))


def test_offloaded_layouts_match_single_process():
    _check_all(2, _cases("reference-tiny", ("zero3_offload", "zero2_offload", "tp_offload", "pp_offload",
                                            "zero3_offload_accumulate")))


def test_mixed_cluster_shapes_match_single_process():
    """Uneven data-parallel shares (token-weighted gradient average) and an uneven stage split."""
    _check_all(4, _cases("reference-tiny", ("uneven_shares", "uneven_shares_zero1", "stage_split_1_3")))


def test_gpt2_tp_is_neither_offered_nor_run():
    """GPT-2's fused Conv1D projections are not what DTensor splits: the executor
    refuses TP on it, and the planner's space (same declaration) never offers it."""
    import pytest

    from executor.apply.validate import validate
    from hardware.errors import PlanError
    from planner.search.space import tp_choices
    from planner.trace.workload_for import workload_for
    import hardware

    with pytest.raises(PlanError) as refused:
        validate(make_plan("hf-gpt2-tiny", tp=2), build_model("hf-gpt2-tiny"))
    assert refused.value.field == "tp" and "tensor-split" in str(refused.value)
    workload, _ = workload_for("gpt2", seq_len=64)
    assert tp_choices(workload, hardware.load("8xh100-sxm")) == [1]


def test_parallax_run_end_to_end_with_torchrun(tmp_path):
    """The one torchrun launch: CLI -> validate -> torchrun -> worker -> report."""
    from parallax_cli import main

    plan = make_plan("reference-tiny", dp=2, zero=3)
    plan_path, out = tmp_path / "plan.json", tmp_path / "report.json"
    plan_path.write_text(plan.to_json())
    assert main(["run", str(plan_path), "--steps", "3", "--out", str(out)]) == 0
    from executor.runtime.report import RunReport

    report = RunReport.model_validate_json(out.read_text())
    ref_losses, _ = reference(plan.model, plan)
    torch.testing.assert_close(torch.tensor(report.losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    assert report.world_size == 2 and len(report.peak_memory_bytes) == 2
    # Peak memory covers at least parameters, gradients and two AdamW moments of this rank's shard.
    shard_bytes = sum(p.numel() for p in build_model(plan.model).parameters()) * 4 / 2
    assert all(peak >= 4 * shard_bytes for peak in report.peak_memory_bytes)
    assert report.step_time_s > 0
