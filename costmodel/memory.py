"""Peak memory of one rank: model states under ZeRO, and saved activations.

Model states depend on the kernel stack (`Plan.stack`), each 16 bytes per
parameter in mixed precision but split differently, which matters once ZeRO
shards some categories and not others:
- fused (Megatron-LM, the ZeRO paper's mixed precision Adam, Rajbhandari et
  al. 2020): 2 bytes of 16-bit weights, 2 of gradients and 12 of fp32 optimizer
  state (master weights, momentum, variance). FP8 (Transformer Engine style)
  adds the 1-byte FP8 copy its GEMMs read.
- eager and compile (PyTorch autocast, what the executor runs): the weights
  are the master copy, so by default 4 bytes of weights, 4 of fp32 gradients and
  8 of AdamW moments, and 2 + 2 + 4 with a bf16 master (`Plan.master_dtype`);
  FSDP2 gathers the 16-bit copy only while a unit runs
  (`executor.apply.data_parallel.mixed_precision`), priced as ZeRO-3 buffers.
ZeRO stage 1 shards the optimizer state, stage 2 also the gradients, stage 3
everything over the data-parallel group; FSDP2's ZeRO-2 (the eager and compile
stacks) shards the fp32 weights at rest too and holds their gathered 16-bit copy
through the step (`gathered_weight_bytes`). In fp32 training every stack holds
4 + 4 + 8.

Activations follow Korthikanti et al. 2022 per policy: "none" keeps
everything, "selective" drops the attention scores, "full" keeps only the
layer input and rebuilds one layer at a time in backward; "op" (torchtitan's)
keeps the layer input and the products' outputs it saves (`act_op_*`, traced). Each pipeline rank
holds the activations of as many micro-batches as its schedule keeps in
flight.
"""
from __future__ import annotations

from .fp8 import runs_fp8
from .loss import loss_parallel_transient, runs_loss_parallel
from .workload import LayerProfile, tied_params_on_rank

OPTIMIZER_BYTES = {"fp32": 8, "bf16": 12, "fp16": 12, "fp8": 12}
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}  # the compute copy: fp8 runs bf16 weights, gradients and collectives
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # a state or reduction dtype (Plan.master_dtype, optimizer_dtype, reduce_dtype)
FP8_WEIGHT_COPY_BYTES = 1  # per held weight: the FP8 cast the GEMMs read, kept beside the bf16 weight
FP8_BYTES = 1  # one FP8 element: a saved GEMM input under Transformer Engine, an FP8 weight


def state_bytes_per_param(dtype: str, stack: str = "eager", master: str = "fp32", moments: str = "fp32",
                          reduce: str | None = None, fp8_weights: bool = False) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter, unsharded, for compute `dtype`,
    master weights in `master`, AdamW's two moments in `moments` and gradients reduced in
    `reduce` (None: `reduce_bytes`' default).
    - eager and compile (torch autocast and torch's AdamW): the weights are the master copy and
      their gradients share its dtype; the moments are the weights' dtype too (the rulebook
      refuses other pairs), so fp32 states are 4 + 4 + 8 and bf16 ones 2 + 2 + 4.
    - fused (Megatron-LM's mixed precision optimizer, Rajbhandari et al. 2020): 16-bit weights (and
      FP8's cast; `fp8_weights`, Megatron's --fp8-param-gather: the FP8 copy alone), gradients in
      the reduction's dtype (16-bit unless grad_reduce_in_fp32), and an fp32 master copy beside the
      moments unless the master is the 16-bit weights."""
    if dtype == "fp32" or stack != "fused":
        w = DTYPE_BYTES[master] if dtype != "fp32" else 4
        return w, w, 2 * (DTYPE_BYTES[moments] if dtype != "fp32" else 4)
    cast_copy = FP8_WEIGHT_COPY_BYTES if dtype == "fp8" and not fp8_weights else 0
    w = gathered_weight_element_bytes(dtype, fp8_weights) + cast_copy
    grads = DTYPE_BYTES[reduce] if reduce else WEIGHT_BYTES[dtype]
    master_copy = DTYPE_BYTES[master] if master == "fp32" else 0
    return w, grads, master_copy + 2 * DTYPE_BYTES[moments]


def layout_state_bytes(layout, dtype: str) -> tuple[float, float, float]:
    """`state_bytes_per_param` of a layout's precision policy (a Plan's, or the search's
    layouts') at compute `dtype`."""
    return state_bytes_per_param(dtype, layout.stack, layout.master_dtype, layout.optimizer_dtype, layout.reduce_dtype,
                                 layout.fp8_param_gather)


def plan_state_bytes(plan) -> tuple[float, float, float]:
    """`state_bytes_per_param` of a plan's precision policy."""
    return layout_state_bytes(plan, plan.dtype)


def gathered_weight_element_bytes(dtype: str, fp8_weights: bool = False) -> float:
    """Bytes per element of the compute copy of a weight, the one ZeRO all-gathers: the compute
    dtype's 16 bits (FP8 runs bf16 weights), 1 byte with FP8 weights (`Plan.fp8_param_gather`)."""
    return FP8_BYTES if fp8_weights else WEIGHT_BYTES[dtype]


def moment_bytes(plan) -> float:
    """Bytes of one AdamW moment element under the plan's precision."""
    return 4.0 if plan.dtype == "fp32" else float(DTYPE_BYTES[plan.optimizer_dtype])


def reduce_bytes(plan) -> float:
    """Bytes per gradient element on the data-parallel wire: the pinned reduce dtype, else what
    the stack's reference recipe reduces in. On the eager and compile stacks FSDP2's units
    (zero 2/3) reduce in fp32 (torchtitan's `mixed_precision_reduce`, the only value 0.3.0
    takes), DDP and the per-weight all-reduce (zero 0/1) the gradients as autograd made them, in the
    weights' dtype; Megatron reduces its 16-bit gradients, as NeMo's and Megatron-Bridge's
    performance recipes set it (`grad_reduce_in_fp32 = False`). Megatron-LM's own arguments turn
    fp32 accumulation on for bf16 unless `--grad-reduce-in-bf16`: pin reduce_dtype fp32 there."""
    if plan.dtype == "fp32":
        return 4.0
    if plan.reduce_dtype:
        return float(DTYPE_BYTES[plan.reduce_dtype])
    if plan.stack == "fused":
        return float(WEIGHT_BYTES[plan.dtype])
    return 4.0 if plan.zero >= 2 else float(DTYPE_BYTES[plan.master_dtype])


def held_gradient_bytes(params: float, plan) -> float:
    """The unsharded gradients FSDP2 holds between micro-batches under `hold_unsharded`
    (`Layout.holds_unsharded_gradients`), `params` being the rank's (TP- and stage-split):
    FSDP2 upcasts them to the reduce dtype where it differs from the compute copy's
    (`FSDPParam.to_accumulated_grad_if_needed`; fp32 by default) and keeps them in the compute
    dtype where the two agree, so in `reduce_bytes` either way. The adds that accumulate them
    each micro-batch are not priced (a few bytes per parameter of HBM traffic)."""
    return params * reduce_bytes(plan) if plan.holds_unsharded_gradients and plan.num_micro_batches > 1 else 0.0


def bucket_copy_bytes(params: float, plan, stepping: bool) -> float:
    """DDP's buckets beside the gradients (`Layout.copies_into_buckets`), `params` being the
    rank's dense ones (DDP leaves the experts to their own reduction): every gradient has a copy
    in the gradient's dtype from DDP's construction on. The gradients themselves come and go
    (zero_grad sets them to None): at the optimizer step both are there, at the activation peak
    the buckets alone unless micro-batches accumulate into `.grad` (`stepping` False: the peak).
    With views (the executor's default) the buckets are the gradients."""
    if not plan.copies_into_buckets or (not stepping and plan.num_micro_batches < 2):
        return 0.0
    return params * reduce_bytes(plan)


def model_state_bytes(params: float, dtype: str, zero: int, dp: int, stack: str = "eager",
                      per_param: tuple[float, float, float] | None = None) -> dict[str, float]:
    """Weights, gradients and optimizer state of `params` parameters on one rank
    (`per_param`: the plan's `plan_state_bytes`; default, fp32 master and moments)."""
    w, g, o = per_param or state_bytes_per_param(dtype, stack)
    weights, grads, optimizer = w * params, g * params, o * params
    if zero >= 1:
        optimizer /= dp
    if zero >= 2:
        grads /= dp
    if zero >= 3 or (zero == 2 and stack != "fused"):  # FSDP2's ZeRO-2 shards the weights at rest too
        weights /= dp
    return {"weights": weights, "gradients": grads, "optimizer": optimizer}


def gathered_weight_bytes(params: float, dtype: str, zero: int, dp: int, stack: str = "eager") -> float:
    """ZeRO-2 as FSDP2 runs it (eager and compile stacks: fully_shard without resharding after
    forward): the rank's whole 16-bit weights, gathered at their first forward and held until
    their backward ends, beside the sharded fp32 master weights."""
    return WEIGHT_BYTES[dtype] * params if zero == 2 and dp > 1 and stack != "fused" else 0.0


OPTIMIZER_TRAFFIC_BYTES = 28  # AdamW per owned fp32 parameter: read grad+states+weights, write states+weights


def optimizer_traffic_bytes(plan) -> float:
    """AdamW's memory traffic per owned parameter under the plan's precision: it reads the
    gradient, the weights and both moments and writes the weights and the moments back
    (28 bytes in fp32, 14 with bf16 weights and moments); Megatron's reads its 16-bit gradient and
    fp32 master and moments, writes those and the 16-bit copy (28)."""
    w, g, o = plan_state_bytes(plan)
    if plan.stack == "fused" and plan.dtype != "fp32":
        return g + 2 * o + WEIGHT_BYTES[plan.dtype]
    return g + 2 * w + 2 * o


def optimizer_step_bytes(owned_params: float, largest_owned: float, device_type: str, stack: str = "eager",
                         moment_bytes: float = 4) -> float:
    """Temporaries torch's AdamW makes during its step, when activations are gone but every
    gradient is there: on cuda its default foreach path computes sqrt(v) for all the rank's
    owned parameters at once (one moment's size); on cpu its per-tensor loop makes sqrt(v)
    and its quotient by the bias correction as two new tensors, one parameter at a time (the
    largest's, twice), each in the moments' dtype (`moment_bytes`). The fused stack's
    multi-tensor Adam updates in place."""
    if stack == "fused":
        return 0.0
    if device_type == "cpu":
        return 2 * moment_bytes * largest_owned
    return moment_bytes * owned_params


def dense_gradient_split(layer: LayerProfile, tp: int, stack: str) -> int:
    """The TP ranks an embedding's dense gradient (`grad_dense_bytes`) is split over. DTensor's
    embedding backward (the eager and compile stacks) computes the whole table's gradient on
    every TP rank and then keeps its vocabulary shard: in the dry run of llama-3-8b tp2,
    `embedding_dense_backward` writes the whole fp32 table, 2,004 MiB. Megatron's
    vocabulary-parallel embedding (the fused stack) computes its shard only."""
    return tp if layer.tp_shardable and stack == "fused" else 1


def held_gradient_shards(layer: LayerProfile, plan, tied_on_rank: bool) -> float:
    """How many TP shards of `layer`'s gradient a rank keeps: FSDP2 holding it unsharded between
    micro-batches (`held_gradient_bytes`), or `.grad` without FSDP2's units
    (`peak.whole_gradient_params`). An embedding's whole table where DTensor's backward makes it whole
    (`dense_gradient_split`) and it is the weight's first gradient, kept as made; one otherwise,
    and for a table tied to a head on the same rank (`tied_on_rank`), whose shard-shaped gradient
    comes first. Seen in the dry run of llama-160m dp2 tp4+sp ZeRO-2 holding its gradients: 0.30
    GiB of FSDP2's buffers, the table's 73.7 MB above its shard (llama-3.2-1b, tied: none)."""
    if layer.kind == "embedding" and layer.tp_shardable and plan.tp > 1 and not tied_on_rank:
        return plan.tp / dense_gradient_split(layer, plan.tp, plan.stack)
    return 1.0


def tied_on_rank(workload, plan) -> bool:
    """Whether the model's head shares its embedding's weight on one rank: tied, and no pipeline
    cutting the two apart into copies of their own (`executor/apply/tied.py`)."""
    return plan.pp == 1 and any(segment.layer.tied_params for segment in workload.segments)


def new_gradient_bytes(layer: LayerProfile, plan) -> float:
    """The largest weight gradient `layer` computes into a new tensor before it is added to
    `.grad`, on one TP rank: the embedding's dense table (`dense_gradient_split`) or, where a
    pipeline cuts a tied head from its embedding, the head's own copy of the table."""
    tied = tied_params_on_rank(layer, plan.tp) * WEIGHT_BYTES[plan.dtype] if plan.pp > 1 else 0.0
    return max(layer.grad_dense_bytes / dense_gradient_split(layer, plan.tp, plan.stack), tied)


def activation_bytes(layer: LayerProfile, recompute: str, *, tp: int, sp: bool, micro_batch: float,
                     cp: int = 1, kv_bytes: float = 0.0, stack: str = "eager", dtype: str = "bf16") -> float:
    """Bytes one layer keeps for backward, per micro-batch (`micro_batch` sequences' worth of
    tokens: micro_batch / cp under context parallelism), on one TP rank.

    Sequence parallelism splits the replicated activations over TP; under DTensor (the eager
    and compile stacks) each column-split linear still saves its all-gathered input whole, and
    a gathered output's loss stays whole (`act_sp_whole` in place of `act_sp_dropped`); the
    fused stack (Megatron) saves the shards. Context parallelism's attention, kept whole, also
    saves the keys and values it all-gathered from the other cp ranks (`kv_bytes`: one whole
    sequence's, per attention layer), repeated to every query head (`kv_groups`), and its mask
    as a bias (`cp_mask_bias_bytes`); a checkpointed layer (full, or op's saved products)
    gathers and masks again in its backward.

    A layer kept whole saves less on the stacks that fuse each chain of pointwise ops into one
    kernel (`fused_saved_bytes`). Pipelined, the last stage also keeps its output, the head's
    logits (`costmodel.in_flight.pipeline_held_logits_bytes`), counted apart: to the backward,
    not to the weight gradients."""
    t = tp if layer.tp_shardable else 1
    replicated_split = t if sp else 1
    if recompute == "full":
        kept = layer.act_input / replicated_split
    elif recompute == "op" and layer.act_op_split is not None:
        # the saved products' outputs: a column-split one's are TP shards, a row-split one's the local
        # partial sums, whole on every TP rank; under SP also the reduce-scatter after each row-split one
        kept = layer.act_input / replicated_split + layer.act_op_split / t + layer.act_op_whole
        if sp and t > 1:
            kept += layer.act_op_reduced / t
    else:
        kept = fused_saved_bytes(layer, layer.act_replicated / replicated_split + layer.act_tp_sharded / t,
                                 stack, dtype, t)
        if sp and t > 1 and stack != "fused":
            kept += layer.act_sp_whole - layer.act_sp_dropped / t
        if recompute in ("none", "op"):  # op on a layer not traced for it: priced as none, as its time is
            kept += layer.act_attention_scores / t
        if cp > 1 and layer.attention_flops:
            kept += kv_bytes * (cp * kv_groups(layer) - 1) / t
            return kept * micro_batch + cp_mask_bias_bytes(layer, cp)
    return kept * micro_batch


def kv_groups(layer: LayerProfile) -> int:
    """Query heads per key/value head: the executor's context-parallel attention repeats the
    gathered keys and values to every query head before its SDPA, which saves them so."""
    call = layer.attention
    return call.heads // call.kv_heads if call is not None else 1


def cp_mask_bias_bytes(layer: LayerProfile, cp: int) -> float:
    """The context-parallel attention's mask of a rank's queries over the whole sequence (its two
    chunks against all 2*cp): SDPA turns the boolean mask into an additive bias of the queries'
    dtype, which its kernel saves for the backward. One per attention call and micro-batch,
    whatever its sequences (broadcast over them and the heads), whole on every TP rank."""
    call = layer.attention
    if call is None:
        return 0.0
    return call.q_len / cp * call.kv_len * call.element_bytes * call.count


def fused_saved_bytes(layer: LayerProfile, kept: float, stack: str, dtype: str, t: int) -> float:
    """What a layer kept whole saves (`kept`: eager's bytes per sequence on one TP rank) on a stack
    that fuses each chain of pointwise ops into one kernel, which saves the chain's inputs and
    rebuilds the rest inside its backward kernel.
    - compile: inductor's min-cut partition of the joint graph (`act_compiled_share`, torch's own
      recompute rules).
    - fused: Megatron-LM's kernels do the same by hand: Transformer Engine's norms save their
      input and the inverse deviation, the fused SwiGLU its input (`bias_swiglu_impl` recomputes
      the activation in backward), the fused rotary embedding nothing but its angles; priced by the
      same min-cut share. Under FP8, Transformer Engine's linear layers save their input as the
      1-byte FP8 copy the weight-gradient GEMM reads, not the 16-bit tensor
      (`gemm_input_elements`, split over TP as the fused stack saves the shards; a column-split
      input saved whole without SP keeps more, so this errs towards more memory).
    - eager: every op's saved tensors, as traced."""
    if stack in ("compile", "fused") and layer.act_compiled_share is not None:
        kept *= layer.act_compiled_share
    if stack == "fused" and runs_fp8(layer, dtype):
        kept -= layer.gemm_input_elements * (WEIGHT_BYTES["bf16"] - FP8_BYTES) / t
    return max(kept, 0.0)


def transient_bytes(layer: LayerProfile, *, tp: int, sp: bool, micro_batch: float, stack: str = "eager",
                    **_) -> float:
    """One layer's temporaries at its worst moment on one TP rank (`LayerProfile.act_transient`,
    as traced on one device; a head under torch's loss parallelism, its kernels'): split where
    the tensors setting them are, or are sequence-split."""
    if runs_loss_parallel(layer, tp, stack):
        return loss_parallel_transient(layer) / tp * micro_batch
    return layer.act_transient / transient_split(layer, tp, sp) * micro_batch


def transient_split(layer: LayerProfile, tp: int, sp: bool) -> int:
    """How many TP ranks share the tensors that set a layer's temporaries (`act_transient_tp`)."""
    t = tp if layer.tp_shardable else 1
    kind = layer.act_transient_tp
    return t if kind == "S" or (kind == "R" and sp) else 1


def activation_keywords(layout, kv_bytes: float, dtype: str) -> dict:
    """`activation_bytes`'s layout keywords for `layout` in compute `dtype` (`kv_bytes`: one
    sequence's keys and values of one attention layer, `costmodel.compute.Context.cp_kv_bytes`)."""
    return dict(tp=layout.tp, sp=layout.sp, micro_batch=layout.micro_batch_per_rank, cp=layout.cp, kv_bytes=kv_bytes,
                stack=layout.stack, dtype=dtype)
