"""From a model to the cost model's `Workload`: the one model catalog, the tracers
(torch module on the meta device, HuggingFace config, ONNX file) that record an
op graph, repeated-block recognition with the executor's TP split, the graph's
reduction to a `Workload`, and the on-disk cache of traced workloads.

May import: hardware, costmodel, planner.executable (which modules TP splits),
torch, transformers, onnx, networkx. Never planner.search or the uses above
it, nor executor.
"""
