"""One graph form for every traced model: an op-level DAG with costs.

Both front ends (torch tracing in `trace_torch`, ONNX files in `trace_onnx`)
produce an `OpGraph`, so block recognition, the TP split and the conversion to
a `costmodel.workload.Workload` are written once.

Node attributes (node ids are ints in execution order, so id order is a
topological order of the forward graph):

- ``op``: operator name (``aten.mm.default``, ``MatMul``...), ``phase``:
  ``"input" | "forward" | "backward"``, ``kind``: ``"input" | "linear" |
  "matmul" | "attention" | "embedding" | "view" | "elementwise"``;
- ``shape``, ``dtype``: first output; ``flops``; ``bytes`` (read + written);
- ``module``: innermost module path (nn_module_stack top, ``""`` = root);
- ``params``: parameter names the op reads; ``param_bytes``: bytes of the
  parameters first read here (each parameter is counted once);
- ``weight_dims``: for ``linear`` nodes, the weight's 2-D shape;
- ``saved_bytes``: bytes of this node's output saved for backward, and
  ``saved_at`` / ``saved_module``: the last forward op and the innermost
  module when it was saved (together: the layer that keeps it, ``saved_layer``).
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import networkx as nx

MATMUL_LIKE = re.compile(r"(^|[._:])(mm|bmm|addmm|baddbmm|matmul|linear|gemm|conv\w*|einsum|\w*attention\w*)($|[._])",
                         re.IGNORECASE)
"""Op names that do O(n^3)-like work: never priced 0 without a warning."""

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8, "fp8": 1, "int8": 1}


@dataclass
class OpGraph:
    """A traced model: the op DAG plus what the workload conversion needs.

    ``block_counts`` maps a repeated-block prefix (``model.layers``) to the
    real depth when the trace was made at reduced depth; ``tp_styles`` maps a
    linear module name (``*`` for a block index) to its Megatron role;
    ``meta`` holds heads / kv_heads / hidden / vocab when they are known.
    """

    graph: nx.DiGraph
    name: str
    seq_len: int
    batch: int = 1
    dtype: str = "bf16"
    warnings: list[str] = field(default_factory=list)
    tp_styles: dict[str, str] = field(default_factory=dict)
    block_counts: dict[str, int] = field(default_factory=dict)
    module_types: dict[str, str] = field(default_factory=dict)
    saves_by_module: dict[str, int] = field(default_factory=dict)  # tensors saved for backward, per module (every save)
    tp_split_modules: set[str] = field(default_factory=set)  # what the executor's TP splits
    # the split the executor applies, derived once (`planner.trace.tp_styles.analyse_tp`): module name ->
    # colwise/rowwise/replicate; None: a graph without a module to run it on (an ONNX file), split by the
    # graph's own data flow
    tp_module_styles: dict[str, str] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    attention_calls: list[dict] = field(default_factory=list)  # scaled_dot_product_attention calls, traced order
    math_path: "OpGraph | None" = None  # the same model traced with those calls on torch's math path
    # the same model with fp32 weights under torch.autocast in this graph's dtype (fused attention): what a
    # plan that casts its weights per use keeps (`costmodel.autocast.under_autocast`)
    autocast_path: "OpGraph | None" = None

    def warn_once(self, message: str) -> None:
        """Record a problem once on the graph and once through `warnings`."""
        if message not in self.warnings:
            self.warnings.append(message)
            warnings.warn(message, stacklevel=3)

    def nodes(self, phase: str | None = "forward") -> Iterator[tuple[int, dict]]:
        """Nodes of one phase (all with None), in execution order."""
        for node in sorted(self.graph.nodes):
            data = self.graph.nodes[node]
            if phase is None or data["phase"] == phase:
                yield node, data

    def module_layers(self) -> dict[str | None, str | None]:
        """Each module's layer, by the forward ops it ran: a backward op (which autograd records
        under no layer) goes to the layer whose forward ran the module that recorded it."""
        return {d.get("module"): d.get("layer") for _, d in self.nodes()}

    def layer_of(self, data: dict, module_layers: dict) -> str | None:
        """The layer of the op `data`: its own in forward, its module's in backward."""
        return data.get("layer") if data["phase"] == "forward" else module_layers.get(data.get("module"))

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES.get(self.dtype, 2)

    def total(self, key: str, phase: str | None = "forward") -> float:
        return sum(data.get(key, 0) or 0 for _, data in self.nodes(phase))

    @property
    def params(self) -> int:
        """Parameter count (bytes / element size of each parameter's dtype)."""
        return int(sum(data.get("param_count", 0) for _, data in self.nodes(None)))

    def summary(self) -> dict[str, Any]:
        """Totals for a quick look (benchmarks, the CLI)."""
        return {"name": self.name, "nodes": self.graph.number_of_nodes(), "params": self.params,
                "fwd_flops": self.total("flops"), "bwd_flops": self.total("flops", "backward"),
                "saved_bytes": self.total("saved_bytes", None), "warnings": len(self.warnings)}


def new_node(graph: nx.DiGraph, **attrs: Any) -> int:
    """Add a node with the default attributes; returns its id (execution order)."""
    node = graph.number_of_nodes()
    base = {"op": "", "phase": "forward", "kind": "elementwise", "shape": (), "dtype": "", "flops": 0.0,
            "bytes": 0.0, "module": "", "params": (), "param_bytes": 0, "param_count": 0,
            "weight_dims": None, "saved_bytes": 0.0, "saved_at": None, "saved_module": ""}
    base.update(attrs)
    graph.add_node(node, **base)
    return node


def module_within(module: str, prefix: str) -> bool:
    """Whether module path `module` is `prefix` or lies below it."""
    return module == prefix or module.startswith(prefix + ".")


def numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count
