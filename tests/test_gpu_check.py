"""benchmarks/gpu_check.py keeps working where there is no GPU: the same loop on CPU ranks
(a catalog profile in place of the calibration, which tests/test_profile.py covers)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_check  # noqa: E402


def test_the_gpu_check_runs_a_recomputed_and_an_offloaded_plan_on_cpu(capsys):
    """Two of its five plans (the suite's time): op-level recomputation and the offloaded one."""
    assert gpu_check.main(["--device", "cpu", "--profile", "1xcpu", "--steps", "2", "--plans", "op,offloaded",
                           "--model", "hf-llama-tiny", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"(none|selective|op|full)", line)]
    assert [r.split()[0] for r in rows] == ["op", "none,"], out
    for line in rows:
        numbers = re.findall(r"[+-]?[\d,]+\.?\d*%?", line.split(" ", 1)[1] if "offloaded" not in line else line.split("offloaded")[1])
        assert len(numbers) == 9 and "did not run" not in line, line
