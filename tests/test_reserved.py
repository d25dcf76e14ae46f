"""What torch's caching allocator reserves beyond the tensors (costmodel/reserved.py, from
planner/trace/allocations.py's replay of a layer's traced ops). Its composition is held to the
dry run's replay of the executor's own allocations in tests/test_memory_vs_dry_run.py."""
from __future__ import annotations

import warnings

import planner
from planner.trace.workload_for import workload_for

SEQ = 4096


def _profiles(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        workload, graph = workload_for(name, seq_len=SEQ)
    return {s.layer.kind: s.layer for s in workload.segments}, graph.meta["vocab"]


def test_the_loss_leaves_its_16_bit_logits_reserved():
    """The loss upcasts the bf16 logits to fp32 and frees them; the fp32 log-probabilities that
    follow are twice their size and cannot take their block: about the bf16 logits' bytes stay
    reserved (20 MiB pages round it up a little). A block frees nothing so large."""
    layers, vocab = _profiles("llama-160m")
    logits = 2 * SEQ * vocab
    assert logits <= layers["head"].act_allocator_slack <= 1.15 * logits
    assert layers["block"].act_allocator_slack < 0.2 * layers["head"].act_allocator_slack


def test_an_estimate_reports_reserved_beside_allocated():
    """Reserved is never below the tensors' peak, and FSDP2's own pools add to it: the same layout
    sharded (ZeRO-3) keeps more reserved over its tensors than replicated (ZeRO-1, no gathers)."""
    over = {}
    for zero in (1, 3):
        plan = planner.plan("llama-160m", "8xh100-sxm", global_batch=16, seq_len=SEQ,
                            fixed={"dp": 8, "tp": 1, "pp": 1, "zero": zero, "micro_batch": 2, "recompute": "none"})
        est = plan.estimate
        assert est.peak_reserved_bytes >= est.peak_memory_bytes
        assert all(s.reserved_bytes >= s.peak_bytes for s in est.stages)
        over[zero] = est.peak_reserved_bytes - est.peak_memory_bytes
    assert over[3] > over[1] > 0
