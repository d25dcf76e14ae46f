"""torch.profiler over a few steps of every rank, with the step and its phases marked.

`parallax run --profile-dir D` records the last PROFILED_STEPS steps of the run (after the
memory-tracked warm-up steps) and writes D/rank00003.json, a Chrome trace per rank. Each
step is a `parallax.step.N` range, and the loop marks its phases (`parallax.forward`,
`parallax.backward`, `parallax.sync`, `parallax.optimizer`), so the measured timeline can be
laid beside the simulator's (costmodel/simulate/measured.py). Profiled steps are left out of
the reported step time when other steady steps remain (the profiler's own cost).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

PROFILED_STEPS = 3
STEP_PREFIX = "parallax.step."


def profiled_steps(start: int, steps: int, warmup: int) -> range:
    """The steps to record: the last PROFILED_STEPS of the run, after `warmup` steps when there are enough."""
    first = max(start + min(warmup, max(0, steps - start - 1)), steps - PROFILED_STEPS)
    return range(first, steps)


class StepProfiler:
    """Records steps `window` of this rank and writes `folder`/rankNNNNN.json at the end."""

    def __init__(self, folder: str | None, rank: int, window: range) -> None:
        self.folder, self.rank, self.window = folder, rank, window if folder else range(0)
        self.active: profile | None = None

    @contextlib.contextmanager
    def step(self, step: int):
        if step not in self.window:
            yield
            return
        if self.active is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.active = profile(activities=activities)
            self.active.__enter__()
        with record_function(f"{STEP_PREFIX}{step}"):
            yield
        if step == self.window[-1]:
            self.active.__exit__(None, None, None)
            Path(self.folder).mkdir(parents=True, exist_ok=True)
            self.active.export_chrome_trace(str(Path(self.folder) / f"rank{self.rank:05d}.json"))
            self.active = None

    def watch_forward(self, modules) -> None:
        """Mark each module's forward while recording (pipeline stages, whose forward and backward
        torch's schedule interleaves; time in the schedule outside these marks is backward or a
        transfer)."""
        open_ranges: list = []

        def enter(module, args):
            if self.active is not None:
                open_ranges.append(record_function("parallax.forward").__enter__())

        def leave(module, args, output):
            if open_ranges:
                open_ranges.pop().__exit__(None, None, None)

        for module in modules:
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)

    def phase(self, name: str):
        """A marked phase of the step while recording; nothing otherwise."""
        return record_function(f"parallax.{name}") if self.active is not None else contextlib.nullcontext()
