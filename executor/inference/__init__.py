"""Serving what was trained: greedy generation under the planner's tensor-parallel layout."""
