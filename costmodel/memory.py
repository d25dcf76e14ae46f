"""Peak memory of one rank: model states under ZeRO, and saved activations.

Model states depend on the kernel stack (`Plan.stack`), each 16 bytes per
parameter in mixed precision but split differently, which matters once ZeRO
shards some categories and not others:
- fused (Megatron-LM, the ZeRO paper's mixed precision Adam, Rajbhandari et
  al. 2020): 2 bytes of 16-bit weights, 2 of gradients and 12 of fp32 optimizer
  state (master weights, momentum, variance). FP8 (Transformer Engine style)
  adds the 1-byte FP8 copy its GEMMs read.
- eager and compile (PyTorch autocast, what the executor runs): the fp32
  weights are the master copy, so 4 bytes of weights, 4 of fp32 gradients and
  8 of AdamW moments; FSDP2 gathers the 16-bit copy only while a unit runs
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

from .workload import LayerProfile

OPTIMIZER_BYTES = {"fp32": 8, "bf16": 12, "fp16": 12, "fp8": 12}
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}  # fp8: bf16 weights, gradients and collectives
FP8_WEIGHT_COPY_BYTES = 1  # per held weight: the FP8 cast the GEMMs read, kept beside the bf16 weight
AUTOCAST_STATE_BYTES = (4, 4, 8)  # eager/compile: fp32 weights (the master), fp32 gradients, AdamW's two moments


def state_bytes_per_param(dtype: str, stack: str = "eager") -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter, unsharded."""
    if stack != "fused":
        return AUTOCAST_STATE_BYTES
    w = WEIGHT_BYTES[dtype] + (FP8_WEIGHT_COPY_BYTES if dtype == "fp8" else 0)
    return w, WEIGHT_BYTES[dtype], OPTIMIZER_BYTES[dtype]


def model_state_bytes(params: float, dtype: str, zero: int, dp: int, stack: str = "eager") -> dict[str, float]:
    """Weights, gradients and optimizer state of `params` parameters on one rank."""
    w, g, o = state_bytes_per_param(dtype, stack)
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


MOMENT_BYTES = 4  # AdamW's moments are fp32 on every stack
OPTIMIZER_TRAFFIC_BYTES = 28  # AdamW per owned parameter: read grad+states+weights, write states+weights


def optimizer_step_bytes(owned_params: float, largest_owned: float, device_type: str, stack: str = "eager") -> float:
    """Temporaries torch's AdamW makes during its step, when activations are gone but every
    gradient is there: on cuda its default foreach path computes sqrt(v) for all the rank's
    owned parameters at once (one moment's size); on cpu its per-tensor loop makes sqrt(v)
    and its quotient by the bias correction as two new tensors, one parameter at a time (the
    largest's, twice). The fused stack's multi-tensor Adam updates in place."""
    if stack == "fused":
        return 0.0
    if device_type == "cpu":
        return 2 * MOMENT_BYTES * largest_owned
    return MOMENT_BYTES * owned_params


def activation_bytes(layer: LayerProfile, recompute: str, *, tp: int, sp: bool, micro_batch: float,
                     cp: int = 1, kv_bytes: float = 0.0, stack: str = "eager") -> float:
    """Bytes one layer keeps for backward, per micro-batch (`micro_batch` sequences' worth of
    tokens: micro_batch / cp under context parallelism), on one TP rank.

    Sequence parallelism splits the replicated activations over TP; under DTensor (the eager
    and compile stacks) each column-split linear still saves its all-gathered input whole, and
    a gathered output's loss stays whole (`act_sp_whole` in place of `act_sp_dropped`); the
    fused stack (Megatron) saves the shards. Context parallelism's attention also saves the
    keys and values it all-gathered from the other cp ranks (`kv_bytes`: one whole sequence's,
    per attention layer) unless the layer is recomputed, which gathers them again."""
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
        kept = layer.act_replicated / replicated_split + layer.act_tp_sharded / t
        if sp and t > 1 and stack != "fused":
            kept += layer.act_sp_whole - layer.act_sp_dropped / t
        if recompute in ("none", "op"):  # op on a layer not traced for it: priced as none, as its time is
            kept += layer.act_attention_scores / t
            if cp > 1 and layer.attention_flops:
                kept += kv_bytes * (cp - 1) / t
    return kept * micro_batch


def transient_bytes(layer: LayerProfile, *, tp: int, sp: bool, micro_batch: float, stack: str = "eager",
                    **_) -> float:
    """One layer's temporaries at its worst moment on one TP rank (`LayerProfile.act_transient`):
    split where the tensors setting them are, or are sequence-split; a gathered output's stay
    whole except on the fused stack (Megatron's vocabulary-parallel loss)."""
    t = tp if layer.tp_shardable else 1
    kind = layer.act_transient_tp
    split = t if kind == "S" or (kind == "R" and sp) or (kind == "whole" and stack == "fused") else 1
    return layer.act_transient / split * micro_batch


def in_flight_micro_batches(schedule: str, rank: int, pp: int, vpp: int, num_micro_batches: int) -> float:
    """How many micro-batches of a stage's activations pipeline rank `rank` holds at its peak.

    GPipe runs all forwards first; 1F1B holds at most pp - rank; interleaved
    1F1B warms up with 2*(pp-rank-1) + (vpp-1)*pp chunk forwards (Narayanan et
    al. 2021), each holding 1/vpp of the rank's layers; torch's zero-bubble ZB1P
    with (pp-rank-1) + (vpp-1)*pp (one hop each, not two: its 1x-memory design).
    """
    m = num_micro_batches
    if schedule == "gpipe":
        return float(m)
    if schedule in ("interleaved", "zero-bubble"):
        hops = 2 if schedule == "interleaved" else 1
        chunks = min(m * vpp, hops * (pp - rank - 1) + (vpp - 1) * pp + 1)
        return chunks / vpp
    return float(min(m, pp - rank))


def activation_keywords(plan, kv_bytes: float) -> dict:
    """`activation_bytes`'s layout keywords for `plan` (`kv_bytes`: one sequence's keys and
    values of one attention layer, `costmodel.compute.Context.cp_kv_bytes`)."""
    return dict(tp=plan.tp, sp=plan.sp, micro_batch=plan.micro_batch_per_rank, cp=plan.cp, kv_bytes=kv_bytes,
                stack=plan.stack)
