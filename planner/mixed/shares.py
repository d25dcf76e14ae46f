"""How many micro-batches each group's replicas run in a data split: a small CP-SAT model.

Variables
    m[g]   integer >= 1, micro-batches per step of each replica of group g
    T      the step's pipeline time (the slowest group's)
Constraints
    sum_g dp[g] * m[g] = units       (the global batch, in micro-batches)
    T >= m[g] * slowest[g] + rest[g]  for every group g (`costmodel.estimate.pipeline_time`:
                                      m times the slowest stage, plus the other stages once)
Objective
    minimise T
"""
from __future__ import annotations

from ortools.sat.python import cp_model

NS = 1e9


def split_micro_batches(units: int, dp_of: list[int], paces: list[tuple[float, float]],
                        time_limit_s: float = 1.0) -> list[int] | None:
    """m[g] per group (see the module docstring); `paces[g]` = (slowest stage, the rest) in seconds."""
    if units < sum(dp_of):
        return None
    model = cp_model.CpModel()
    m = [model.NewIntVar(1, units // n, f"m_{g}") for g, n in enumerate(dp_of)]
    model.Add(sum(n * mg for n, mg in zip(dp_of, m)) == units)
    bound = int(max(units * s + r for s, r in paces) * NS) + 1
    T = model.NewIntVar(0, bound, "T")
    for mg, (slowest, rest) in zip(m, paces):
        model.Add(T >= mg * int(round(slowest * NS)) + int(round(rest * NS)))
    model.Minimize(T)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1
    solver.parameters.catch_sigint_signal = False  # Ctrl-C interrupts the command, not just this solve
    if solver.Solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return [solver.Value(mg) for mg in m]
