"""Time of one layer for one micro-batch: roofline compute plus TP collectives.

Each op class runs at an achievable fraction of peak kept in the hardware
data: GEMMs at `matmul_max * d / (d + matmul_half_dim)` where `d` is the
smallest GEMM dimension (small GEMMs under-fill the chip): the weights'
after the TP split, or a micro-batch's tokens, which TP never splits; the
attention core at `attention`, and memory-bound ops at `memory_bound` of
HBM bandwidth. Backward costs twice the forward (two
GEMMs per forward GEMM). Recomputation re-runs the forward (full) or the
attention core and its softmax (selective), and TP collectives of a
recomputed forward run again.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from hardware.schema import Cluster

from .collectives import Group, all_gather, all_reduce, all_to_all, reduce_scatter
from .autocast import cast_params_on_rank
from .fp8 import amax_all_reduces, cast_bytes, gemm_dtype
from .loss import LOSS_PARALLEL_ALL_REDUCES, loss_parallel_reduce_bytes, runs_loss_parallel
from .memory import dense_gradient_split, state_bytes_per_param
from .workload import LayerProfile, layer_params_on_rank

BACKWARD_FACTOR = 2.0
# A fused attention kernel keeps no scores: its backward recomputes them, five s^2 GEMMs to the
# forward's two (FlashAttention, Dao et al. 2022, sec. 3.1; torch's sdpa_backward_flop_count).
FUSED_ATTENTION_BACKWARD = 2.5


@dataclass(frozen=True)
class Context:
    """What a layer's cost depends on besides the layer itself."""

    cluster: Cluster
    dtype: str
    tp: int
    sp: bool
    micro_batch: float  # sequences' worth of tokens per rank: micro_batch / cp
    tp_group: Group
    cp: int = 1
    cp_group: Group | None = None
    cp_kv_bytes: float = 0.0  # one whole sequence's keys and values of one attention layer
    ep: int = 1
    ep_group: Group | None = None
    stack: str = "eager"  # the kernel stack (Plan.stack): compile and fused run pointwise chains fused
    tp_overlap: bool = False  # SP's collectives chunked and overlapped with the GEMMs they feed (Plan.tp_overlap)
    seq_len: int | None = None  # tokens per sequence: with micro_batch, the GEMMs' token dimension (None: not known)
    # A mixture of experts' GEMMs on one rank: `expert_share` of the routed tokens' expert work (all of it where
    # the executor keeps the experts whole on every TP rank; 1/tp where the serving engines split each expert
    # over TP; the busiest rank's under their expert parallelism), each expert's weights split `expert_slices` ways
    expert_share: float = 1.0
    expert_slices: int = 1
    block_gemms: str | None = None  # the dtype a served quantization runs the blocks' GEMMs in (W8A8: int8)
    # seconds per weight element on the rank (`autocast.cast_bytes_per_element`, `accumulation`): each backward's
    # cast of the weights' gradients back to the master dtype, and a micro-batch's average share of the step's
    # once-a-step work: autocast's first cast, and adding the gradients of all micro-batches but the first into .grad
    cast_back_seconds: float = 0.0
    first_cast_seconds: float = 0.0
    accumulation_seconds: float = 0.0


@dataclass(frozen=True)
class LayerTime:
    forward: float  # compute of one forward
    backward: float  # compute of one backward, without recomputation
    recompute: float  # extra compute in backward for the layer's policy
    tp_comm: float  # TP collectives of forward + backward (+ recomputed forward)
    weight_grad: float = 0.0  # of `backward`: the weight gradients (dW GEMMs, as many FLOPs as the forward's, and
    # an embedding's dense table gradient), which a zero-bubble schedule runs apart from the input gradients

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute + self.tp_comm


def memory_bandwidth(gpu, efficiency: float | None = None) -> float:
    """Bytes per second a memory-bound kernel streams on `gpu`: its HBM at the achievable share
    (the profile's, or `efficiency`, such as a serving engine's fitted one)."""
    return gpu.hbm_gbps * 1e9 * (gpu.efficiency.memory_bound if efficiency is None else efficiency)


def gemm_efficiency(ctx: Context, min_dim: float, dtype: str | None = None) -> float:
    """The share of `dtype`'s peak (default: the plan's) a GEMM whose smallest dimension is `min_dim` reaches."""
    eff = ctx.cluster.gpu.efficiency
    fp8 = (dtype or ctx.dtype) == "fp8"
    top = eff.fp8_matmul_max if fp8 and eff.fp8_matmul_max is not None else eff.matmul_max
    return top * min_dim / (min_dim + eff.matmul_half_dim)


def _split(layer: LayerProfile, ctx: Context) -> int:
    return ctx.tp if layer.tp_shardable else 1


def _elementwise_share(layer: LayerProfile, ctx: Context) -> float:
    """Fraction of the layer's memory-bound traffic each TP rank does."""
    t = _split(layer, ctx)
    if ctx.sp or t == 1:
        return 1.0 / t
    saved = layer.act_replicated + layer.act_tp_sharded
    replicated = layer.act_replicated / saved if saved else 1.0
    return replicated + (1.0 - replicated) / t


def attention_efficiency(layer: LayerProfile, gpu) -> float:
    """A fused kernel (no saved scores) runs the attention core at its own speed; the
    unfused core (scores written, softmaxed and read back) at `attention`."""
    fused = layer.act_attention_scores == 0 and gpu.efficiency.fused_attention is not None
    return gpu.efficiency.fused_attention if fused else gpu.efficiency.attention


def forward_parts(layer: LayerProfile, ctx: Context) -> tuple[float, float, float]:
    """(GEMM, attention core, memory-bound) forward seconds for one micro-batch."""
    gpu = ctx.cluster.gpu
    peak = gpu.peak_flops(ctx.dtype if ctx.dtype != "fp8" else "bf16")  # FP8 runs only the blocks' GEMMs in FP8
    dtype = gemm_dtype(layer, ctx.dtype, ctx.block_gemms)
    t = _split(layer, ctx)
    b = ctx.micro_batch
    gemm = 0.0
    dense = layer.matmul_flops - layer.expert_flops
    if dense:
        min_dim = max(1.0, layer.matmul_min_dim / t)
        if ctx.seq_len is not None:  # TP splits the weights, never the tokens: short sequences set the size
            min_dim = min(min_dim, max(1.0, ctx.seq_len * b))
        gemm = dense * b / t / (gpu.peak_flops(dtype) * gemm_efficiency(ctx, min_dim, dtype))
    if layer.expert_flops:  # at the tokens each expert gets
        min_dim = max(1.0, min(layer.matmul_min_dim / ctx.expert_slices, layer.expert_tokens * b))
        gemm += layer.expert_flops * b * ctx.expert_share / (gpu.peak_flops(dtype) * gemm_efficiency(ctx, min_dim, dtype))
    attention = layer.attention_flops * b / t / (peak * attention_efficiency(layer, gpu))
    memory = elementwise_traffic(layer, ctx) * b * _elementwise_share(layer, ctx) / memory_bandwidth(gpu)
    return gemm, attention, memory


def elementwise_traffic(layer: LayerProfile, ctx: Context) -> float:
    """Forward memory-bound bytes per sequence: each pointwise op its own kernel under eager,
    each chain of them one kernel under the compile and fused stacks, the fused stack's
    kernels reading and writing 16-bit tensors where autocast's traced chains hold fp32."""
    if ctx.stack == "fused" and layer.elementwise_kernel_bytes is not None:
        return layer.elementwise_kernel_bytes
    if ctx.stack == "eager" or layer.elementwise_fused_bytes is None:
        return layer.elementwise_bytes
    return layer.elementwise_fused_bytes


def cp_gather_time(layer: LayerProfile, ctx: Context) -> float:
    """Context parallelism's all-gather of a layer's keys and values over the cp group
    (the all-gather form, Dubey et al. 2024 sec. 3.3.2, that the executor runs): the whole
    sequences' K and V, split over TP by heads, before the attention; not hidden. The
    backward reduce-scatters their gradients, the same bytes."""
    if ctx.cp == 1 or not layer.attention_flops or ctx.cp_group is None:
        return 0.0
    t = _split(layer, ctx)
    return all_gather(ctx.cp_kv_bytes * ctx.micro_batch * ctx.cp / t, ctx.cp_group, ctx.cluster)


def expert_exchange_time(layer: LayerProfile, ctx: Context) -> float:
    """Expert parallelism's two all-to-alls of a mixture-of-experts layer (tokens to their
    experts' ranks, results back), each of the routed tokens' activations: top_k copies of
    every token, on the critical path. The backward sends their gradients the same way."""
    if ctx.ep == 1 or not layer.expert_dispatch_bytes or ctx.ep_group is None:
        return 0.0
    return 2 * all_to_all(layer.expert_dispatch_bytes * ctx.micro_batch, ctx.ep_group, ctx.cluster)


def forward_collectives(layer: LayerProfile, ctx: Context) -> float:
    """One forward's collectives on the layer's critical path: TP's (what overlap leaves exposed),
    FP8's amax reductions, CP's and EP's."""
    tp = exposed_tp_time(tp_collective_time(layer, ctx), layer, ctx, 1.0)
    return tp + amax_time(layer, ctx) + cp_gather_time(layer, ctx) + expert_exchange_time(layer, ctx)


def backward_tp_collectives(layer: LayerProfile, ctx: Context) -> float:
    """One backward's TP collectives on the critical path (what overlap leaves exposed)."""
    return exposed_tp_time(tp_backward_collective_time(layer, ctx), layer, ctx, BACKWARD_FACTOR)


def exposed_tp_time(comm: float, layer: LayerProfile, ctx: Context, gemm_passes: float) -> float:
    """What of `comm` stays on the critical path. Overlapped (Megatron-LM's --tp-comm-overlap,
    torchtitan's async TP), each all-gather and reduce-scatter is cut into tp chunks exchanged
    while the GEMM computes on the chunk already there: the first chunk waits, the rest hides
    behind the `gemm_passes` forward GEMM times of the layer unless it outlasts them."""
    if not ctx.tp_overlap or comm == 0.0 or ctx.tp == 1:
        return comm
    gemm = gemm_passes * forward_parts(layer, ctx)[0]
    return max(comm - gemm, comm / ctx.tp)


def _dtensor_sp(layer: LayerProfile, ctx: Context) -> bool:
    """Whether the layer runs DTensor's sequence parallelism, whose collectives are counted per
    linear (`tp_allreduces_bwd`: the traced column-split count): each column-split linear
    all-gathers its own sequence-split input (q, k and v each), each row-split one reduce-scatters
    its output. Megatron-LM's (the fused stack) gathers once per shared input: as many collectives
    as the all-reduces it replaces, and their volume."""
    return ctx.sp and ctx.stack != "fused" and layer.tp_allreduces_bwd is not None


def sp_gather_time(layer: LayerProfile, ctx: Context) -> float:
    """One forward's all-gathers of DTensor's SP, one per column-split linear (what a recompute
    that keeps the reduce-scatters' outputs, `op`, runs again)."""
    if _split(layer, ctx) == 1 or not _dtensor_sp(layer, ctx):
        return 0.0
    return layer.tp_allreduces_bwd * all_gather(layer.tp_comm_bytes * ctx.micro_batch, ctx.tp_group, ctx.cluster)


def tp_collective_time(layer: LayerProfile, ctx: Context) -> float:
    """One forward's TP collectives, each kind as the library runs it (gloo's all-gather and
    reduce-scatter cost more than half its all-reduce: `Collectives.passes`): an all-reduce per
    row-split linear; under DTensor's SP the all-gathers of `sp_gather_time` and a reduce-scatter
    per row-split linear; under Megatron's SP the all-reduces' volume."""
    if _split(layer, ctx) == 1:
        return 0.0
    nbytes = layer.tp_comm_bytes * ctx.micro_batch
    if _dtensor_sp(layer, ctx):
        return sp_gather_time(layer, ctx) + layer.tp_allreduces_fwd * reduce_scatter(nbytes, ctx.tp_group, ctx.cluster)
    return layer.tp_allreduces_fwd * all_reduce(nbytes, ctx.tp_group, ctx.cluster)


def tp_backward_collective_time(layer: LayerProfile, ctx: Context) -> float:
    """One backward's TP collectives: the forward's mirror unless the layer says otherwise. The
    traced count is DTensor's, an all-reduce of the input gradient per column-split linear; under
    its SP a reduce-scatter per column-split linear and an all-gather per row-split one (each
    forward collective's backward). The fused stack's Megatron-LM fuses the projections that share
    an input (QKV, and gate with up), so it mirrors the forward."""
    if layer.tp_allreduces_bwd is None or ctx.stack == "fused":
        return tp_collective_time(layer, ctx)
    if _split(layer, ctx) == 1:
        return 0.0
    nbytes = layer.tp_comm_bytes * ctx.micro_batch
    if _dtensor_sp(layer, ctx):
        return (layer.tp_allreduces_bwd * reduce_scatter(nbytes, ctx.tp_group, ctx.cluster)
                + layer.tp_allreduces_fwd * all_gather(nbytes, ctx.tp_group, ctx.cluster))
    return layer.tp_allreduces_bwd * all_reduce(nbytes, ctx.tp_group, ctx.cluster)


def loss_parallel_time(layer: LayerProfile, ctx: Context) -> float:
    """torch's loss parallelism's forward all-reduces over TP, one micro-batch's tokens each. They
    run in the loss, outside the head's forward, so no recompute of the head runs them again."""
    if ctx.seq_len is None or not runs_loss_parallel(layer, ctx.tp, ctx.stack):
        return 0.0
    nbytes = loss_parallel_reduce_bytes(ctx.seq_len * ctx.micro_batch)
    return LOSS_PARALLEL_ALL_REDUCES * all_reduce(nbytes, ctx.tp_group, ctx.cluster)


def fresh_page_time(tensor_bytes: float, count: float, cluster: Cluster) -> float:
    """Seconds to map `count` new tensors of `tensor_bytes` each on a host whose allocator hands
    tensors of at least `fresh_page_min_bytes` back to the OS when freed (glibc's mmap ceiling):
    each one is page-faulted and zeroed again at `fresh_page_gbps`. Zero under a caching allocator."""
    gpu = cluster.gpu
    if gpu.fresh_page_gbps is None or tensor_bytes < (gpu.fresh_page_min_bytes or 0.0):
        return 0.0
    return count * tensor_bytes / (gpu.fresh_page_gbps * 1e9)


def fresh_tensor_times(layer: LayerProfile, ctx: Context) -> tuple[float, float]:
    """(forward, backward) seconds of mapping a layer's large new tensors each micro-batch:
    the loss's logits and log-probabilities (forward) and their gradients (backward), and the
    gradient of its largest weight (backward; the embedding's dense table, a tied head's copy)."""
    split = _split(layer, ctx)
    per_tensor = layer.act_transient * ctx.micro_batch / 2 / (split if layer.act_transient_tp == "S" else 1)
    transient = fresh_page_time(per_tensor, 2, ctx.cluster)
    grad_bytes = state_bytes_per_param(ctx.dtype, ctx.stack)[1]
    weight = fresh_page_time(layer.largest_weight * grad_bytes / split, 1, ctx.cluster)
    return transient, transient + weight


@dataclass(frozen=True)
class LayerParts:
    """What a layer costs whatever its checkpointing: its time without recomputation, and the
    parts a policy re-runs (`layer_time` adds them)."""

    plain: LayerTime
    gemm: float
    attention: float
    memory: float
    fresh_forward: float
    comm: float
    host_recompute: float = 0.0  # the host's issue of a checkpoint's replay: the forward's ops and a detach per save
    first_cast: float = 0.0  # of `plain.forward`: autocast's first cast, which a recomputed forward finds cached


def host_issue_time(ops: int, ctx: Context) -> float:
    """Seconds the host takes to issue `ops` aten ops one by one, as eager PyTorch does: a layer's
    kernels run no faster than they are issued (a small model's step on a fast GPU, or a policy that
    replays every op). Zero where the profile has not measured the per-op cost, and on the compile
    and fused stacks, whose fused kernels are far fewer than the traced ops."""
    us = ctx.cluster.gpu.host_op_us
    if us is None or ctx.stack != "eager":
        return 0.0
    return ops * us * 1e-6


def layer_parts(layer: LayerProfile, ctx: Context) -> LayerParts:
    gemm, attention, memory = forward_parts(layer, ctx)
    fresh_forward, fresh_backward = fresh_tensor_times(layer, ctx)
    cast_forward, cast_backward = fp8_cast_times(layer, ctx)
    memory += cast_forward  # a recomputed forward casts again
    compute = gemm + attention + memory
    comm = forward_collectives(layer, ctx)
    first_cast = cast_params_on_rank(layer, ctx.tp, ctx.ep) * ctx.first_cast_seconds
    weight_grad = (gemm + dense_gradient_time(layer, ctx) + cast_back_time(layer, ctx)
                   + layer_params_on_rank(layer, ctx.tp, ctx.ep) * ctx.accumulation_seconds)
    backward = (BACKWARD_FACTOR * (compute - cast_forward) + cast_backward + weight_grad - gemm
                + fresh_backward + (FUSED_ATTENTION_BACKWARD - BACKWARD_FACTOR) * attention * (layer.act_attention_scores == 0))
    plain = LayerTime(
        forward=max(compute + fresh_forward + first_cast, host_issue_time(layer.host_ops_forward, ctx)),
        weight_grad=weight_grad,
        backward=max(backward, host_issue_time(layer.host_ops_backward, ctx)),
        recompute=0.0,
        tp_comm=(comm + backward_tp_collectives(layer, ctx) + cp_gather_time(layer, ctx)
                 + expert_exchange_time(layer, ctx) + loss_parallel_time(layer, ctx)),
    )
    return LayerParts(plain, gemm, attention, memory, fresh_forward, comm,
                      host_issue_time(layer.host_ops_forward + layer.host_ops_saved, ctx), first_cast)


def fp8_cast_times(layer: LayerProfile, ctx: Context) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch's FP8 casts (costmodel.fp8), memory-bound."""
    forward, backward = cast_bytes(layer, ctx.dtype, ctx.stack, ctx.micro_batch, _split(layer, ctx))
    bandwidth = memory_bandwidth(ctx.cluster.gpu)
    return forward / bandwidth, backward / bandwidth


def amax_time(layer: LayerProfile, ctx: Context) -> float:
    """A micro-batch's amax all-reduces over the TP group (dynamic scaling of split tensors)."""
    count = amax_all_reduces(layer, ctx.dtype, ctx.stack, _split(layer, ctx))
    return count * all_reduce(4.0, ctx.tp_group, ctx.cluster) if count else 0.0


def layer_time(layer: LayerProfile, ctx: Context, recompute: str, parts: LayerParts | None = None) -> LayerTime:
    """The layer's time under `recompute` (`parts`: its `layer_parts`, where already known)."""
    p = parts or layer_parts(layer, ctx)
    if recompute == "full":
        extra, extra_comm = max(p.plain.forward - p.first_cast, p.host_recompute), p.comm
    elif recompute == "selective" and layer.act_attention_scores > 0:
        # Re-run QK^T, softmax and AV; with flash attention (no saved scores)
        # the kernel's backward already recomputes them, so nothing is added.
        extra, extra_comm = p.attention + _scores_traffic_time(layer, ctx), 0.0
    elif recompute == "op" and layer.act_op_split is not None:
        # every op but the saved products and attention kernels re-runs: the memory-bound ones, every
        # second matrix multiply, and the TP collectives but the reduce-scatters SP saves
        recomputed_gemm = p.gemm * layer.op_recompute_flops / layer.matmul_flops if layer.matmul_flops else 0.0
        # the policy's dispatch mode replays every op of the forward, the saved ones answered from its cache
        extra = max(p.memory + p.fresh_forward + recomputed_gemm, p.host_recompute)
        # it keeps the row-split products' outputs: under SP their reduce-scatters are not run again
        extra_comm = (exposed_tp_time(sp_gather_time(layer, ctx), layer, ctx, 1.0) if _dtensor_sp(layer, ctx)
                      else p.comm * (0.5 if ctx.sp and ctx.tp > 1 else 1.0))
    else:
        return p.plain
    return replace(p.plain, recompute=extra, tp_comm=p.plain.tp_comm + extra_comm)


# zero-fill and scatter-add of the rows used; adding it into `.grad` after a step's first micro-batch is
# every weight's (`accumulation.accumulation_bytes_per_param`)
DENSE_GRADIENT_PASSES = 2


def cast_back_time(layer: LayerProfile, ctx: Context) -> float:
    """A micro-batch's backward turning the gradients of the layer's autocast weight copies back
    into the master dtype (`autocast.cast_bytes_per_element`), memory-bound; a weight-gradient
    cost, run with the W of a zero-bubble schedule."""
    return cast_params_on_rank(layer, ctx.tp, ctx.ep) * ctx.cast_back_seconds


def dense_gradient_time(layer: LayerProfile, ctx: Context) -> float:
    """An embedding backward's dense table gradient: memory traffic per micro-batch that
    does not shrink with the batch (`dense_gradient_split`: whole under DTensor's TP)."""
    if not layer.grad_dense_bytes:
        return 0.0
    gpu = ctx.cluster.gpu
    nbytes = DENSE_GRADIENT_PASSES * layer.grad_dense_bytes / dense_gradient_split(layer, ctx.tp, ctx.stack)
    return nbytes / memory_bandwidth(gpu)


def _scores_traffic_time(layer: LayerProfile, ctx: Context) -> float:
    gpu = ctx.cluster.gpu
    nbytes = layer.act_attention_scores * ctx.micro_batch / _split(layer, ctx)
    return nbytes / memory_bandwidth(gpu)


def recompute_flops(layer: LayerProfile, recompute: str) -> float:
    """Extra FLOPs per sequence that recomputation adds (counted in hardware FLOP/s)."""
    if recompute == "full":
        return layer.matmul_flops + layer.attention_flops
    if recompute == "selective" and layer.act_attention_scores > 0:
        return layer.attention_flops
    if recompute == "op":
        return layer.op_recompute_flops
    return 0.0
