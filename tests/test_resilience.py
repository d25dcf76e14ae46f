"""Long runs survive: every layout checkpoints and resumes bit for bit, a checkpoint
resumes on any other layout, a lost node shrinks the job (re-planned), and a plan runs
across nodes through torchrun's c10d rendezvous and a SLURM batch script (CPU, gloo,
nodes on 127.0.0.1)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import hardware
from layout.plan import Plan, uniform_stages
from executor.runtime.config import RunConfig
from executor.runtime.launch import Nodes, run
from planner.search.space import layouts, to_plan
from planner.trace.workload_for import workload_for
from test_executor import make_plan
from faults import killing
from test_fault_tolerance import assert_identical, saved_state

KINDS = ["embedding"] + ["block"] * 4 + ["head"]
GLOBAL_BATCH, SEQ = 8, 16
ROOT = Path(__file__).resolve().parents[1]


def tiny(cluster: str = "4xcpu", **layout) -> Plan:
    values = dict(dp=1, tp=1, pp=1, zero=0, vpp=1, schedule="1f1b", sp=False)
    values.update(layout)
    n = values["pp"] * values["vpp"]
    mb = GLOBAL_BATCH // (values["dp"] * max(2, values["pp"]))
    return Plan(model="reference-tiny", hardware=cluster, global_batch=GLOBAL_BATCH, seq_len=SEQ, dtype="fp32",
                micro_batch=max(1, mb), stages=uniform_stages(KINDS, n), **values)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------ kill and resume, drawn layouts

def _space() -> list:
    workload, _ = workload_for("reference-tiny", seq_len=SEQ, dtype="fp32")
    cluster = hardware.load("4xcpu")
    return sorted(layouts(workload, cluster, GLOBAL_BATCH), key=repr), workload, cluster


@settings(max_examples=1, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.generate])
@given(data=st.data())
def test_drawn_layouts_killed_mid_run_resume_bit_identical(data, tmp_path_factory):
    """A layout drawn from the planner's space: one rank SIGKILLs itself mid-step, torchrun
    restarts the job, it resumes from the last checkpoint and ends with the uninterrupted run's
    losses and weights, bit for bit."""
    space, workload, cluster = _space()
    drawn = [data.draw(st.sampled_from(space))]
    plans = [to_plan(layout, workload, cluster, global_batch=GLOBAL_BATCH, dtype="fp32", recompute="none",
                            model="reference-tiny")
             for layout in drawn]
    # the interleaved pipeline's (the 175B pick's shape) and expert parallelism's checkpoints are saved and
    # resumed by test_a_checkpoint_resumes_on_another_layout; the kill-and-restart path is the same (suite time)
    for plan in plans:
        tmp = tmp_path_factory.mktemp("kill")
        whole = run(plan, RunConfig(steps=6, checkpoint_every=2, checkpoint_dir=str(tmp / "whole")), timeout_s=600)
        killed = run(plan, RunConfig(steps=6, checkpoint_every=2, checkpoint_dir=str(tmp / "killed"), max_restarts=1,
                                     step_hook=killing([3], rank=plan.n_gpus - 1)), timeout_s=600)
        assert any("resumed from step-00000002" in n for n in killed.notes), (plan.layout_tag, killed.notes)
        assert killed.losses == whole.losses[2:], plan.layout_tag
        assert_identical(saved_state(tmp / "whole" / "step-00000006", tmp),
                         saved_state(tmp / "killed" / "step-00000006", tmp))


# ------------------------------------------------------------------ resume on another layout

MOE_SOURCE = make_plan("hf-mixtral-tiny", dp=4, ep=2, zero=3, micro_batch=GLOBAL_BATCH // 8)
SOURCES = {"pp-interleaved-z1": tiny(dp=2, pp=2, vpp=2, schedule="interleaved", zero=1),
           "tp-fsdp-z2": tiny(dp=2, tp=2, zero=2), "moe-ep2-z3": MOE_SOURCE}
PAIRS = [("pp-interleaved-z1", tiny(dp=2, tp=2, zero=3), "resharded from dp2 pp2 interleaved v2 zero1 to dp2 tp2 zero3"),
         ("tp-fsdp-z2", tiny(dp=2, pp=2, zero=3), "resharded from dp2 tp2 zero2 to dp2 pp2 1f1b zero3"),
         # FSDP2's moments into ZeRO-1's rows of tensor-parallel weights (executor/apply/zero_one.py)
         ("tp-fsdp-z2", tiny(dp=2, tp=2, zero=1), "resharded from dp2 tp2 zero2 to dp2 tp2 zero1"),
         ("moe-ep2-z3", make_plan("hf-mixtral-tiny", dp=2, tp=2, zero=2), "resharded from dp4 ep2 zero3 to dp2 tp2 zero2")]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    out = {}
    for name, plan in SOURCES.items():
        folder = tmp_path_factory.mktemp(name) / "ckpt"
        out[name] = (folder, run(plan, RunConfig(steps=6, checkpoint_dir=str(folder), checkpoint_every=2), timeout_s=600))
    return out


@pytest.mark.parametrize("source,target,line", PAIRS, ids=[f"{s}->{t.layout_tag}" for s, t, _ in PAIRS])
def test_a_checkpoint_resumes_on_another_layout(sources, tmp_path, source, target, line):
    folder, whole = sources[source]
    work = tmp_path / "ckpt"
    shutil.copytree(folder / "step-00000004", work / "step-00000004")
    report = run(target, RunConfig(steps=6, checkpoint_dir=str(work), checkpoint_every=2), timeout_s=600)
    assert report.notes[0] == line, report.notes
    assert report.losses == pytest.approx(whole.losses[4:], abs=1e-5)
    assert report.plan["ep"] == target.ep


# ------------------------------------------------------------------ several nodes

def two_node_plan() -> Plan:
    """The 175B pick's shape on two 2-rank nodes (a profile of 2 CPU ranks per node)."""
    return tiny("4xcpu", dp=2, pp=2, vpp=2, schedule="interleaved", zero=1).model_copy(
        update={"hardware_profile": hardware.load("4xcpu", gpus_per_node=2)})


def start_nodes(plan_path: Path, workdir: Path, steps: int, nnodes: str, port: int, extra=()) -> list[subprocess.Popen]:
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "parallax_cli", "run", str(plan_path), "--steps", str(steps), "--nproc", "2",
               "--nnodes", nnodes, "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}", *extra]
        procs.append(subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    return procs


NODE_LOSS_STEPS = 12


@lru_cache(maxsize=1)
def one_node_losses() -> tuple[float, ...]:
    """The two-node plan's losses run on one node, the reference of every multi-node run here
    (the first steps of a longer run are the shorter run's: a fixed learning rate and seed)."""
    return tuple(run(two_node_plan(), RunConfig(steps=NODE_LOSS_STEPS), timeout_s=600).losses)


def _tree(pid: int) -> list[int]:
    """`pid` and every process under it (torchrun's workers run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def test_a_node_dies_and_the_job_goes_on_replanned(tmp_path):
    """Two 2-rank nodes under torchrun's elastic agent (--nnodes 1:2); node 1's agent and
    workers are killed once a checkpoint exists; node 0's agent restarts on the 2 ranks left,
    the planner re-plans, the checkpoint is resharded, and the losses follow the whole run's."""
    plan = two_node_plan()
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    steps, whole = NODE_LOSS_STEPS, one_node_losses()
    procs = start_nodes(path, tmp_path, steps, "1:2", free_port(),
                        ["--checkpoint-dir", "ckpt", "--checkpoint-every", "2", "--max-restarts", "2",
                         "--rdzv-last-call", "2"])
    deadline = time.time() + 300
    while not (tmp_path / "ckpt" / "step-00000004").exists():
        assert time.time() < deadline and procs[0].poll() is None, "no checkpoint written"
        time.sleep(0.05)
    for pid in _tree(procs[1].pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    output = procs[0].communicate(timeout=600)[0]
    assert procs[0].returncode == 0, output
    assert "elastic re-plan for 2 ranks: the planner picked" in output, output
    assert "resharded from dp2 pp2 interleaved v2 zero1 to" in output
    resumed = next(line for line in output.splitlines() if line.startswith("losses: "))
    values = [float(v) for v in resumed[len("losses: "):].split(", ")]
    assert values == pytest.approx(whole[steps - len(values):], abs=1e-4)
    assert len(values) < steps


def test_the_slurm_script_passes_bash_and_trains_under_a_stand_in_srun(tmp_path):
    """`parallax launch --slurm`: bash -n accepts it; run with a stand-in srun that starts one
    task per node on this machine (and a stand-in scontrol naming 127.0.0.1), both nodes train
    and print the one-node run's losses. The script runs `parallax run --nnodes 2 --node-rank
    $SLURM_NODEID` on each node: the README's two-node command, under torchrun's c10d rendezvous."""
    plan = two_node_plan()
    path, script = tmp_path / "plan.json", tmp_path / "job.sbatch"
    path.write_text(plan.to_json())
    done = subprocess.run([sys.executable, "-m", "parallax_cli", "launch", str(path), "--slurm", "--out", str(script),
                           "--steps", "4", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2",
                           "--rdzv-port", str(free_port())], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    text = script.read_text()
    assert "#SBATCH --nodes=2" in text and "--nproc 2" in text and "--max-restarts 3" in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n# stand-in: --nodes=N starts N local tasks, SLURM_NODEID 0..N-1\n"
        "n=1; while [[ $1 == --* ]]; do [[ $1 == --nodes=* ]] && n=${1#--nodes=}; shift; done\n"
        "for ((i = 0; i < n; i++)); do SLURM_NODEID=$i \"$@\" > task$i.log 2>&1 & done; wait\n"
        "cat task*.log\n")
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "stand-in",
           "SLURM_JOB_ID": "7", "PYTHONPATH": str(ROOT)}
    ran = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    expected = "losses: " + ", ".join(f"{l:.4f}" for l in one_node_losses()[:4])
    assert ran.stdout.count(expected) == 2, ran.stdout
    assert (tmp_path / "ckpt" / "step-00000004" / "manifest.json").exists()


# ------------------------------------------------------------------ goodput picks the interval

def test_the_plan_carries_its_checkpoint_interval_and_run_uses_it(tmp_path, capsys):
    import planner
    from parallax_cli.run_cmd import checkpoint_interval

    plan = planner.plan("llama-3-70b", "64xh100-sxm", global_batch=1024, seq_len=8192, top_k=1)
    advice = plan.checkpointing
    assert advice is not None and 0.9 < advice.goodput < 1
    assert advice.every_steps == round(advice.interval_s / plan.estimate.step_time_s)
    assert "storage_gbps_per_node" in hardware.load("64xh100-sxm").sources
    shorter = planner.plan("llama-3-70b", "64xh100-sxm", global_batch=1024, seq_len=8192, top_k=1, mtbf_hours=5000)
    assert shorter.checkpointing.every_steps < advice.every_steps  # more failures: save more often
    assert checkpoint_interval(plan, tmp_path, None) == advice.every_steps
    assert "Young/Daly" in capsys.readouterr().out
    assert checkpoint_interval(plan, tmp_path, 7) == 7 and checkpoint_interval(plan, None, None) == 0


def test_nodes_are_validated_in_one_line():
    from hardware.errors import PlanError

    for bad in (dict(nnodes="2:1"), dict(nnodes="x"), dict(nnodes="2"), dict(nnodes="2", rdzv_endpoint="h"),
                dict(nnodes="2", node_rank=2, rdzv_endpoint="h:1")):
        with pytest.raises(PlanError):
            Nodes(**bad)
    args = Nodes(nnodes="1:2", node_rank=1, rdzv_endpoint="h:29500").torchrun_args()
    assert args[args.index("--rdzv-backend") + 1] == "c10d" and "is_host=0" in args[-1]
    assert Nodes().torchrun_args() == ["--standalone"]
