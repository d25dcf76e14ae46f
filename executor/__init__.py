"""Parallax executor: materialise a plan with torch.distributed and run it.

One applier per parallelism in a fixed order (materialize.py), the mesh, the
torchrun launch, the run report, calibration. May import: hardware, costmodel,
planner (the capability declaration and the model catalog); never the CLI.
"""
from executor.launch import run
from executor.materialize import APPLY_ORDER, materialize
from executor.validate import validate

__all__ = ["APPLY_ORDER", "materialize", "run", "validate"]
