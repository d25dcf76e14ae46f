"""The cost model's prediction for a run, through one small function.

Kept apart so that the executor works (and says so) when the estimator, the
workload builder or a hardware profile is missing.
"""
from __future__ import annotations

from costmodel.plan import Plan
from executor.models import build_model


def workload_for(model_name: str, plan: Plan):
    """The analytic workload of a reference-GPT-shaped model (fp32 on CPU runs)."""
    from costmodel.transformer import TransformerDims, transformer_workload

    model = build_model(model_name)
    cfg = getattr(model, "cfg", None)
    if cfg is None:
        return None
    dtype_bytes = {"fp32": 4, "bf16": 2, "fp16": 2}[plan.dtype]
    dims = TransformerDims(n_layers=cfg.n_layers, hidden=cfg.hidden, heads=cfg.heads, vocab=cfg.vocab_size,
                           seq_len=plan.seq_len, ffn_hidden=cfg.ffn, dtype_bytes=dtype_bytes, name=model_name)
    return as_executed(transformer_workload(dims))


def as_executed(workload):
    """The workload as the executor runs it: under TP the LM head's output is gathered
    (ColwiseParallel with a replicated output) and the loss is a plain cross-entropy on
    the full logits, not a vocabulary-parallel one, so every TP rank keeps the whole
    fp32 logits for backward: the head's TP-split activations are replicated, and each
    forward all-gathers the logits (seq_len x vocab in the model's dtype per sequence).

    The TP collectives are the ones DTensor issues (counted with torch.profiler on a
    2-rank block: 6 gloo all-reduces per forward + backward): a column-split linear
    all-reduces its replicated input's gradient in backward, and the reference GPT
    has separate q, k and v projections, so a block's backward all-reduces 4 times
    (q, k, v, up), not the 2 of a fused-QKV mirror; the head's input gradient is
    all-reduced too; the vocabulary-split embedding reduces only in forward."""
    s, h, b = workload.seq_len, workload.hidden, workload.dtype_bytes
    segments = []
    for seg in workload.segments:
        layer = seg.layer
        if layer.kind == "head" and layer.act_tp_sharded:
            layer = layer.model_copy(update={"act_replicated": layer.act_replicated + layer.act_tp_sharded,
                                             "act_tp_sharded": 0.0, "tp_gather_bytes": float(s * workload.vocab * b),
                                             "tp_allreduces_fwd": 0, "tp_allreduces_bwd": 1,
                                             "tp_comm_bytes": float(s * h * b)})
        elif layer.kind == "block" and layer.tp_allreduces_fwd == 2:
            layer = layer.model_copy(update={"tp_allreduces_bwd": 4})
        elif layer.kind == "embedding" and layer.tp_shardable:
            layer = layer.model_copy(update={"tp_allreduces_bwd": 0})
        segments.append(seg.model_copy(update={"layer": layer}))
    return type(workload).model_validate({**workload.model_dump(), "segments": [s.model_dump() for s in segments]})


def predict(plan: Plan, model_name: str, cluster) -> tuple[float | None, float | None, str]:
    """(step time s, peak bytes, note); Nones with the reason when no prediction is possible."""
    if cluster is None:
        return None, None, "no hardware profile given: prediction columns left out"
    try:
        from costmodel.estimate import estimate
    except ImportError:
        return None, None, "costmodel.estimate not available: prediction columns left out"
    workload = workload_for(model_name, plan)
    if workload is None:
        return None, None, f"no analytic workload for {model_name}: prediction columns left out"
    result = estimate(workload, plan, cluster)
    return result.step_time_s, result.peak_memory_bytes, ""
