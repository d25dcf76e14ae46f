"""The event simulators: one training step (what each rank does and when), and one
serving replica under a request rate (serving.py).

step.py runs a plan through the engine (engine.py) with the ops priced by the
analytic model's own terms (ops.py), in the schedule's per-rank order
(schedule.py); stats.py reads the events back into breakdowns and memory
timelines; trace_export.py writes them as a Chrome/Perfetto trace.
"""
