"""The layout search: the executor's capability declaration (`executable`), the
layout space drawn from it, per-layout coefficients taken from the cost model,
the CP-SAT stage model, lower bounds, uniform enumeration (the baseline),
pinned layouts, infeasibility reports, and the branch and bound that ties them
together (`branch_and_bound.search`).

May import: hardware, costmodel, planner.trace (workloads), ortools. Never the
uses above it (planner.api, whatif, serving), nor executor.
"""
