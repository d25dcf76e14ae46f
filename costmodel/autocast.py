"""What torch.autocast over fp32 master weights holds: the weights' compute-dtype copies, their
gradients at a backward's end, and the fp32 activations the layers keep.

A half-precision plan whose GEMMs read fp32 master weights as they are (DDP, TP or
pipeline stages without ZeRO-2/3, a single rank) computes under
`torch.autocast`: every linear casts its weight to the compute dtype at its first use and
autocast caches that copy until its region exits, while each GEMM also saves it for its
backward. So the rank holds a compute-dtype copy of every weight a GEMM reads beside the
fp32 states from the first forward to the end of the backward, recomputed layers included
(the cache outlives the checkpoint). FSDP2's mixed-precision gather (ZeRO-2/3 over several
ranks, or offloaded) casts at the gather instead, and bf16 master weights need no cast.

Seen on one H200 (benchmarks/data/h200_gpu_runs.csv): llama-3.2-1b at 2 x 2048 tokens on one
rank held 1.8 GiB of bf16 block weights and the tied table's 0.49 GiB copy at its peak,
measured and dry-run alike.

Later micro-batches hold the copies' gradients to the backward's end (`cast_gradient_pile_bytes`,
`cast_back_bytes`), and the residual stream and norms stay fp32 (`under_autocast`).
"""
from __future__ import annotations

from .memory import DTYPE_BYTES, WEIGHT_BYTES, dense_gradient_split
from .workload import LayerProfile, Segment, Workload, layer_params_on_rank, tied_params_on_rank

# What a layer keeps and sends in the dtype its ops run in: under autocast over fp32 weights the
# embedding's output, the residual stream and every op outside autocast's half-precision list (norms,
# rotary, residual adds) stay fp32, where a half-precision model keeps them in 16 bits. The FLOPs and
# the kernels' traffic are left as the half-precision trace prices them, and so are a layer's
# temporaries and allocator slack: the autocast trace's are set by each weight's fp32 gradient cast
# back from its copy's, which the first micro-batch keeps as `.grad` and later ones cast at the
# backward's end (`cast_back_bytes`), not beside the layer's ops.
KEPT_UNDER_AUTOCAST = ("act_sp_whole", "act_sp_dropped", "act_replicated", "act_tp_sharded", "act_attention_scores",
                       "act_compiled_share", "act_input", "act_op_split", "act_op_whole", "act_op_reduced",
                       "boundary_bytes", "grad_dense_bytes")


def casts_weights_per_use(plan) -> bool:
    """Whether autocast casts the plan's weights at each use (see the module docstring)."""
    return casts_per_use(plan, plan.dtype)


def casts_per_use(layout, dtype: str) -> bool:
    """`casts_weights_per_use` for a layout (a `layout.layout.Layout` or Plan) computing in `dtype`."""
    gathered_in_compute_dtype = layout.zero >= 2 and (layout.data_parallel > 1 or layout.offload)
    return (dtype != "fp32" and layout.master_dtype == "fp32" and layout.stack != "fused"
            and not gathered_in_compute_dtype)


def cast_bytes_per_element(layout, dtype: str) -> float:
    """Bytes one cast of a weight element between the master and the compute dtype moves, one
    read and one written; autocast casts each cast weight (`casts_per_use`) twice a step and
    more: forward in the first forward (its cache serves the later micro-batches and a
    recomputed forward), and its gradient back in every micro-batch's backward
    (ToCopyBackward0). Zero where the weights are not cast per use. On two CPU cores, llama-160m
    over four pipeline ranks ran ToCopyBackward0 for 0.92 s of a rank's 3.3 s of backward a step,
    112 of its 224 calls the weights' (torch.profiler; the rest cast the GEMMs' fp32 inputs)."""
    if not casts_per_use(layout, dtype):
        return 0.0
    return WEIGHT_BYTES[dtype] + DTYPE_BYTES[layout.master_dtype]


def under_autocast(workload: Workload, plan) -> Workload:
    """`workload` as `plan` runs it: where the plan casts its weights per use, each layer keeps
    what its trace over fp32 weights under autocast keeps (`KEPT_UNDER_AUTOCAST`;
    `LayerProfile.under_autocast`, none for an ONNX graph or the math attention path). Seen in
    the dry run of llama-3.2-1b at 2 x 2048 tokens on one rank, as on the H200: 252 MiB a
    sequence saved per block, where the bf16 trace keeps 212."""
    if not casts_weights_per_use(plan) or not any(s.layer.under_autocast for s in workload.segments):
        return workload
    hit = _AUTOCAST_RUNS.get(id(workload))
    if hit is not None and hit[0] is workload:
        return hit[1]
    segments = [Segment(layer=_kept_under_autocast(s.layer), count=s.count) for s in workload.segments]
    # a new model, not model_copy: the copy would carry the cached expanded `layers` along
    run = Workload(**{**{name: getattr(workload, name) for name in Workload.model_fields}, "segments": segments})
    if len(_AUTOCAST_RUNS) >= 64:
        _AUTOCAST_RUNS.pop(next(iter(_AUTOCAST_RUNS)))
    _AUTOCAST_RUNS[id(workload)] = (workload, run)
    return run


_AUTOCAST_RUNS: dict[int, tuple[Workload, Workload]] = {}  # id -> (workload, as autocast runs it): a search asks often


def _kept_under_autocast(layer: LayerProfile) -> LayerProfile:
    if layer.under_autocast is None:
        return layer
    return layer.model_copy(update={name: getattr(layer.under_autocast, name) for name in KEPT_UNDER_AUTOCAST})


def cast_params_on_rank(layer: LayerProfile, tp: int, ep: int = 1) -> float:
    """The elements of `layer`'s weights that its GEMMs read on one rank: none of an embedding
    (a lookup, not cast), a head's own and the table it shares with a tied embedding."""
    if layer.kind == "embedding":
        return 0.0
    return layer_params_on_rank(layer, tp, ep) + tied_params_on_rank(layer, tp)


def autocast_copy_bytes(cast_params: float, plan) -> float:
    """Bytes of the compute-dtype copies of `cast_params` weight elements that the rank holds."""
    return WEIGHT_BYTES[plan.dtype] * cast_params if casts_weights_per_use(plan) else 0.0


def cast_gradient_pile_bytes(cast_params: float, plan) -> float:
    """Bytes of compute-dtype weight gradients a backward holds until it ends, beside the
    cast copies: every micro-batch after a step's first reuses the copies cast in the first
    forward, whose cast-backward nodes are older than the rest of its graph, and torch's
    autograd engine runs older nodes last. So each such backward keeps the gradient of every
    cast weight until its end, when the casts back to fp32 run. Seen in real tensors (a
    2-layer HF Llama, two micro-batches: 20.0 MiB of temporaries beside 17.0 MiB of cast
    weights) and in the dry run (llama-3-8b dp8 ZeRO-1, 8 micro-batches: 29.95 GiB of cast
    copies and temporaries at the peak, 13.98 GiB of copies)."""
    return WEIGHT_BYTES[plan.dtype] * cast_params if holds_cast_gradients(plan) else 0.0


def holds_cast_gradients(plan) -> bool:
    """Whether a backward of `plan` holds its cast weights' gradients to its end
    (`cast_gradient_pile_bytes`): autocast's copies reused by a later micro-batch."""
    return casts_weights_per_use(plan) and plan.num_micro_batches >= 2


def cast_back_bytes(layer: LayerProfile, plan) -> float:
    """Bytes a backward's end holds beside the pile (`cast_gradient_pile_bytes`) while the
    largest of `layer`'s cast weights turns its compute-dtype gradient back into the master
    dtype: the new gradient, before it is added to `.grad` in place. A head tied to an
    embedding on the same module (no pipeline cuts them apart, `executor/apply/tied.py`)
    holds three master-dtype tables there: the embedding's gradient, waiting in autograd's
    input buffer since that micro-batch's backward reached it, the head's cast-back one and
    their sum, the head's compute-dtype gradient freed by then. Seen in the dry run of
    llama-3.2-1b dp8 ZeRO-1 at 512 tokens (2.45 GiB above the pile: ten bytes per element of
    the tied table, three fp32 tables less its bf16 gradient). Under TP the embedding's backward
    makes the whole table's gradient before keeping its vocabulary shard (`dense_gradient_split`),
    and the whole one is there too: llama-3.2-1b dp4 tp2 ZeRO-1 at 512 tokens read 2.20 GiB there
    (0.98 above the three shards), tp4+sp 1.59 (0.98 above)."""
    if not holds_cast_gradients(plan) or layer.kind == "embedding":
        return 0.0
    split = plan.tp if layer.tp_shardable else 1
    master = DTYPE_BYTES[plan.master_dtype]
    if layer.tied_params and plan.pp == 1:
        whole = layer.tied_params / dense_gradient_split(layer, plan.tp, plan.stack) if split > 1 else 0.0
        return layer.tied_params / split * (3 * master - WEIGHT_BYTES[plan.dtype]) + whole * master
    return layer.largest_weight / split * master
