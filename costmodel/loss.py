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
        "act_replicated": saved, "act_sp_whole": saved, "act_sp_dropped": saved, "act_transient": float(logits),
        "act_allocator_slack": 0.0, "under_autocast": _fused(layer.under_autocast, workload),
        "other_path": _fused(layer.other_path, workload)})
