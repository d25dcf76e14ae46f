"""The cross-entropy kernel a run computes its loss with, and what it keeps.

Why: the loss is the largest single tensor of a step at a large vocabulary, and kernels differ
by a factor of four there. torch's `F.cross_entropy` over logits upcast to fp32 (what the
executor, torchtitan and HF's models run, and what the tracer sees) saves the fp32
log-probabilities and makes fp32 gradients beside them. A fused cross-entropy kernel reads the
16-bit logits, keeps them and one fp32 log-sum-exp per token for the backward, and writes a
16-bit gradient: flash-attn's Triton `CrossEntropyLoss`, which llm-foundry's MPT models take by
default (`ComposerMPTCausalLM`: `loss_fn` defaults to `fused_crossentropy` where flash-attn is
installed). Published runs name theirs (`benchmarks/published_runs.py`'s `loss` column); the
executor runs torch's, so no plan offers the fused one. Its memory is priced here; its traffic
stays the traced kernels', a small share of a step.
"""
from __future__ import annotations

from .workload import LayerProfile, Segment, Workload

LOSS_KERNELS = ("torch", "fused")
LOG_SUM_EXP_BYTES = 4  # one fp32 per token
FP32_BYTES = 4  # the loss upcasts the logits to fp32, whatever the compute dtype
# torch's loss parallelism (torch.distributed.tensor.parallel.loss, the nll-loss backward it
# substitutes): a zeros tensor scattered with the targets, the saved log-probabilities' exp, and
# their sum, all fp32 vocabulary shards alive at once beside the saved log-probabilities, where
# aten's fused nll-loss and log-softmax backwards keep two
LOSS_PARALLEL_TEMPORARIES = 3
# its forward all-reduces one fp32 per token over TP three times: the logits' maximum, the sum of
# their exponentials, and the target's logit (torch 2.13's `_log_softmax` and `_nll_loss_forward`
# there); its backward is local
LOSS_PARALLEL_ALL_REDUCES = 3


def runs_loss_parallel(layer: LayerProfile, tp: int, stack: str) -> bool:
    """Whether the executor computes this layer's loss with torch's loss parallelism: the head of
    a DTensor stack whose TP splits it (`executor.apply.tensor_parallel` leaves its logits split
    over the vocabulary). The fused stack's Megatron-LM runs a vocabulary-parallel loss of its own."""
    return layer.kind == "head" and tp > 1 and layer.tp_shardable and stack != "fused"


def loss_parallel_reduce_bytes(tokens: float) -> float:
    """Bytes of each of the forward's all-reduces over `tokens` tokens of logits."""
    return tokens * FP32_BYTES


def loss_parallel_transient(layer: LayerProfile) -> float:
    """Per sequence and over the whole vocabulary, the temporaries at the worst moment of torch's
    loss parallelism, its backward; each TP rank holds its vocabulary shard of them. A dry run of
    llama-3.2-1b dp2 tp4+sp at 4096 tokens, 8 sequences, peaked there with three 4008 MiB fp32
    shards beside the saved log-probabilities."""
    return LOSS_PARALLEL_TEMPORARIES * layer.gemm_output_elements * FP32_BYTES


def with_loss_kernel(workload: Workload, kernel: str) -> Workload:
    """`workload` with its head keeping what `kernel` keeps (torch's: as traced)."""
    if kernel not in LOSS_KERNELS:
        raise ValueError(f"unknown loss kernel {kernel!r} (use one of {', '.join(LOSS_KERNELS)})")
    if kernel == "torch" or not workload.vocab:
        return workload
    segments = [Segment(layer=_fused(s.layer, workload) if s.layer.kind == "head" else s.layer, count=s.count)
                for s in workload.segments]
    # a new model, not model_copy: the copy would carry the cached expanded `layers` along
    return Workload(**{**{name: getattr(workload, name) for name in Workload.model_fields}, "segments": segments})


def _fused(layer: LayerProfile | None, workload: Workload) -> LayerProfile | None:
    """The head under a fused kernel, per sequence: its input, the 16-bit logits and the
    log-sum-exp saved (SP gathers them whole, as it gathers torch's log-probabilities), the
    16-bit gradient the only temporary, and no fp32 block beside it for the allocator to strand."""
    if layer is None:
        return None
    logits = workload.seq_len * workload.vocab * workload.dtype_bytes
    saved = layer.act_input + logits + workload.seq_len * LOG_SUM_EXP_BYTES
    return layer.model_copy(update={
        "act_replicated": saved, "act_tp_sharded": 0.0, "act_sp_whole": saved, "act_sp_dropped": saved,
        "act_transient": float(logits),
        "act_allocator_slack": 0.0, "under_autocast": _fused(layer.under_autocast, workload),
        "other_path": _fused(layer.other_path, workload)})
