"""Ctrl-C and SIGTERM stop everything a command started, in one line and with the shell's code.

Each case runs `parallax` as the user does, in a folder of its own that holds a
`sitecustomize.py`: the current folder is never on the workers' path, so it must not run.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from executor.runtime.launch import worker_env
from executor.runtime.process_tree import descendants

sys.path.insert(0, str(Path(__file__).parent))
from test_executor import make_plan  # noqa: E402

PARALLAX = [sys.executable, "-m", "parallax_cli"]
PROJECT = str(Path(__file__).resolve().parents[1])
WAIT_S = 120  # how long a worker may take to start before the test gives up (a bound, not a speed target)


def _start(args: list[str], folder: Path) -> subprocess.Popen:
    (folder / "sitecustomize.py").write_text(f"open({str(folder / 'ran')!r}, 'w').write('current folder ran')\n")
    env = {**os.environ, "TMPDIR": str(folder), "PYTHONPATH": PROJECT}
    # SIGINT as a terminal gives it: a test run started in the background inherits it ignored
    return subprocess.Popen(PARALLAX + args, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _cpu_seconds(pid: int) -> float:
    """The CPU time `pid` has used (what it has done, whatever else loads the machine)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _workers(folder: Path) -> list[int]:
    """The pids whose command line names this test's folder (torchrun and its workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(folder) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in found if pid != os.getpid()]


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_torchrun_and_every_worker(tmp_path, signum, code):
    plan = tmp_path / "plan.json"
    plan.write_text(make_plan("reference-tiny", dp=2).to_json())
    proc = _start(["run", str(plan), "--steps", "100000", "--checkpoint-dir", str(tmp_path / "ckpt"),
                   "--checkpoint-every", "5"], tmp_path)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and not (tmp_path / "ckpt" / "step-00000005").exists():
        time.sleep(0.2)
    assert (tmp_path / "ckpt" / "step-00000005").exists(), proc.stderr.read() if proc.poll() is not None else ""
    tree = descendants(proc.pid)
    assert len(tree) >= 3  # torchrun and two workers
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == code, err
    assert len(err.strip().splitlines()) == 1 and f"interrupted by {signal.Signals(signum).name}" in err, err
    time.sleep(0.5)
    left = [pid for pid in tree if Path(f"/proc/{pid}").exists()
            and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert not left and not _workers(tmp_path), f"still running: {left}"
    assert not (tmp_path / "ran").exists(), "the current folder's sitecustomize.py ran"
    complete = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-"))
    assert complete and all((tmp_path / "ckpt" / name / "manifest.json").exists() for name in complete)


def test_ctrl_c_on_any_command_exits_130(tmp_path):
    """A sweep of ten plans (several seconds each here) interrupted after its imports."""
    proc = _start(["whatif", "llama-3-70b", "--hw", "h100-sxm", "--hw", "a100-80g", "--gpus", "64,128,256,512,1024",
                   "--global-batch", "1024", "--seq-len", "8192"], tmp_path)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and _cpu_seconds(proc.pid) < 4.0:  # past its imports, into the sweep
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 130 and err.strip().splitlines() == ["interrupted"], err


def test_the_workers_path_holds_the_project_never_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    env = worker_env("reference-tiny", 2, trust_module=True)
    assert env["PYTHONPATH"].split(os.pathsep) == [PROJECT] and env["PYTHONSAFEPATH"] == "1"
    monkeypatch.chdir(PROJECT)  # a trusted factory's own folder joins it
    env = worker_env("examples.llama_module:build_tiny", 2, trust_module=True)
    assert env["PYTHONPATH"].split(os.pathsep) == [PROJECT, PROJECT]
    assert worker_env("examples.llama_module:build_tiny", 2, trust_module=False)["PYTHONPATH"] == PROJECT
