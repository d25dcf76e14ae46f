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


def test_a_layout_whose_tensors_fit_runs_with_the_allocators_retries_and_says_so(capsys):
    """llama-3-8b, dp8 ZeRO-3, one 32K sequence per rank, full recompute, on 8 H100s: its predicted
    reservation passes what the GPU leaves, its tensors do not; it is flagged, not refused, as the
    allocator's replay on the device runs it (tests/test_runtime_memory.py); 133 GiB of tensors is refused."""
    from parallax_cli import main

    args = ["estimate", "llama-3-8b", "--hw", "8xh100-sxm", "--dp", "8", "--zero", "3", "--micro-batch"]
    assert main([*args, "1", "--global-batch", "8", "--seq-len", "32768", "--recompute", "full"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "its 67 GiB of tensors fit, so it runs with torch's caching allocator giving its cache back" in out
    assert main([*args, "2", "--global-batch", "16", "--seq-len", "8192", "--recompute", "none"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "GiB of tensors > 75 GiB usable" in out and "retrying" not in out
