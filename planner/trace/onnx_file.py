"""Read an ONNX file into the same `OpGraph` form as a torch trace.

Shapes come from `onnx.shape_inference`; symbolic dims of the graph inputs are
bound to (batch, seq_len) by position. FLOPs: MatMul 2·out·k, Gemm 2·m·n·k,
Conv 2·out·(c_in/groups)·kernel; all other ops are memory-bound (bytes read +
written). Initializers are the parameters (dims only: external data is never
loaded). Module paths come from the dynamo exporter's
`pkg.torch.onnx.name_scopes` metadata, else from `/a/b/Op` node names.

ONNX has no backward, so saved activations are estimated with this rule: a
(non-view) tensor is saved when a consumer's gradient needs it, i.e. when it
is an activation operand of a GEMM/Conv, or an input of any op outside
`_LINEAR_OPS` (ops whose gradient does not depend on their inputs: Add, Sub,
Neg, Concat, Split, Slice, Cast, reshapes and transposes). Softmax keeps its
output, which the rule approximates by its input (same size).
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

from hardware.errors import ModelError
from planner.trace.graph import OpGraph, new_node, numel

_VIEWS = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Shape", "Constant", "Size"}
_LINEAR_OPS = _VIEWS | {"Add", "Sub", "Neg", "Concat", "Split", "Slice", "Cast", "Transpose", "Expand", "Gather",
                        "Dropout", "ConstantOfShape", "Range", "Equal", "Less", "Greater", "Where"}
_GEMMS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "MatMulInteger", "QLinearMatMul"}
_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 6: "int32", 7: "int64", 9: "bool", 10: "float16", 11: "float64",
           16: "bfloat16"}
_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int8": 1, "uint8": 1,
          "bool": 1}


def _load(path: str | Path):
    import onnx

    path = Path(path)
    if not path.exists():
        raise ModelError("model", f"ONNX file {str(path)!r} does not exist")
    try:
        model = onnx.load(str(path), load_external_data=False)
        model = onnx.shape_inference.infer_shapes(model)
    except Exception as error:  # noqa: BLE001
        raise ModelError("model", f"cannot read ONNX file {path.name}: {error}") from None
    if not model.graph.node:  # protobuf reads an empty or foreign file as an empty model
        raise ModelError("model", f"ONNX file {path.name} holds no graph (empty, or not an ONNX model)",
                         "export one with torch.onnx.export")
    return model


def _shapes(model, batch: int, seq_len: int | None) -> dict[str, tuple[tuple[int, ...], str]]:
    """value name -> (shape, dtype); symbolic input dims bound as (batch, seq)."""
    graph = model.graph
    symbols: dict[str, int] = {}
    for value in graph.input:
        for i, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.dim_param and dim.dim_param not in symbols:
                symbols[dim.dim_param] = batch if i == 0 else (seq_len or 1)
    out = {}
    for value in (*graph.input, *graph.value_info, *graph.output):
        ttype = value.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else symbols.get(d.dim_param, seq_len or 1)
                     for d in ttype.shape.dim)
        out[value.name] = (dims, _DTYPES.get(ttype.elem_type, "float32"))
    for init in graph.initializer:
        out[init.name] = (tuple(init.dims), _DTYPES.get(init.data_type, "float32"))
    return out


def _module(node) -> str:
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            scopes = ast.literal_eval(prop.value)
            return scopes[-2] if len(scopes) >= 2 else ""
    parts = [p for p in node.name.split("/") if p]
    return ".".join(parts[:-1])


def _flops(node, shape_of) -> float:
    ins = [shape_of(n) for n in node.input if n]
    out = shape_of(node.output[0])
    if node.op_type in ("MatMul", "MatMulInteger") and len(ins) >= 2 and ins[0]:
        return 2.0 * numel(out) * ins[0][-1]
    if node.op_type == "Gemm" and len(ins) >= 2:
        trans_a = next((a.i for a in node.attribute if a.name == "transA"), 0)
        k = ins[0][0] if trans_a else ins[0][-1]
        return 2.0 * numel(out) * k
    if node.op_type in ("Conv", "ConvTranspose") and len(ins) >= 2:
        return 2.0 * numel(out) * numel(ins[1][1:])  # weight [c_out, c_in/groups, *kernel]
    return 0.0


def trace_onnx(path: str | Path, *, seq_len: int | None = None, batch: int = 1, dtype: str | None = None,
               name: str | None = None) -> OpGraph:
    """An ONNX file as an `OpGraph` (forward only; saved activations estimated)."""
    from planner.trace.blocks import analyse

    model = _load(path)
    shapes = _shapes(model, batch, seq_len)
    inits = {i.name for i in model.graph.initializer}
    first_in = next((v for v in model.graph.input if v.name not in inits), None)
    if seq_len is None and first_in is not None and len(shapes[first_in.name][0]) >= 2:
        seq_len = shapes[first_in.name][0][1]
    float_init = next((shapes[i][1] for i in inits if shapes[i][1].startswith(("float", "bfloat"))), "float32")
    dtype = dtype or {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}[float_init]
    og = OpGraph(nx.DiGraph(), name or Path(path).stem, seq_len=seq_len or 1, batch=batch, dtype=dtype)
    _build(og, model, shapes, inits)
    # An ONNX GEMM against a weight initializer is what a torch nn.Linear exports to:
    # the split the executor would make of the source module.
    og.tp_split_modules = {d["module"] for _, d in og.nodes() if d["kind"] == "linear"}
    analyse(og)
    return og


def _build(og: OpGraph, model, shapes, inits) -> None:
    g = og.graph
    shape_of = lambda n: shapes.get(n, ((), "float32"))[0]  # noqa: E731
    nbytes = lambda n: numel(shape_of(n)) * _SIZES.get(shapes.get(n, ((), "float32"))[1], 4)  # noqa: E731
    producer: dict[str, int] = {}
    # Parameters: float initializers with more than one element (int ones are
    # shapes/indices, scalars are constants such as the attention scale).
    param_of = {n: n for n in inits if shapes[n][1].startswith(("float", "bfloat")) and numel(shapes[n][0]) > 1}
    seen: set[str] = set()
    for value in model.graph.input:
        if value.name not in inits:
            shape, dt = shapes[value.name]
            producer[value.name] = new_node(g, op=f"input:{value.name}", phase="input", kind="input", shape=shape,
                                            dtype=dt)
    for node in model.graph.node:
        out = node.output[0] if node.output else ""
        shape, dt = shapes.get(out, ((), "float32"))
        me = new_node(g, op=node.op_type, module=_module(node), shape=shape, dtype=dt)
        data = g.nodes[me]
        params = [param_of[i] for i in node.input if i in param_of]
        for name in params:
            if name not in seen and name in inits:
                seen.add(name)
                data["param_count"] += numel(shape_of(name))
                data["param_bytes"] += nbytes(name)
        data["params"] = tuple(params)
        for i in node.input:
            if i in producer:
                g.add_edge(producer[i], me, param=i in param_of)
        data["flops"] = _flops(node, shape_of)
        data["kind"] = _kind(node, params, data, inits)
        if data["kind"] == "linear":
            data["weight_dims"] = next(shape_of(i) for i in node.input if i in param_of)[-2:]
        data["bytes"] = 0.0 if data["kind"] == "view" else float(sum(nbytes(n) for n in (*node.input, *node.output) if n))
        if data["kind"] == "embedding":
            data["bytes"] = float(2 * nbytes(out))
        for o in node.output:
            producer[o] = me
            if node.input and node.input[0] in param_of and (data["kind"] == "view" or node.op_type in ("Transpose", "Cast")):
                param_of[o] = param_of[node.input[0]]
        _mark_saved(og, node, me, producer, param_of, nbytes)


def _kind(node, params, data, inits) -> str:
    if node.op_type in _VIEWS:
        return "view"
    if node.op_type == "Gather" and node.input and node.input[0] in inits:
        return "embedding"
    if node.op_type in ("Attention", "MultiHeadAttention", "GroupQueryAttention"):
        return "attention"
    if node.op_type in _GEMMS:
        return "linear" if params else "matmul"
    return "elementwise"


def _mark_saved(og: OpGraph, node, me: int, producer, param_of, nbytes) -> None:
    """The estimation rule of the module docstring, applied to `node`'s inputs."""
    if node.op_type in _LINEAR_OPS and node.op_type not in _GEMMS:
        return
    g = og.graph
    for i in node.input:
        if not i or i in param_of or i not in producer:
            continue
        src = producer[i]
        while g.nodes[src]["kind"] == "view":  # save the storage, not a view of it
            base = [p for p in g.predecessors(src) if not g.edges[p, src].get("param")]
            if not base:
                break
            src = base[0]
        data = g.nodes[src]
        if not data["saved_bytes"]:
            data["saved_bytes"] = float(nbytes(i))
            data["saved_at"], data["saved_module"] = me, g.nodes[me]["module"]
