"""Fault injection for the restart tests, through the run's step hook (RunConfig.step_hook):
the production code knows a hook, never a fault. The workers import this module by name,
from the project folder on their path."""
from __future__ import annotations

import os
import signal

from executor.runtime.config import StepHook


def kill_at(steps: list[int], rank: int):
    """On torchrun attempt i (0 first), rank `rank` SIGKILLs itself mid-step (after the
    backward, before the update) at step `steps[i]`; other ranks and later attempts run on."""
    def on_step(step: int, this_rank: int, attempt: int) -> None:
        if this_rank == rank and attempt < len(steps) and step == steps[attempt]:
            os.kill(os.getpid(), signal.SIGKILL)
    return on_step


def killing(steps: list[int], rank: int) -> StepHook:
    return StepHook(function="tests.faults:kill_at", arguments={"steps": steps, "rank": rank})
