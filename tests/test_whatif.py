"""What-if sweeps, dollars, Amdahl fit, plots, the HTML report and the simulate/whatif CLI."""
from __future__ import annotations

import json

import pytest

import hardware
import planner
from costmodel import TransformerDims, estimate, transformer_workload
from layout.plan import Plan
from layout.plan import uniform_stages
from costmodel.simulate.step import simulate
from hardware.errors import InfeasibleError
from parallax_cli import main
from planner.whatif import amdahl_serial_fraction, whatif

SMALL = TransformerDims(n_layers=16, hidden=2048, heads=16, vocab=32000, seq_len=2048, gated_mlp=True,
                        ffn_hidden=5632, biases=False, learned_positions=False, name="small")
BIG = TransformerDims(n_layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=128256, seq_len=4096,
                      gated_mlp=True, biases=False, learned_positions=False, name="big")
WORKLOADS = {"small": transformer_workload(SMALL), "big": transformer_workload(BIG)}


def enumerate_plan(model, cluster, *, global_batch, seq_len, dtype="bf16"):
    """A stand-in planner: the fastest fitting uniform 1F1B layout among a few, priced by `estimate`."""
    w = model if not isinstance(model, str) else WORKLOADS[model]
    kinds = [layer.kind for layer in w.layers]
    n, best = cluster.n_gpus, None
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4):
            if n % (tp * pp) or global_batch % (n // (tp * pp)):
                continue
            dp = n // (tp * pp)
            plan = Plan(model=w.name, hardware=cluster.spec(), global_batch=global_batch, seq_len=seq_len,
                        dp=dp, tp=tp, pp=pp, zero=1 if dp > 1 else 0, micro_batch=1,
                        stages=uniform_stages(kinds, pp, "selective"))
            est = estimate(w, plan, cluster)
            if est.fits and (best is None or est.step_time_s < best.estimate.step_time_s):
                best = plan.model_copy(update={"estimate": est})
    if best is None:
        raise InfeasibleError("hw", f"nothing fits on {cluster.spec()}")
    return best


def sweep(**kw):
    kw.setdefault("global_batch", 64)
    kw.setdefault("seq_len", 2048)
    return whatif(kw.pop("model", "small"), kw.pop("specs", ["h100-sxm"]), kw.pop("gpus", [8, 16, 32]),
                  plan_fn=enumerate_plan, **kw)


def test_one_row_per_target_with_dollars():
    rows = sweep(specs=["h100-sxm", "a100-80g"], tokens=1e11, price_per_gpu_hour=2.5)
    assert [(r.gpu, r.n_gpus) for r in rows] == [(g, n) for g in ("h100-sxm", "a100-80g") for n in (8, 16, 32)]
    for r in rows:
        assert r.feasible and r.plan.n_gpus == r.n_gpus
        assert r.time_to_train_s == pytest.approx(1e11 / r.tokens_per_s)
        assert r.usd_to_train == pytest.approx(2.5 * r.n_gpus * r.time_to_train_s / 3600)
        assert r.usd_per_million_tokens == pytest.approx(r.usd_to_train / 1e5)
        assert 0 <= r.memory_headroom < 1 and 0 < r.mfu < 1
    h100 = [r for r in rows if r.gpu == "h100-sxm"]
    assert h100[0].scaling_efficiency == 1.0
    assert h100[-1].tokens_per_s > h100[0].tokens_per_s


def test_catalog_price_is_used_unless_overridden():
    rows = sweep(gpus=[8], tokens=1e10)
    catalog = hardware.load("8xh100-sxm").price_per_gpu_hour
    assert rows[0].price_per_gpu_hour == catalog
    if catalog is not None:
        assert rows[0].usd_per_million_tokens == pytest.approx(catalog * 8 / 3600 / rows[0].tokens_per_s * 1e6)


def test_target_where_nothing_fits_keeps_its_row():
    rows = sweep(model="big", specs=["v100-32g"], gpus=[8], seq_len=BIG.seq_len)
    assert len(rows) == 1 and not rows[0].feasible
    assert any("nothing fits" in note for note in rows[0].notes) and rows[0].step_time_s is None and rows[0].layout == "-"


@pytest.mark.parametrize("knob", ["nic_gbps", "intra_gbps"])
def test_more_bandwidth_never_slows_a_step(knob):
    values = (50, 200, 800) if knob == "nic_gbps" else (100, 450, 1800)
    steps = [[r.step_time_s for r in sweep(gpus=[16, 32], **{knob: v})] for v in values]
    for slower, faster in zip(steps, steps[1:]):
        assert all(f <= s * (1 + 1e-12) for s, f in zip(slower, faster))
    assert steps[-1] != steps[0]  # the knob reaches the step at all


def test_simulated_step_is_monotone_in_nic_bandwidth():
    w = WORKLOADS["big"]
    kinds = [layer.kind for layer in w.layers]
    last = None
    for nic in (100, 200, 400, 800, 1600):
        hw = hardware.load("64xh100-sxm", nic_gbps=nic)
        plan = Plan(model="big", hardware=hw.spec(), global_batch=64, seq_len=4096, dp=4, tp=8, pp=2, zero=1,
                    micro_batch=1, stages=uniform_stages(kinds, 2, "selective"))
        step = simulate(w, plan, hw).step_time_s
        assert last is None or step <= last * (1 + 1e-12)
        last = step


def test_amdahl_fit_recovers_the_serial_fraction():
    gpus = [8, 16, 32, 64, 128]
    for s in (0.0, 0.05, 0.3):
        time_per_token = [s + (1 - s) * 8 / n for n in gpus]
        assert amdahl_serial_fraction(gpus, [1 / t for t in time_per_token]) == pytest.approx(s, abs=1e-9)
    assert amdahl_serial_fraction([8], [1.0]) is None


def test_plots_and_report_are_self_contained(tmp_path):
    from planner.plots import breakdown_bars, memory_breakdown, pipeline_timeline, png_bytes, save_png, scaling_curves
    from planner.report import html_report, whatif_report

    rows = sweep(tokens=1e10, price_per_gpu_hour=2.0)
    html = whatif_report(rows)
    assert html.count("data:image/png;base64,") == 2 and html.count("<tr>") == len(rows) + 1
    assert "src=\"http" not in html and "<script" not in html
    plan = rows[-1].plan
    sim = simulate(WORKLOADS["small"], plan, hardware.load("32xh100-sxm"))
    figures = [pipeline_timeline(sim), memory_breakdown(sim, 80e9), breakdown_bars([("sim", sim.breakdown_s)]),
               scaling_curves(rows)]
    for fig in figures:
        assert png_bytes(fig).startswith(b"\x89PNG")
    assert save_png(scaling_curves(rows), tmp_path / "s.png").read_bytes().startswith(b"\x89PNG")
    assert "Simulated step" in html_report("t", sim=sim)


# --- CLI ------------------------------------------------------------------------------

@pytest.fixture
def stub_planner(monkeypatch):
    """The CLI through the real command modules, with the stand-in planner and analytic workloads."""
    import parallax_cli.simulate_cmd as simulate_cmd

    monkeypatch.setattr(planner, "plan", enumerate_plan)
    monkeypatch.setattr(simulate_cmd, "load_workload", lambda plan, cluster: WORKLOADS[plan.model])


def test_whatif_cli_prints_a_table_and_writes_files(stub_planner, tmp_path, capsys):
    code = main(["whatif", "small", "--hw", "h100-sxm", "--hw", "a100-80g", "--gpus", "8,16", "--global-batch", "64",
                 "--seq-len", "2048", "--tokens", "1e10", "--price-per-gpu-hour", "2", "--plot", str(tmp_path / "p.png"),
                 "--report", str(tmp_path / "r.html")])
    out = capsys.readouterr().out
    assert code == 0 and "16xa100-80g" in out and "$/1M tok" in out
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")
    assert "<table>" in (tmp_path / "r.html").read_text()


def test_whatif_cli_rejects_bad_counts_in_one_line(stub_planner, capsys):
    assert main(["whatif", "small", "--hw", "h100-sxm", "--gpus", "8,x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: gpus:") and err.count("\n") == 1


def test_simulate_cli_replans_on_other_hardware(stub_planner, tmp_path, capsys):
    plan = enumerate_plan("small", hardware.load("16xh100-sxm"), global_batch=64, seq_len=2048)
    path = tmp_path / "plan.json"
    path.write_text(plan.model_copy(update={"model": "small"}).to_json())
    trace = tmp_path / "trace.json"
    assert main(["simulate", str(path), "--trace", str(trace), "--plot", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    assert "re-planned" not in out and "simulated" in out
    assert any(e["ph"] == "X" for e in json.loads(trace.read_text())["traceEvents"])
    assert main(["simulate", str(path), "--hw", "8xh100-sxm", "--report", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out
    assert "re-planned for 8xh100-sxm" in out
    assert "data:image/png;base64," in (tmp_path / "r.html").read_text()
