"""Parallax executor: materialise a plan with torch.distributed and run it."""
from executor.launch import run
from executor.materialize import APPLY_ORDER, materialize
from executor.validate import validate

__all__ = ["APPLY_ORDER", "materialize", "run", "validate"]
