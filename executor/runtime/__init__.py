"""Running a plan: torchrun's launch and its process tree, the worker each rank starts, the
training loop, the device mesh, elastic re-planning, SLURM scripts and the run report."""
