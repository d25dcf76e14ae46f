"""Parallax planner: trace a model, search layouts with CP-SAT, return a Plan."""
from costmodel.plan import Plan

from .api import estimate, plan

__all__ = ["Plan", "estimate", "plan"]
