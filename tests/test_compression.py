"""Gradient compression: hooks on 4 gloo ranks, cost model, planner choice."""
from __future__ import annotations

import os
import sys
import traceback

import pytest
import torch
from pydantic import ValidationError

import hardware
from costmodel import collectives as coll
from costmodel.compression import (DEFAULT_TOPK_FRACTION, TOPK_INDEX_BYTES, compressed_reduction_time,
                                   compression_compute_time, plan_reduction_time, topk_gathered_bytes,
                                   wire_bytes_per_rank)
from costmodel.data_parallel import dp_time
from costmodel.layout import layout_of
from layout.plan import Plan, uniform_stages
from executor.apply.compression import CompressionConfig, check_compression, dequantize_int8, quantize_int8, topk_select
from hardware.errors import PlanError

WORLD = 4


# ------------------------------------------------------------------ pure pieces

def test_quantize_is_exact_on_representable_values():
    x = torch.tensor([[127.0, -3.0, 0.0, 5.0], [-254.0, 2.0, 4.0, 0.0]])
    q, scale = quantize_int8(x)
    assert scale.tolist() == [1.0, 2.0]
    assert torch.equal(dequantize_int8(q, scale), x)


def test_stochastic_rounding_is_unbiased():
    x = torch.full((1, 20000), 0.3)
    x[0, 0] = 127.0
    q, scale = quantize_int8(x, torch.Generator().manual_seed(0))
    assert abs(dequantize_int8(q, scale)[0, 1:].mean().item() - 0.3) < 0.01


def test_topk_select_keeps_largest():
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.05])
    values, idx = topk_select(x, 0.4)
    assert idx.tolist() == [1, 3] and values.tolist() == [-5.0, 3.0] and idx.dtype == torch.int32


def _plan(**kw) -> Plan:
    base = dict(model="m", hardware="8xh100-sxm", global_batch=8, seq_len=16, dtype="fp32", dp=4, tp=1, pp=1,
                micro_batch=1, stages=uniform_stages(["embedding", "block", "head"], 1))
    return Plan(**{**base, **kw})


def test_compression_options_are_validated_plan_fields():
    plan = _plan(compression="topk")
    assert (plan.topk_fraction, plan.powersgd_rank, plan.stochastic_rounding) == (DEFAULT_TOPK_FRACTION, 4, False)
    assert Plan.from_json(plan.to_json()) == plan
    legacy = plan.model_dump(mode="json")
    for key in ("topk_fraction", "powersgd_rank", "stochastic_rounding"):
        del legacy[key]
    assert Plan.model_validate(legacy) == plan  # plans written before the fields existed: the defaults
    for bad in (dict(topk_fraction=0.0), dict(topk_fraction=1.5), dict(powersgd_rank=0)):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            _plan(**bad)
        with pytest.raises(ValidationError, match=next(iter(bad))):
            plan.with_overrides(**bad)  # overrides are validated too (model_copy would not be)
    changed = plan.with_overrides(topk_fraction=0.1, stochastic_rounding=True)
    assert (changed.topk_fraction, changed.stochastic_rounding, plan.topk_fraction) == (0.1, True, DEFAULT_TOPK_FRACTION)
    config = CompressionConfig.from_plan(_plan(compression="int8", stochastic_rounding=True, powersgd_rank=8), seed=7)
    assert config == CompressionConfig(topk_fraction=DEFAULT_TOPK_FRACTION, stochastic_rounding=True, powersgd_rank=8, seed=7)


def test_compression_refused_with_sharding():
    check_compression(_plan(compression="int8"))
    for kw in (dict(zero=1), dict(zero=2), dict(zero=3)):
        with pytest.raises(PlanError, match="zero"):
            check_compression(_plan(compression="int8", **kw))
    with pytest.raises(PlanError, match="tp"):
        check_compression(_plan(compression="topk", dp=2, tp=2))


# ------------------------------------------------------------------ cost model

def test_int8_wire_bytes_are_a_quarter_of_fp32_and_half_of_bf16():
    n, p = 8, 1e9
    assert wire_bytes_per_rank("int8", p, n, 4) == pytest.approx(wire_bytes_per_rank("none", p, n, 4) / 4)
    assert wire_bytes_per_rank("int8", p, n, 2) == pytest.approx(wire_bytes_per_rank("none", p, n, 2) / 2)
    cluster = hardware.load("64xh100-sxm")
    plan = _plan(dtype="bf16", dp=64, global_batch=64, hardware="64xh100-sxm", compression="int8")
    lay = layout_of(plan, cluster)
    expected = coll.all_reduce(p * 1, lay.dp_group, cluster) + compression_compute_time("int8", p, "bf16", 64, cluster)
    assert dp_time(p, plan, lay) == pytest.approx(expected)
    # DDP under autocast reduces the fp32 gradients autograd made for the fp32 weights; with bf16 ones, bf16
    uncompressed = dp_time(p, plan.model_copy(update={"compression": "none"}), lay)
    assert coll.all_reduce(p * 1, lay.dp_group, cluster) == pytest.approx(uncompressed / 4, rel=0.1)
    bf16_weights = plan.model_copy(update={"compression": "none", "master_dtype": "bf16", "optimizer_dtype": "bf16"})
    assert coll.all_reduce(p * 1, lay.dp_group, cluster) == pytest.approx(dp_time(p, bf16_weights, lay) / 2, rel=0.1)


def test_topk_is_priced_as_an_all_gather_of_values_and_indices():
    cluster = hardware.load("64xh100-sxm")
    p, n, k = 1e9, 64, DEFAULT_TOPK_FRACTION
    plan = _plan(dtype="bf16", dp=n, global_batch=64, hardware="64xh100-sxm", compression="topk")
    lay = layout_of(plan, cluster)
    gathered = n * k * p * (2 + TOPK_INDEX_BYTES)
    assert topk_gathered_bytes(p, n, 2) == pytest.approx(gathered)
    expected = coll.all_gather(gathered, lay.dp_group, cluster) + compression_compute_time("topk", p, "bf16", n, cluster)
    assert dp_time(p, plan, lay) == pytest.approx(expected)
    assert compressed_reduction_time(p, "topk", "bf16", lay.dp_group, cluster) == pytest.approx(expected)
    # the all-gather grows with dp: at k = 1% it loses to int8 beyond ~ dp = 2 / (0.01 * 6) ~ 33
    small = coll.group_of(8, 1, cluster)
    assert compressed_reduction_time(p, "topk", "bf16", small, cluster) < compressed_reduction_time(p, "int8", "bf16", small, cluster)


def test_cost_model_prices_the_plans_k_and_powersgd_rank():
    cluster = hardware.load("64xh100-sxm")
    p, n = 1e9, 64
    base = _plan(dtype="bf16", dp=n, global_batch=64, hardware="64xh100-sxm")
    group = layout_of(base, cluster).dp_group
    for k in (0.01, 0.1):
        plan = base.with_overrides(compression="topk", topk_fraction=k)
        assert plan_reduction_time(p, plan, group, cluster) == pytest.approx(
            compressed_reduction_time(p, "topk", "bf16", group, cluster, topk_fraction=k))
    t = {k: plan_reduction_time(p, base.with_overrides(compression="topk", topk_fraction=k), group, cluster)
         for k in (0.01, 0.1)}
    assert t[0.1] > 5 * t[0.01]  # the all-gather scales with k
    assert wire_bytes_per_rank("topk", p, n, 2, topk_fraction=0.1) == pytest.approx(
        10 * wire_bytes_per_rank("topk", p, n, 2, topk_fraction=0.01))
    # PowerSGD's factors: (m + n) * r of m * n entries, linear in the rank
    assert wire_bytes_per_rank("powersgd", p, n, 2, powersgd_rank=8) == pytest.approx(
        2 * wire_bytes_per_rank("powersgd", p, n, 2, powersgd_rank=4))
    assert wire_bytes_per_rank("powersgd", p, n, 2) == pytest.approx(wire_bytes_per_rank("none", p, n, 2) / 512)
    r8 = plan_reduction_time(p, base.with_overrides(compression="powersgd", powersgd_rank=8), group, cluster)
    r4 = plan_reduction_time(p, base.with_overrides(compression="powersgd", powersgd_rank=4), group, cluster)
    assert r8 > r4


def test_parallax_run_overrides_compression_options_on_the_plan(tmp_path, monkeypatch):
    """--topk-fraction and friends run (and predict) a validated copy of the plan; nothing goes through the environment."""
    import executor.runtime.launch
    from parallax_cli import main

    seen = {}

    def fake_run(plan, config, **launch):
        seen["plan"], seen["config"] = plan, config
        raise SystemExit(0)

    monkeypatch.setattr(executor.runtime.launch, "run", fake_run)
    path = tmp_path / "plan.json"
    path.write_text(_plan(compression="topk").to_json())
    with pytest.raises(SystemExit):
        main(["run", str(path), "--topk-fraction", "0.1", "--stochastic-rounding", "--powersgd-rank", "2", "--seed", "3"])
    assert (seen["plan"].topk_fraction, seen["plan"].stochastic_rounding, seen["plan"].powersgd_rank) == (0.1, True, 2)
    assert seen["config"].seed == 3  # the run's options travel as one validated object
    with pytest.raises(SystemExit):
        main(["run", str(path)])
    assert seen["plan"] == _plan(compression="topk")
    assert main(["run", str(path), "--topk-fraction", "2"]) == 2  # refused before anything starts


def test_compression_pays_on_slow_nics_only():
    """7B over 100 vs 400 Gb/s: int8 shortens the exposed DP reduction more on the slow network
    (priced on the fused stack, whose faster compute hides less of the reduction)."""
    from costmodel import TransformerDims, transformer_workload
    from costmodel.estimate import estimate

    wl = transformer_workload(TransformerDims(name="llama-7b", n_layers=32, hidden=4096, heads=32, ffn_hidden=11008, vocab=32000,
                                              seq_len=4096, gated_mlp=True, dropout=False, biases=False, learned_positions=False))
    gains = {}
    for nic in (100, 400):
        cluster = hardware.load("64xh100-sxm", nic_gbps=nic)
        base = Plan(model="llama-7b", hardware=cluster.spec(), global_batch=64, seq_len=4096, dp=32, tp=1, pp=2,
                    micro_batch=1, stages=uniform_stages([l.kind for l in wl.layers], 2, "none"), stack="fused")
        none = estimate(wl, base, cluster).step_time_s
        int8 = estimate(wl, base.model_copy(update={"compression": "int8"}), cluster).step_time_s
        gains[nic] = (none - int8) / none
    assert gains[100] > 0.05 and abs(gains[400]) < 0.01


def test_planner_picks_compression_only_when_allowed():
    from costmodel import TransformerDims, transformer_workload
    from planner import plan as make_plan

    wl = transformer_workload(TransformerDims(name="gpt-1b", n_layers=16, hidden=2048, heads=16, vocab=32000, seq_len=1024))
    kwargs = dict(global_batch=64, seq_len=1024, time_limit_s=2.0, fixed={"tp": 1, "pp": 1, "zero": 0})
    hw = hardware.load("16xh100-sxm", nic_gbps=25)
    plain = make_plan(wl, hw, **kwargs)
    assert plain.compression == "none"
    lossy = make_plan(wl, hw, allow_compression=True, **kwargs)
    assert lossy.compression in ("int8", "topk")
    assert lossy.estimate.step_time_s < plain.estimate.step_time_s
    assert any("compression" in note for note in lossy.notes)


# ------------------------------------------------------------------ hooks on 4 gloo ranks

def _hook_checks(rank: int, world: int, init: str, err_dir: str) -> None:
    import torch.distributed as dist

    from executor.apply.compression import CompressionState, int8_allreduce, topk_allreduce

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        params = [torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(2, 3))]
        names = {id(p): f"p{i}" for i, p in enumerate(params)}
        n = 12

        def state(method, **kw):
            return CompressionState(method, None, names, CompressionConfig(**kw))

        # int8, no quantisation error: integer gradients, each chunk's max |.| = 127, mean exactly representable
        gen = torch.Generator().manual_seed(1)
        g = torch.randint(-100, 101, (n,), generator=gen).float()
        d = torch.randint(-5, 6, (n,), generator=gen).float()
        g[::n // world] = 127.0
        d[::n // world] = 0.0
        mine = g + (2 * rank - (world - 1)) * d  # sums to world * g over the ranks
        st = state("int8")
        out = int8_allreduce(st, mine.clone(), params)
        assert torch.equal(out, g), (out, g)
        assert all(float(r.abs().max()) == 0 for r in st.residual.values())
        assert st.bytes_sent == 2 * (world - 1) * (n // world) + 2 * (world - 1) * 4

        # int8 error feedback: the residual is exactly what quantisation dropped, and is added next time
        x = torch.randn(n, generator=torch.Generator().manual_seed(10 + rank))
        st = state("int8")
        int8_allreduce(st, x.clone(), params)
        q, s = quantize_int8(x.view(world, n // world))
        assert torch.equal(torch.cat([st.residual["p0"], st.residual["p1"]]), x - dequantize_int8(q, s).flatten())
        before = torch.cat([st.residual["p0"], st.residual["p1"]])
        x2 = torch.randn(n, generator=torch.Generator().manual_seed(20 + rank))
        int8_allreduce(st, x2.clone(), params)
        c2 = x2 + before
        q2, s2 = quantize_int8(c2.view(world, n // world))
        assert torch.equal(torch.cat([st.residual["p0"], st.residual["p1"]]), c2 - dequantize_int8(q2, s2).flatten())

        # top-k with k = 1: every entry sent, the result is the true mean
        x = torch.randn(n, generator=torch.Generator().manual_seed(30 + rank))
        everyone = [torch.empty(n) for _ in range(world)]
        dist.all_gather(everyone, x)
        st = state("topk", topk_fraction=1.0)
        out = topk_allreduce(st, x.clone(), params)
        truth = sum(everyone[1:], everyone[0].clone()) / world
        assert torch.allclose(out, truth, rtol=0, atol=1e-6), (out, truth)
        assert all(float(r.abs().max()) == 0 for r in st.residual.values())
        assert st.bytes_sent == (world - 1) * n * (4 + 4)

        # top-k error feedback: unsent entries carried exactly, and sent next step once they are the largest
        st = state("topk", topk_fraction=0.25)
        out = topk_allreduce(st, x.clone(), params)
        values, idx = topk_select(x, 0.25)
        left = x.clone()
        left[idx.long()] = 0
        residual = torch.cat([st.residual["p0"], st.residual["p1"]])
        assert torch.equal(residual, left)
        sent = x - left
        sums = [torch.empty(n) for _ in range(world)]
        dist.all_gather(sums, sent)
        assert torch.allclose(out, sum(sums[1:], sums[0].clone()) / world, atol=1e-6)
        topk_allreduce(st, torch.zeros(n), params)  # next step: gradient zero, the residual alone is compressed
        values2, idx2 = topk_select(left, 0.25)
        left2 = left.clone()
        left2[idx2.long()] = 0
        assert torch.equal(torch.cat([st.residual["p0"], st.residual["p1"]]), left2)
        # through DDP: hooks registered the executor's way; without anything dropped they give the true mean
        from torch.nn.parallel import DistributedDataParallel as DDP

        from executor.apply.compression import register_compression

        for method in ("topk", "bf16", "fp16", "powersgd", "int8"):
            torch.manual_seed(0)
            plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
            ddp = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)))
            ddp.module.load_state_dict(plain.state_dict())
            plan = _plan(compression=method, dp=world, topk_fraction=1.0, powersgd_rank=2)
            state = register_compression(ddp, plan, None, seed=0)
            assert (state.config.topk_fraction, state.config.powersgd_rank) == (1.0, 2)
            for step in range(3):
                x = torch.randn(5, 8, generator=torch.Generator().manual_seed(100 * step + rank))
                ddp(x).square().sum().backward()
                plain(x).square().sum().backward()
                for p_ddp, p_plain in zip(ddp.parameters(), plain.parameters()):
                    dist.all_reduce(p_plain.grad)
                    truth = p_plain.grad / world
                    if method == "powersgd":  # all-reduces plainly for its first 2 steps, low-rank after
                        tol = 1e-6 if step < 2 else None
                    else:  # relative to the largest entry: k = 1 exact; 16-bit and int8 rounding
                        tol = {"topk": 1e-6, "bf16": 2e-2, "fp16": 2e-3, "int8": 5e-2}[method]
                    if tol is not None:
                        assert torch.allclose(p_ddp.grad, truth, atol=tol * float(truth.abs().max()) + 1e-7), (method, step)
                    p_ddp.grad = None
                    p_plain.grad = None
            assert state.bytes_sent > 0
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.err"), "w") as fh:
            fh.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def test_hooks_reduce_exactly_and_carry_residuals(tmp_path):
    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'pg'}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_hook_checks, args=(r, WORLD, init, str(tmp_path))) for r in range(WORLD)]
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
    finally:
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_before
    errors = [f.read_text() for f in sorted(tmp_path.glob("rank*.err"))]
    assert not errors, errors[0]
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
