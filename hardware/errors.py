"""Typed, human-readable errors shared by every Parallax layer.

Every error that user input can cause names the offending field and a valid
alternative, so that the CLI can print one line instead of a traceback.
"""
from __future__ import annotations


class ParallaxError(ValueError):
    """Wrong user input: `field` is what was wrong, `hint` what would be valid."""

    def __init__(self, field: str, problem: str, hint: str = "") -> None:
        self.field = field
        self.problem = problem
        self.hint = hint
        message = f"{field}: {problem}"
        if hint:
            message += f" ({hint})"
        super().__init__(message)


class HardwareError(ParallaxError):
    """A hardware spec string or profile file is invalid."""


class ModelError(ParallaxError):
    """A model name, config or module cannot be traced or described."""


class PlanError(ParallaxError):
    """A plan is inconsistent with the model, the hardware or itself."""


class RunError(ParallaxError):
    """A launched run failed: `field` names the rank, the message its exception."""


class Interrupted(Exception):
    """SIGINT or SIGTERM stopped a command (and whatever it started); `exit_code` is the
    shell's code for that signal: 130 for SIGINT, 143 for SIGTERM."""

    def __init__(self, signum: int, stopped: str = "") -> None:
        import signal

        name = signal.Signals(signum).name
        super().__init__(f"interrupted by {name}" + (f": {stopped}" if stopped else ""))
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class InfeasibleError(ParallaxError):
    """No layout fits; `report` carries the numbers that explain why."""

    def __init__(self, field: str, problem: str, hint: str = "", report: dict | None = None) -> None:
        super().__init__(field, problem, hint)
        self.report = report or {}


class FormatError(ParallaxError):
    """Another tool's configuration (torchtitan, DeepSpeed, Accelerate, Megatron-LM, a serving
    engine) cannot say what a plan says, or cannot be read as a layout."""
