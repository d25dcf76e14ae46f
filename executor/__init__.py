"""Parallax executor: materialise a plan with torch.distributed and run it.

Five rooms: the appliers, one per parallelism in a fixed order (`apply`), running a plan
(`runtime`: torchrun, the worker, the training loop, the mesh, elastic, SLURM), checkpoint
I/O (`checkpoints`), measurement (`measure`: calibrate, microbenchmarks, profiling, the dry
run) and generation (`inference`). May import: hardware, layout, costmodel, planner (the
model's facts and the model catalog); never the CLI.
"""
from executor.runtime.launch import run
from executor.apply.materialize import APPLY_ORDER, materialize
from executor.apply.validate import validate

__all__ = ["APPLY_ORDER", "materialize", "run", "validate"]
