"""Files and options from someone else: names are data, bad input is one line and exit 2, a
question is answered as asked, and every command is bounded."""
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from layout.plan import Plan
from executor.runtime.slurm import batch_script
from parallax_cli import main

sys.path.insert(0, str(Path(__file__).parent))
from test_executor import make_plan  # noqa: E402

PAYLOADS = ["tiny\ntouch pwned", "x'; touch pwned; '", "$(touch pwned)", "a;touch pwned", "\x1b[2Jwiped", "`touch pwned`",
            "-rf", "a\"b"]


def _one_line(capsys, argv: list[str], code: int = 2) -> str:
    got = main(argv)
    err = capsys.readouterr().err
    assert got == code and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (got, err)
    assert "internal error" not in err and "\x1b" not in err, err
    return err


@pytest.mark.parametrize("payload", PAYLOADS)
def test_names_with_shell_payloads_are_refused_where_plans_and_profiles_are_read(tmp_path, capsys, payload):
    data = json.loads(make_plan("reference-tiny", dp=2).to_json())
    for field in ("model", "hardware"):
        path = tmp_path / f"{field}.json"
        path.write_text(json.dumps({**data, field: payload}))
        for command in (["simulate", str(path)], ["estimate", "--plan", str(path)], ["launch", str(path), "--slurm",
                                                                                       "--out", str(tmp_path / "s")]):
            assert "is not a safe name" in _one_line(capsys, command)
    profile = json.loads(Path("hardware/catalog/h100-sxm.json").read_text())
    profile["gpu"]["name"] = payload
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    assert "is not a safe name" in _one_line(capsys, ["hardware", "show", str(path)])
    assert not (tmp_path / "s").exists() and not Path("pwned").exists()


def test_the_batch_script_asks_no_gpus_for_a_calibrated_cpu_profile():
    """A plan on a profile `calibrate --device cpu` wrote (named calibrated-cpu, not cpu) runs gloo
    on CPU ranks: its job asks SLURM for no GPUs and sets no NCCL transport."""
    plan = make_plan("reference-tiny", dp=2)
    cluster = plan.cluster()
    calibrated = cluster.model_copy(update={"gpu": cluster.gpu.model_copy(update={"name": "calibrated-cpu"})})
    plan = plan.model_copy(update={"hardware": "2xcalibrated-cpu", "hardware_profile": calibrated})
    text = batch_script(plan, "plan.json", steps=1, checkpoint_dir=None, checkpoint_every=1, max_restarts=0)
    assert "--gpus-per-node" not in text and "NCCL_IB_DISABLE" not in text and "GLOO_SOCKET_IFNAME" in text
    gpu_plan = plan.model_copy(update={"hardware_profile": calibrated.model_copy(update={
        "gpu": calibrated.gpu.model_copy(update={"name": "calibrated-cuda", "device_type": "cuda"})})})
    assert "--gpus-per-node" in batch_script(gpu_plan, "plan.json", steps=1, checkpoint_dir=None, checkpoint_every=1,
                                             max_restarts=0)


def test_the_batch_script_quotes_every_value_and_runs_no_payload(tmp_path):
    """Paths the user names (with spaces, quotes, `$( )` and `;`) reach sbatch quoted: the script
    parses, and run against stand-ins for scontrol and srun it executes nothing else."""
    odd = tmp_path / "a b'$(touch pwned);c"
    odd.mkdir()
    plan_path = odd / "plan $(touch pwned).json"
    plan = make_plan("reference-tiny", dp=2).model_copy(update={"model": "my model (v2)"})
    plan_path.write_text(plan.to_json())
    text = batch_script(plan, str(plan_path), steps=3, checkpoint_dir=str(odd / "ckpt;touch pwned"),
                        checkpoint_every=1, max_restarts=1)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert "#SBATCH --job-name=parallax-my-model--v2-" in text
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("scontrol", "echo node001"), ("srun", 'printf "%s\\n" "$@" > "$SRUN_ARGS"')):
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(stat.S_IRWXU)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node001",
           "SRUN_ARGS": str(tmp_path / "srun.args")}
    assert subprocess.run(["bash", str(script)], cwd=tmp_path, env=env).returncode == 0
    inner = (tmp_path / "srun.args").read_text().splitlines()[-1]  # what each node's bash -c runs
    assert str(plan_path) in subprocess.run(["bash", "-c", f"printf '%s\\n' {inner.removeprefix('exec ')}"],
                                            capture_output=True, text=True, cwd=tmp_path).stdout.splitlines()
    assert not list(tmp_path.rglob("pwned"))


@pytest.mark.parametrize("argv, needle", [
    (["plan", "llama-3-8b", "--hw", "8xh100-sxm", "--global-batch", "64", "--seq-len", "1024", "--tp", "0"], "tp: 0"),
    (["plan", "llama-3-8b", "--hw", "8xh100-sxm", "--global-batch", "99999999999999999999", "--seq-len", "10"],
     "global_batch"),
    (["plan", "llama-3-8b", "--hw", "100000000xh100-sxm", "--global-batch", "64", "--seq-len", "10"], "1,048,576"),
    (["plan", "llama-3-8b", "--hw", "8xh100-sxm", "--global-batch", "64", "--seq-len", "1024", "--time-limit", "nan"],
     "--time-limit"),
    (["plan", "llama-3-8b", "--hw", "8xh100-sxm", "--global-batch", "64", "--seq-len", "1024", "--time-limit", "0"],
     "--time-limit"),
    (["plan", "llama-3-8b", "--hw", "8xh100-sxm", "--global-batch", "64", "--seq-len", "1024", "--time-limit", "-5"],
     "--time-limit"),
    (["serve-plan", "llama-3-8b", "--hw", "8xh100-sxm", "--prompt-len", "100", "--output-len", "10", "--batch",
      "1000000000"], "batch"),
    (["whatif", "llama-3-8b", "--hw", "h100-sxm", "--gpus", "8,,16"], "gpus"),
    (["whatif", "llama-3-8b", "--hw", "h100-sxm", "--gpus", "8,16", "--restart-min", "nan"], "--restart-min"),
    (["hardware", "show", "/dev/zero"], "larger than"),
    (["hardware", "show", "/dev/urandom"], "larger than"),
    (["plan", "llama-3-8b", "--hw", "/dev/zero", "--global-batch", "8", "--seq-len", "64"], "larger than"),
])
def test_bad_options_and_devices_are_one_line_and_exit_2(capsys, argv, needle):
    assert needle in _one_line(capsys, argv)


def _config(**change) -> dict:
    base = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000, "rope_theta": 10000.0}
    return {**base, **change}


@pytest.mark.parametrize("change, needle", [
    ({"num_hidden_layers": 0}, "num_hidden_layers"), ({"num_hidden_layers": 1e9}, "num_hidden_layers"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers"), ({"num_hidden_layers": "2"}, "num_hidden_layers"),
    ({"num_attention_heads": 0}, "num_attention_heads"), ({"num_attention_heads": 3}, "do not divide hidden"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"), ({"vocab_size": 0}, "vocab_size"),
    ({"rope_theta": -1.0}, "rope_theta"),
])
def test_hf_configs_out_of_range_are_one_line(tmp_path, capsys, change, needle):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_config(**change)))
    assert needle in _one_line(capsys, ["plan", str(path), "--hw", "8xh100-sxm", "--global-batch", "8",
                                        "--seq-len", "64"])


@pytest.mark.parametrize("content, needle", [
    ('{"model_type": "llama", "rope_theta": NaN}'.encode(), "NaN"),
    ("{}".encode("utf-16"), "UTF-16"),
    ('{"model": "caf\xe9"}'.encode("latin-1"), "not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),
    (b"", "not valid JSON"),
])
def test_broken_files_are_one_line(tmp_path, capsys, content, needle):
    path = tmp_path / "broken.json"
    path.write_bytes(content)
    for argv in (["simulate", str(path)], ["hardware", "show", str(path)],
                 ["plan", str(path), "--hw", "8xh100-sxm", "--global-batch", "8", "--seq-len", "64"]):
        assert needle in _one_line(capsys, argv)


def test_a_serving_plan_given_to_a_training_command_is_named_as_one(tmp_path, capsys):
    """`serve-plan --out` writes a plan of its own kind: run, simulate and dry-run name it and the
    command that takes it, not the training plan's first missing field."""
    path = tmp_path / "serve.json"
    assert main(["serve-plan", "llama-3.2-1b", "--hw", "1xh100-sxm", "--prompt-len", "256", "--output-len", "32",
                 "--out", str(path)]) == 0
    capsys.readouterr()
    for command in ("run", "simulate", "dry-run"):
        line = _one_line(capsys, [command, str(path)])
        assert "is a serving plan" in line and "parallax export" in line, (command, line)


def test_an_empty_onnx_file_and_an_unwritable_out_are_one_line(tmp_path, capsys):
    (tmp_path / "empty.onnx").write_bytes(b"")
    assert "holds no graph" in _one_line(capsys, ["plan", str(tmp_path / "empty.onnx"), "--hw", "8xh100-sxm",
                                                   "--global-batch", "8", "--seq-len", "64"])
    (tmp_path / "file").write_text("")
    assert "--out" in _one_line(capsys, ["plan", "gpt2", "--hw", "8xh100-sxm", "--global-batch", "8", "--seq-len",
                                         "64", "--out", str(tmp_path / "file" / "plan.json")])


def test_plans_with_impossible_estimates_are_refused(tmp_path, capsys):
    plan = make_plan("reference-tiny", dp=2)
    data = json.loads(plan.to_json())
    path = tmp_path / "plan.json"
    estimate = {"step_time_s": -1.0, "breakdown_s": {}, "tokens_per_s": 1.0, "tflops_per_gpu_model": 1.0,
                "tflops_per_gpu_hw": 1.0, "mfu": 0.1, "peak_memory_bytes": 1.0, "memory_capacity_bytes": 2.0,
                "stages": []}
    path.write_text(json.dumps({**data, "estimate": estimate}))
    assert "estimate.step_time_s" in _one_line(capsys, ["simulate", str(path)])
    path.write_text(json.dumps({**data, "tp": 3}))  # 6 ranks on the plan's 8: priced as written nowhere
    assert "= 6, but 8 GPUs on the hardware" in _one_line(capsys, ["estimate", "--plan", str(path)])
    assert "= 6, but 8 GPUs on the hardware" in _one_line(capsys, ["dry-run", str(path)])
    assert "= 6, but 8 GPUs on the plan's hardware" in _one_line(capsys, ["simulate", str(path)])
    assert main(["simulate", str(path), "--hw", "8xh100-sxm"]) == 0  # a what-if: re-planned, and it says so first
    assert capsys.readouterr().out.startswith("note: re-planned for")


# ---------------------------------------------------------------- code runs only when the user says so

FACTORY = "examples.llama_module:build_tiny"


def test_a_plan_naming_a_module_factory_is_refused_until_trusted(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    plan = make_plan("reference-tiny", dp=2).model_copy(update={"model": FACTORY})
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    for argv in (["simulate", str(path)], ["dry-run", str(path)], ["estimate", "--plan", str(path)],
                 ["run", str(path)], ["launch", str(path), "--slurm", "--out", str(tmp_path / "job.sbatch")],
                 ["run", str(tmp_path / "plain.json"), "--model", FACTORY]):
        (tmp_path / "plain.json").write_text(make_plan("reference-tiny", dp=2).to_json())
        assert "--trust-module" in _one_line(capsys, argv)
    assert main(["simulate", str(path), "--trust-module", "--hw", "2xcpu"]) == 0
    assert main(["launch", str(path), "--slurm", "--out", str(tmp_path / "job.sbatch"), "--trust-module"]) == 0
    assert "--trust-module" in (tmp_path / "job.sbatch").read_text()


# ---------------------------------------------------------------- a question answered as asked

def test_estimate_with_a_plan_answers_what_was_asked_or_refuses_by_name(tmp_path, capsys):
    path = tmp_path / "p.json"
    assert main(["plan", "llama-3-8b", "--hw", "16xh100-sxm", "--global-batch", "64", "--seq-len", "1024",
                 "--time-limit", "1", "--out", str(path), "--json"]) == 0
    capsys.readouterr()
    assert "differs from the plan's llama-3-8b" in _one_line(capsys, ["estimate", "mistral-7b", "--plan", str(path)])
    err = _one_line(capsys, ["estimate", "--plan", str(path), "--global-batch", "999", "--tp", "8", "--seq-len", "7"])
    assert "--global-batch, --seq-len, --tp" in err
    assert "16 GPUs" in _one_line(capsys, ["estimate", "--plan", str(path), "--hw", "8xa100-80g"])
    assert main(["estimate", "--plan", str(path), "--hw", "16xa100-80g"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "re-priced on 16xa100-80g, not the plan's 16xh100-sxm (--hw)"
    assert lines[1].startswith("llama-3-8b on 16xa100-80g")


# ---------------------------------------------------------------- bounded, and output for pipes

def test_divisors_match_the_definition():
    from planner.search.space import divisors

    for n in (*range(1, 200), 2**20, 1_000_000, 999_983, 720_720):
        assert list(divisors(n)) == [d for d in range(1, n + 1) if n % d == 0]


def test_the_time_limit_cuts_the_enumeration_and_no_bound_is_claimed():
    import planner

    plan = planner.plan("llama-3-8b", "1048576xh100-sxm", global_batch=1048576, seq_len=4096, time_limit_s=0.05)
    assert plan.solver.gap is None and "time limit" in plan.solver.notes[0]
    assert plan.estimate.fits


def test_a_long_step_played_at_two_lengths_matches_the_whole_step():
    """The simulator plays a step of many identical micro-batches at two short lengths and carries
    the difference on: it matches playing all of them."""
    import hardware
    from layout.plan import uniform_stages
    from costmodel.autocast import under_autocast
    from costmodel.simulate import playback
    from costmodel.simulate.step import simulate
    from costmodel.simulate.repeat import carried, shortened
    from planner.resolve import resolve_workload

    cluster = hardware.load("16xh100-sxm")
    workload = resolve_workload("llama-160m", seq_len=512, dtype="bf16", cluster=cluster)
    kinds = [layer.kind for layer in workload.layers]
    for dp, tp, pp, zero, schedule, vpp in [(4, 1, 4, 1, "1f1b", 1), (2, 2, 4, 0, "interleaved", 2),
                                            (8, 1, 2, 0, "gpipe", 1), (16, 1, 1, 3, "1f1b", 1), (4, 2, 2, 2, "1f1b", 1)]:
        plan = Plan(model="llama-160m", hardware="16xh100-sxm", global_batch=96 * dp, seq_len=512, dp=dp, tp=tp,
                    pp=pp, zero=zero, micro_batch=1, schedule=schedule, vpp=vpp,
                    stages=uniform_stages(kinds, pp * vpp, "none"))
        whole = simulate(workload, plan, cluster)
        a, b = 24, 24 + (pp if schedule == "interleaved" else 1)
        run = under_autocast(workload, plan)  # what `simulate` plays: the layers as this plan runs them
        short, longer = (playback._play_uniform(run, shortened(plan, m), cluster.for_stack(plan.stack), 25e6) for m in (a, b))
        got = carried(short, longer, a, b, plan)
        # the once-per-step gradient reduction overlaps the last micro-batches' backward differently at 24 and
        # 25 of them than at 96: carried within 0.5% (fp32 gradients on the wire, DDP's and FSDP2's replicate;
        # GPipe's dp8 pp2 carries -0.45%)
        assert got.step_time_s == pytest.approx(whole.step_time_s, rel=5e-3)
        assert got.peak_memory_bytes == pytest.approx(whole.peak_memory_bytes, rel=1e-3)
        assert got.mfu == pytest.approx(whole.mfu, rel=5e-3) and got.played_micro_batches == b
        # each micro-batch's share of the once-a-step work (autocast's first cast, adding the gradients of all but
        # the first into .grad: `costmodel.layout.context_of`) is 1/24 and 23/24 of it played, 1/96 and 95/96 whole:
        # the bubble carried is 1.4% (relative) off for dp4 pp4 ZeRO-1
        assert got.bubble_fraction == pytest.approx(whole.bubble_fraction, rel=2e-2, abs=1e-4)


def test_piped_tables_keep_each_line_whole(capsys):
    assert main(["plan", "llama-3-8b", "--hw", "64xh100-sxm", "--global-batch", "512", "--seq-len", "8192",
                 "--time-limit", "2"]) == 0
    out = capsys.readouterr().out
    for line in out.splitlines():
        if "schedule=" in line:
            assert not line.rstrip(" │").endswith("schedule="), line
    assert any("schedule=" in line and "micro_batch=" in line for line in out.splitlines())


def test_a_pin_that_does_not_fit_is_named(capsys):
    err = _one_line(capsys, ["plan", "llama-3-70b", "--hw", "8xh100-sxm", "--global-batch", "64", "--seq-len", "8192",
                             "--recompute", "none", "--time-limit", "2"])
    assert "with the pinned recompute=none" in err and "recompute=full" in err
