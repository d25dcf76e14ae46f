"""What one run is asked to do besides the plan: one validated object, the launcher's and
every worker's, written beside the plan for torchrun's workers to read.

The launch-only facts (how many processes on this node, the nodes' rendezvous, a
wall-clock limit, the profile to predict with) stay with the launcher: the workers
learn them from torchrun. A step hook is the one door for code that is not the
run's own: the restart tests kill a rank through it (tests/faults.py); no option of
the CLI reaches it, and it names a function the launcher's caller chose.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hardware.untrusted import SafeName


class Trust(BaseModel):
    """What the user has said may be trusted: a plan's module factory (its code runs on every
    rank) and a checkpoint folder other users may write (its weights are loaded)."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    module: bool = False
    checkpoint_dir: bool = False


class StepHook(BaseModel):
    """`function(**arguments)` is called once per rank and returns `on_step(step, rank, attempt)`,
    called before each step's update; `attempt` is torchrun's restart count."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    function: str = Field(description="package.module:function")
    arguments: dict[str, Any] = Field(default_factory=dict)

    @field_validator("function")
    @classmethod
    def _importable_name(cls, value: str) -> str:
        module, _, name = value.partition(":")
        if not name or not all(part.isidentifier() for part in [*module.split("."), name]):
            raise ValueError(f"{value!r} is not package.module:function")
        return value

    def build(self) -> Callable[[int, int, int], None]:
        module, _, name = self.function.partition(":")
        return getattr(importlib.import_module(module), name)(**self.arguments)


class RunConfig(BaseModel):
    """The run's own choices: model, steps, seed, checkpoints, restarts, profiling, trust."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    model: Optional[SafeName] = Field(None, description="the model to build; default: the plan's")
    steps: int = Field(5, ge=1, le=1_000_000)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    checkpoint_dir: Optional[str] = Field(None, description="save here and resume from here")
    checkpoint_every: int = Field(0, ge=0, description="save every N steps (and after the last); 0: the last only")
    max_restarts: int = Field(0, ge=0, le=1000, description="torchrun restarts after a worker dies")
    profile_dir: Optional[str] = Field(None, description="torch.profiler traces of the last steps, one per rank")
    trust: Trust = Trust()
    device_memory_bytes: Optional[float] = Field(
        None, gt=0, description="each rank's device memory: a rank whose first step peaks above it stops the run "
                                "(the profile's, when the run is predicted for one; a GPU's own out-of-memory "
                                "error stops it the same way)")
    step_hook: Optional[StepHook] = None

    def model_for(self, plan_model: str) -> str:
        return self.model or plan_model
