"""A profiled run: every rank's torch.profiler trace, the phases of its steps beside the
simulator's, one merged Chrome trace and the HTML run report."""
from __future__ import annotations

import json

from costmodel.simulate.measured import RankTrace, phase_of, step_phases
from parallax_cli import main
from test_resilience import tiny


def test_each_instant_of_a_step_goes_to_the_innermost_named_range():
    events = [dict(name="parallax.step.7", ts=0, dur=100, tid=1), dict(name="parallax.forward", ts=0, dur=30, tid=1),
              dict(name="_c10d_functional::all_reduce", ts=10, dur=5, tid=1),
              dict(name="parallax.backward", ts=30, dur=50, tid=1), dict(name="FSDP::all_gather", ts=40, dur=10, tid=1),
              dict(name="gloo:all_reduce", ts=0, dur=100, tid=2),  # gloo's own thread: not the training thread
              dict(name="parallax.optimizer", ts=85, dur=10, tid=1)]
    trace = RankTrace(rank=0, steps={7: (0, 100)}, events=events, main_tid=1)
    phases = {k: round(v * 1e6) for k, v in step_phases(trace, 7).items() if v}
    assert phases == {"forward": 25, "tp": 5, "backward": 40, "zero gather": 10, "optimizer": 10, "idle": 10}
    assert phase_of("PP:1F0") == "forward" and phase_of("c10d::send") == "pp" and phase_of("aten::mm") is None
    assert phase_of("_c10d_functional::all_gather_into_tensor", cp=True) == "cp"


def test_a_profiled_run_writes_the_merged_trace_the_phase_table_and_the_report(tmp_path, capsys):
    plan = tiny(dp=2, pp=2, zero=3)
    path, folder = tmp_path / "plan.json", tmp_path / "prof"
    path.write_text(plan.to_json())
    assert main(["run", str(path), "--steps", "5", "--profile-dir", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("phases per step of rank") for line in out)
    assert out[-2].startswith("largest miss: ") and "predicted" in out[-2]
    assert sorted(p.name for p in folder.glob("rank*.json")) == [f"rank{r:05d}.json" for r in range(4)]
    merged = json.loads((folder / "trace.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in merged if e.get("name") == "process_name"}
    assert {f"measured rank {r}" for r in range(4)} <= names and any(n.startswith("predicted pp rank") for n in names)
    steps = [e for e in merged if e.get("ph") == "X" and e["name"].startswith("parallax.step.")]
    assert len(steps) == 4 * 3  # three profiled steps on each rank
    page = (folder / "report.html").read_text()
    assert "<table>" in page and "data:image/png;base64," in page and "largest miss" in page


def test_the_report_draws_one_collection_per_lane_and_phase_however_many_segments():
    """A profiled step of a real model has thousands of segments; a bar each took minutes to draw."""
    from types import SimpleNamespace

    from planner.run_report import timelines

    events, steps = [], {}
    for step in range(3):
        lo = step * 10_000
        steps[step] = (lo, lo + 10_000)
        events.append(dict(name=f"parallax.step.{step}", ts=lo, dur=10_000, tid=1))
        for i in range(500):  # forward, then idle between, 500 times a step
            events.append(dict(name="parallax.forward", ts=lo + 20 * i, dur=10, tid=1))
    traces = [RankTrace(rank=r, steps=steps, events=events, main_tid=1) for r in range(2)]
    sim = SimpleNamespace(ranks=[0], step_time_s=0.01, events=[
        SimpleNamespace(rank=0, stream="compute", kind="forward", start=i * 1e-4, duration=5e-5) for i in range(300)])
    fig = timelines(traces, sim)
    top, bottom = fig.axes
    assert len(top.collections) == 2 * 2  # two ranks x (forward, idle)
    assert len(bottom.collections) == 1
    assert sum(len(c.get_paths()) for c in top.collections) >= 2 * 3 * 500
    assert sorted(t.get_text() for t in fig.legends[0].get_texts()) == ["forward", "idle"]
