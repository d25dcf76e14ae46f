"""`OpGraph` → `costmodel.workload.Workload`: price each layer once.

Layers come from `blocks.analyse`: the embedding (ops before the first block),
one segment per repeated-block group (its representative member, repeated to
the real depth), the ops between groups ("other") and the head. All amounts
are per sequence: they are divided by the traced batch.

Conventions:
- matmul_flops: forward GEMMs against weights (and any activation GEMM that is
  not attention); attention_flops: fused attention ops plus the q·kᵀ and
  scores·v GEMMs of unfused attention, counted as torch does: 4·b·h·s²·d for
  the full square (no causal halving).
- Saved activations: each saved storage once, in the layer that saved it; its
  TP state (R/S) and scores flag come from the op that produced it.
- act_input: the layer's largest activation input (kept under full recompute).
- TP collectives are the ones the executor's DTensor layout issues: one
  all-reduce per row-split linear output in forward, one per column-split
  linear's input gradient in backward, and an all-gather of each gathered
  (replicated) column-split output (see `blocks.split_tp`).
"""
from __future__ import annotations

from hardware.errors import ModelError
from costmodel.workload import AttentionCall, LayerProfile, Segment, Workload
from planner.trace.allocations import allocator_slack
from planner.trace.fusion import fused_elementwise_bytes
from planner.trace.graph import OpGraph
from planner.trace.partition import compiled_saved_bytes
from planner.trace.saved import sp_whole_bytes, transient, view_base

_ELEM = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4, "bool": 1,
         "int8": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def nbytes(data: dict) -> float:
    """Output bytes of a node (first output)."""
    count = 1
    for dim in data["shape"]:
        count *= int(dim)
    return float(count * _ELEM.get(data["dtype"], 4))


def half_nbytes(data: dict) -> float:
    """`nbytes` with floating outputs at 16 bits: what a fused kernel stack (Megatron-LM's,
    Transformer Engine's) reads and writes, its fp32 math kept inside the kernel."""
    wide = data["dtype"] in ("float32", "float64")
    return nbytes(data) * (2 / _ELEM[data["dtype"]] if wide else 1)


def _is_attention(og: OpGraph, node: int, data: dict) -> bool:
    if data["kind"] == "attention":
        return True
    if data["kind"] != "matmul":
        return False
    return data.get("scores") or any(og.graph.nodes[p].get("scores") for p in og.graph.predecessors(node))


def layer_profile(og: OpGraph, layer: str, name: str, kind: str) -> LayerProfile:
    """The LayerProfile of the forward nodes whose `layer` is `layer`."""
    g, b = og.graph, og.batch
    nodes = [(n, d) for n, d in og.nodes() if d.get("layer") == layer]
    members = {n for n, _ in nodes}
    matmul = attention = elementwise = 0.0
    flops_per_dim = 0.0  # sum of flops / smallest GEMM dimension, for the FLOP-weighted harmonic mean
    for node, data in nodes:
        if _is_attention(og, node, data):
            attention += data["flops"]
        elif data["kind"] in ("linear", "matmul"):
            matmul += data["flops"]
            # the weights' smallest dimension: the tokens' is the cost model's (micro-batch x sequence)
            smallest = min([int(x) for x in (data["weight_dims"] or ())] or [og.seq_len * b])
            flops_per_dim += data["flops"] / max(1, smallest)
        elif data["kind"] in ("elementwise", "embedding"):
            elementwise += data["bytes"]
    saved = _saved(og, layer)
    reduces = [nbytes(d) for _, d in nodes if d.get("allreduce")]
    colwise = [_activation_input_bytes(og, n) for n, d in nodes if d.get("tp_style") == "colwise"]
    comm = reduces or colwise
    inputs = [nbytes(g.nodes[p]) for n in members for p in g.predecessors(n)
              if p not in members and not g.edges[p, n].get("param") and g.nodes[p]["phase"] != "backward"]
    order = [n for n, _ in nodes]
    sp_whole, sp_dropped = sp_whole_bytes(og, layer, order, nbytes)
    temporaries, temporaries_tp = transient(og, order, nbytes)
    experts = [d for _, d in nodes if any(".experts." in p for p in d.get("params") or ())]
    n_experts, top_k = og.meta.get("n_experts"), og.meta.get("top_k")
    host_ops = _host_ops(og).get(layer, {})
    expert_flops = sum(d["flops"] for d in experts if d["kind"] in ("linear", "matmul"))
    return LayerProfile(
        name=name, kind=kind, params=int(sum(d["param_count"] for _, d in nodes)),
        expert_params=int(sum(d["param_count"] for d in experts)), expert_flops=expert_flops / b,
        expert_tokens=og.seq_len * top_k / n_experts if expert_flops and n_experts and top_k else 0.0,
        expert_dispatch_bytes=(og.seq_len * top_k * (og.meta.get("hidden") or 0) * og.dtype_bytes
                               if expert_flops and top_k else 0.0),
        matmul_flops=matmul / b, matmul_min_dim=_effective_dim(matmul, flops_per_dim, og.seq_len),
        attention_flops=attention / b, elementwise_bytes=elementwise / b,
        elementwise_fused_bytes=min(elementwise, fused_elementwise_bytes(og, members, nbytes)) / b,
        elementwise_kernel_bytes=min(elementwise, fused_elementwise_bytes(og, members, half_nbytes)) / b,
        act_replicated=saved["R"] / b, act_tp_sharded=saved["S"] / b, act_attention_scores=saved["scores"] / b,
        act_compiled_share=_compiled_share(og, layer, sum(saved.values())),
        act_input=max(inputs, default=0.0) / b,
        **{name: value / b for name, value in op_policy(nodes).items()}, act_sp_whole=sp_whole / b, act_sp_dropped=sp_dropped / b,
        act_transient=temporaries / b, act_transient_tp=temporaries_tp,
        act_allocator_slack=allocator_slack(og, layer, nbytes) / b,
        tp_shardable=kind != "block" or bool(reduces),
        tp_allreduces_fwd=len(reduces), tp_comm_bytes=(sum(comm) / len(comm) / b) if comm else 0.0,
        tp_allreduces_bwd=len(colwise), tied_params=_tied_params(og, nodes, layer),
        grad_dense_bytes=float(sum(d["param_bytes"] for _, d in nodes if d["kind"] == "embedding")),
        largest_weight=max((_weight_elements(d) for _, d in nodes), default=0),
        host_ops_forward=len(nodes), host_ops_backward=host_ops.get("backward", 0), host_ops_saved=host_ops.get("saved", 0),
        boundary_bytes=_boundary(og, members) / b, **_gemm_operands(og, nodes))


def _host_ops(og: OpGraph) -> dict[str, dict[str, int]]:
    """Per layer, the backward's ops and the forward's saved tensors: each goes to the one layer
    whose forward ran the module that recorded it."""
    module_layers = og.module_layers()
    counts: dict[str, dict[str, int]] = {}
    for _, data in og.nodes("backward"):
        layer = og.layer_of(data, module_layers)
        if layer is not None:
            mine = counts.setdefault(layer, {"backward": 0, "saved": 0})
            mine["backward"] += 1
    for module, saves in og.saves_by_module.items():
        layer = module_layers.get(module)
        if layer is not None:
            counts.setdefault(layer, {"backward": 0, "saved": 0})["saved"] += saves
    return counts


PRODUCTS = ("linear", "matmul", "attention")
MM = "aten.mm."


def op_policy(nodes: list[tuple[int, dict]]) -> dict[str, float]:
    """What the op policy keeps of a layer and recomputes (executor/apply/recompute.py, torchtitan's
    selective checkpointing): in forward order, every odd-numbered matrix multiply's output and
    every other product's (attention kernels, batched products); each even-numbered multiply is
    recomputed. Under SP a row-split product's reduce-scatter output is kept too."""
    out = dict.fromkeys(("act_op_split", "act_op_whole", "act_op_reduced", "op_recompute_flops"), 0.0)
    multiplies = 0
    for _, data in sorted(nodes, key=lambda item: item[0]):
        if data["kind"] not in PRODUCTS:
            continue
        if data.get("tp_style") == "rowwise":
            out["act_op_reduced"] += nbytes(data)
        if data["op"].startswith(MM):
            multiplies += 1
            if multiplies % 2 == 0:
                out["op_recompute_flops"] += data["flops"]
                continue
        out["act_op_split" if data.get("tp") == "S" else "act_op_whole"] += nbytes(data)
    return out


def _gemm_operands(og: OpGraph, nodes: list[tuple[int, dict]]) -> dict[str, float | int]:
    """The weight GEMMs' activation inputs (each tensor once) and outputs, per sequence: what FP8
    training casts (costmodel.fp8)."""
    g, b = og.graph, og.batch
    inputs, outputs = {}, []
    for node, data in nodes:
        if data["kind"] != "linear" or _is_attention(og, node, data):
            continue
        outputs.append(_elements(data))
        for p in g.predecessors(node):
            if not g.edges[p, node].get("param"):
                source = view_base(g, p)
                inputs[source] = _elements(g.nodes[source])
    return {"gemm_input_elements": sum(inputs.values()) / b, "gemm_output_elements": sum(outputs) / b,
            "gemm_casts": len(inputs) + len(outputs)}


def _compiled_share(og: OpGraph, layer: str, eager: float) -> float | None:
    """What torch.compile's partition saves of `eager`, the layer's saved bytes under eager."""
    cut = compiled_saved_bytes(og, layer, nbytes)
    return None if cut is None or eager <= 0 else min(1.0, cut / eager)


def _elements(data: dict) -> float:
    return nbytes(data) / _ELEM.get(data["dtype"], 4)


def _weight_elements(data: dict) -> int:
    """Elements of the weights one op reads: its own, and any it shares with an earlier layer."""
    return int(data["param_count"] + sum(numel for _, numel, _ in data.get("rereads", ())))


def _tied_params(og: OpGraph, nodes, layer: str) -> int:
    """Parameters this layer reads that another layer read first (a tied LM head)."""
    tied = {}
    for _, data in nodes:
        for name, numel, first in data.get("rereads", ()):
            if first is not None and og.graph.nodes[first].get("layer") != layer:
                tied[name] = numel
    return int(sum(tied.values()))


def _activation_input_bytes(og: OpGraph, node: int) -> float:
    """Bytes of a linear's activation input: DTensor all-reduces its gradient in backward,
    once per column-split linear (separate q, k, v projections reduce three times)."""
    g = og.graph
    ins = [nbytes(g.nodes[p]) for p in g.predecessors(node) if not g.edges[p, node].get("param")]
    return max(ins, default=0.0)


def _effective_dim(flops: float, flops_per_dim: float, fallback: int) -> int:
    """The GEMM dimension d with flops/eff(d) = sum_i flops_i/eff(d_i) for eff(d) ~ d/(d + d0):
    the FLOP-weighted harmonic mean, so one small GEMM (a GQA key projection)
    does not set the efficiency of the whole layer."""
    if flops <= 0 or flops_per_dim <= 0:
        return max(1, fallback)
    return max(1, int(round(flops / flops_per_dim)))


def _saved(og: OpGraph, layer: str) -> dict[str, float]:
    out = {"R": 0.0, "S": 0.0, "scores": 0.0}
    for _, data in og.nodes(None):
        if data["saved_bytes"] and data.get("saved_layer") == layer:
            key = "scores" if data.get("scores") else data.get("tp", "R")
            out[key] += data["saved_bytes"]
    return out


def _boundary(og: OpGraph, members: set[int]) -> float:
    """Bytes of the layer's outputs that later forward ops outside it read."""
    g = og.graph
    outs = [n for n in members if any(s not in members and g.nodes[s]["phase"] == "forward" for s in g.successors(n))]
    real = [nbytes(g.nodes[n]) for n in outs if g.nodes[n]["kind"] != "view"]
    views = [nbytes(g.nodes[n]) for n in outs if g.nodes[n]["kind"] == "view"]
    return sum(real) if real else max(views, default=0.0)


def _counts(og: OpGraph, n_blocks: int | dict[str, int] | None) -> dict[str, int]:
    counts = {}
    for group in og.meta.get("blocks", []):
        prefix = group["prefix"]
        if isinstance(n_blocks, int):
            counts[prefix] = n_blocks
        elif isinstance(n_blocks, dict) and prefix in n_blocks:
            counts[prefix] = n_blocks[prefix]
        else:
            counts[prefix] = og.block_counts.get(prefix, len(group["members"]))
    return counts


def _calls_in(og: OpGraph, layer: str) -> list[dict]:
    """The attention calls made in `layer`: those whose first recorded op lies in it."""
    g = og.graph
    out = []
    for call in og.attention_calls:
        node = call["first_node"]
        while node < g.number_of_nodes() and g.nodes[node]["kind"] in ("view", "input"):
            node += 1
        if node < g.number_of_nodes() and g.nodes[node].get("layer") == layer:
            out.append(call)
    return out


def _profile(og: OpGraph, layer: str, name: str, kind: str, math_layer: str | None) -> LayerProfile:
    """The layer's profile with its attention fused, and the math path beside it when it calls SDPA."""
    fused = layer_profile(og, layer, name, kind)
    calls = _calls_in(og, layer)
    if not calls or og.math_path is None or math_layer is None:
        return fused
    described = {k: v for k, v in calls[0].items() if k != "first_node"}
    call = AttentionCall(**described, count=len(calls))
    math = layer_profile(og.math_path, math_layer, name, kind)
    return fused.model_copy(update={"attention": call, "attention_path": "fused", "other_path": math.model_copy(
        update={"attention": call, "attention_path": "math"})})


def _math_names(og: OpGraph) -> list[str | None]:
    """The math-path trace's representative of each block group (same order as og's)."""
    if og.math_path is None:
        return [None] * len(og.meta.get("blocks", []))
    reps = [group["rep"] for group in og.math_path.meta.get("blocks", [])]
    return reps + [None] * (len(og.meta.get("blocks", [])) - len(reps))


def _with_autocast(workload: Workload, autocast: Workload) -> Workload:
    """`workload` with each layer's profile under autocast over fp32 weights beside it, on each
    attention path (`LayerProfile.under_autocast`); unchanged where the two traces' layers differ."""
    pairs = list(zip(workload.segments, autocast.segments))
    if len(workload.segments) != len(autocast.segments) or any(
            a.layer.kind != b.layer.kind or a.count != b.count for a, b in pairs):
        return workload

    def paired(layer: LayerProfile, under: LayerProfile) -> LayerProfile:
        other = layer.other_path
        if other is not None and under.other_path is not None:
            other = other.model_copy(update={"under_autocast": under.other_path.model_copy(update={"other_path": None})})
        return layer.model_copy(update={"under_autocast": under.model_copy(update={"other_path": None}),
                                        "other_path": other})

    segments = [Segment(layer=paired(a.layer, b.layer), count=a.count) for a, b in pairs]
    # a new model, not model_copy: the copy would carry the cached expanded `layers` along
    return Workload(**{**{name: getattr(workload, name) for name in Workload.model_fields}, "segments": segments})


def to_workload(og: OpGraph, n_blocks: int | dict[str, int] | None = None) -> Workload:
    """Segments: embedding, each block group × its depth, other, head.

    `n_blocks` overrides the depth: one int for every group, or a dict keyed by
    group prefix; by default the real depth recorded at trace time is used.
    """
    present = {d.get("layer") for _, d in og.nodes()}
    if not og.meta.get("blocks"):
        raise ModelError("model", f"{og.name} has no repeated blocks (no ModuleList or ONNX layer pattern found), "
                         "so there is nothing to split into stages or price per layer",
                         "a transformer: repeated blocks between an embedding and a head")
    counts = _counts(og, n_blocks)
    segments = []
    for other in (og.math_path, og.autocast_path):  # the model facts set after tracing (heads, experts...) hold
        if other is not None:                         # for every trace
            other.meta.update({k: v for k, v in og.meta.items() if k not in ("blocks", "flash_attention")})
    math_reps = _math_names(og)
    fixed = lambda layer: _profile(og, layer, layer, layer, layer if og.math_path is not None else None)  # noqa: E731
    if "embedding" in present:
        segments.append(Segment(layer=fixed("embedding")))
    for i, group in enumerate(og.meta.get("blocks", [])):
        layer = _profile(og, group["rep"], group["prefix"], "block", math_reps[i])
        segments.append(Segment(layer=layer, count=max(1, counts[group["prefix"]])))
        if i == 0 and "other" in present:
            segments.append(Segment(layer=fixed("other")))
    if "head" in present:
        segments.append(Segment(layer=fixed("head")))
    meta = og.meta
    workload = Workload(name=og.name, seq_len=og.seq_len, dtype_bytes=og.dtype_bytes, segments=segments,
                        heads=meta.get("heads"), kv_heads=meta.get("kv_heads"), hidden=meta.get("hidden"),
                        vocab=meta.get("vocab"), flash_attention=bool(meta.get("flash_attention", True)),
                        max_seq_len=meta.get("max_seq_len"), n_experts=meta.get("n_experts") or 0)
    return workload if og.autocast_path is None else _with_autocast(workload, to_workload(og.autocast_path, counts))
