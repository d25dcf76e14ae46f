"""The layout search: the layout space drawn from the executor's capability
declaration (`planner.executable`), per-layout coefficients taken from the cost model,
the CP-SAT stage model, lower bounds, uniform enumeration (the baseline),
pinned layouts, infeasibility reports, and the branch and bound that ties them
together (`branch_and_bound.search`).

May import: hardware, costmodel, planner.executable, planner.trace (workloads), ortools. Never the
uses above it (planner.api, whatif, serving), nor executor.
"""
