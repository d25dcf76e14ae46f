"""Parallax planner: trace a model, search layouts with CP-SAT, return a Plan.

`executable` is the one declaration of what the executor runs, read by the
tracer's TP split, the layout space and the executor's validation.
Sub-packages: `trace` (model -> Workload, the model catalog) and `search`
(space, coefficients, CP-SAT, bounds, branch and bound). The uses on top of
them live here: `request` (what a plan is asked: one validated `PlanRequest`
from `plan()` down to the search), `api` (plan, estimate), `whatif`, `inference` (serve plans),
`hetero` (mixed clusters), `report`, `plots`, `summary`.

May import: hardware, costmodel and its own sub-packages; never executor or
the CLI (`parallax_cli`), which sit above it.
"""
from layout.plan import Plan

from planner.api import estimate, plan
from planner.request import PlanRequest

__all__ = ["Plan", "PlanRequest", "estimate", "plan"]
