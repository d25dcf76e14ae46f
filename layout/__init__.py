"""The layout floor: what a plan is, as data, and which plans are legal.

Each axis of a layout is declared once (`axes`); a `Layout` holds one value per axis and
the facts derived from them (`layout`); a `Plan` is a Layout with its model, hardware,
batch and stage partition (`plan`), carrying what pricing it yielded (`results`) and, on a
mixed cluster, its GPU groups (`groups`). The rulebook (`rules`) answers every caller:
reading a file, planning and running.
May import: hardware (and pydantic); never costmodel, planner, executor or the CLI.
"""
