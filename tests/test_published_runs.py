"""benchmarks/published_runs.py predicts any CSV with the documented columns, and never crashes."""
import csv
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("published_runs", ROOT / "benchmarks" / "published_runs.py")
published_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(published_runs)

COLUMNS = ("id,n_layers,hidden,heads,kv_heads,ffn_hidden,gated_mlp,seq_len,vocab,global_batch,micro_batch,tp,pp,dp,"
           "vpp,seq_parallel,recompute,zero_stage,gpu,n_gpus,gpus_per_node,nic_gbps_per_gpu,n_experts,top_k,ep,metric,"
           "value").split(",")
ROWS = [
    # a 96-layer model with interleaving depth 6: outside the searched depths, still estimated
    dict(id="vpp6", n_layers=96, hidden=12288, heads=96, seq_len=2048, vocab=51200, global_batch=1536, micro_batch=1,
         tp=8, pp=8, dp=16, vpp=6, seq_parallel="yes", recompute="selective", zero_stage=1, gpu="a100-80g",
         n_gpus=1024, gpus_per_node=8, nic_gbps_per_gpu=200, metric="tflops_per_gpu_model", value=150),
    # ZeRO-3 of a 530B model on 64 GPUs: the memory model rejects it; estimated and flagged
    dict(id="too_big", n_layers=105, hidden=20480, heads=128, seq_len=2048, vocab=51200, global_batch=64, micro_batch=1,
         tp=1, pp=1, dp=64, zero_stage=3, recompute="full", gpu="a100-80g", n_gpus=64, gpus_per_node=8,
         nic_gbps_per_gpu=200, metric="tflops_per_gpu_model", value=100),
    dict(id="hsdp", n_layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, gated_mlp="yes", seq_len=4096,
         vocab=128256, global_batch=256, micro_batch=1, tp=1, pp=1, dp=64, zero_stage=3, recompute="none",
         gpu="h100-sxm", n_gpus=64, gpus_per_node=8, nic_gbps_per_gpu=400, metric="mfu_pct", value=40),
    # a mixture-of-experts row: Mixtral-8x7B dimensions, experts over 8 ranks
    dict(id="moe", n_layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, gated_mlp="yes", seq_len=4096,
         vocab=32000, global_batch=256, micro_batch=1, tp=1, pp=1, dp=64, zero_stage=1, recompute="full",
         gpu="h100-sxm", n_gpus=64, gpus_per_node=8, n_experts=8, top_k=2, ep=8, metric="mfu_pct", value=30),
    dict(id="bad_metric", n_layers=2, hidden=64, heads=2, seq_len=128, vocab=100, global_batch=8, gpu="a100-80g",
         n_gpus=8, gpus_per_node=8, nic_gbps_per_gpu=200, metric="furlongs", value=1),
    dict(id="bad_gpu", n_layers=2, hidden=64, heads=2, seq_len=128, vocab=100, global_batch=8, gpu="tpu-v9",
         n_gpus=8, gpus_per_node=8, nic_gbps_per_gpu=200, metric="mfu_pct", value=1),
    dict(id="bad_number", n_layers="many", hidden=64, heads=2, seq_len=128, vocab=100, global_batch=8, gpu="a100-80g",
         n_gpus=8, gpus_per_node=8, nic_gbps_per_gpu=200, metric="mfu_pct", value=1),
]


def test_every_row_is_predicted_or_says_why(tmp_path, capsys):
    path = tmp_path / "runs.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(ROWS)
    assert published_runs.main(["--csv", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    table = {line.split()[0]: line for line in out[1:] if line and not line.startswith(("  ", "MAPE"))}
    assert " v6 " in table["vpp6"]
    assert "memory model:" in table["too_big"] and "GiB usable" in table["too_big"]
    for name in ("bad_metric", "bad_gpu", "bad_number"):
        assert "not predicted:" in table[name]
    assert " ep8 " in table["moe"]
    assert out[-1].startswith("MAPE: ") and out[-1].endswith("over 4 rows (3 not predicted)")
    assert any(line.startswith("  MAPE ") for line in out)


def test_missing_file_is_one_line(tmp_path, capsys):
    assert published_runs.main(["--csv", str(tmp_path / "none.csv")]) == 1
    assert "cannot read" in capsys.readouterr().out


def test_dtype_stack_and_memory_columns(tmp_path, capsys):
    """An FP8 row is priced as FP8 (faster than the same row in bf16), the stack names the MAPE
    class, and a published peak gets its own error and a memory MAPE line."""
    base = dict(id="fsdp8b", n_layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, gated_mlp="yes",
                seq_len=8192, vocab=128256, global_batch=16, micro_batch=2, tp=1, pp=1, dp=8, zero_stage=3,
                recompute="selective", gpu="h100-sxm", n_gpus=8, gpus_per_node=8, metric="s_per_iter", value=3.0)
    rows = [dict(base, stack="eager", peak_memory_gib=80.0), dict(base, id="fsdp8b_fp8", dtype="fp8", stack="compile"),
            dict(base, id="bad_stack", stack="jit")]
    path = tmp_path / "runs.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[*COLUMNS, "dtype", "stack", "peak_memory_gib"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    assert published_runs.main(["--csv", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    table = {line.split()[0]: line for line in out[1:] if line and not line.startswith(("  ", "MAPE", "memory"))}
    bf16, fp8 = (float(table[name].split()[3]) for name in ("fsdp8b", "fsdp8b_fp8"))
    assert fp8 < bf16 and " fp8" in table["fsdp8b_fp8"]
    assert "%" in table["fsdp8b"].split()[5] and table["fsdp8b_fp8"].split()[5] == "-"
    assert "unknown stack 'jit'" in table["bad_stack"]
    assert any(line.startswith("  MAPE eager zero3/fsdp h100-sxm") for line in out)
    assert any(line.startswith("  MAPE compile zero3/fsdp h100-sxm") for line in out)
    assert any(line.startswith("memory MAPE: ") and line.endswith("over 1 rows with a published peak") for line in out)


def test_memory_rows_are_predicted_and_give_a_memory_mape(capsys):
    """benchmarks/data/memory_runs.csv: published peaks, each predicted (a row stating its speed too
    is timed beside)."""
    path = Path(published_runs.ROOT) / "benchmarks" / "data" / "memory_runs.csv"
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) >= 10 and all(r["peak_memory_gib"] and r["source"] for r in rows)
    assert published_runs.main(["--csv", str(path)]) == 0
    out = capsys.readouterr().out
    assert " not predicted: " not in out and f"over {len(rows)} rows with a published peak" in out
    printed = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert all(r["id"] in printed for r in rows)


def test_a_peak_is_predicted_in_the_counter_its_source_read():
    """allocated: the tensors' peak; reserved: the allocator's reservation, read as what the runtime
    leaves of the GPU where it would pass it (torch gives its cache back there); nvidia-smi: that
    and the runtime; an unknown counter is refused by name."""
    import pytest

    from layout.results import Estimate

    GIB = 2 ** 30
    est = Estimate(step_time_s=1.0, breakdown_s={}, tokens_per_s=1.0, tflops_per_gpu_model=1.0, tflops_per_gpu_hw=1.0,
                   mfu=0.1, peak_memory_bytes=70 * GIB, peak_reserved_bytes=85 * GIB, memory_capacity_bytes=75 * GIB,
                   runtime_memory_bytes={"cuda_context": GIB}, stages=[])
    read = lambda figure: published_runs.peak_as_read(est, {"memory_figure": figure}, 80 * GIB) / GIB  # noqa: E731
    assert (read("allocated"), read("reserved"), read("unstated"), read("nvidia-smi")) == (70, 79, 79, 80)
    roomy = est.model_copy(update={"peak_reserved_bytes": 74 * GIB})
    assert published_runs.peak_as_read(roomy, {"memory_figure": "reserved"}, 80 * GIB) == 74 * GIB
    with pytest.raises(ValueError, match="memory_figure"):
        read("smi")


def test_megatron_fp8_layouts_that_ran_are_not_refused():
    """Megatron-Bridge's FP8 3-D layouts (70B tp4 pp8 vp5, 405B tp8 pp8 cp2 vp8) ran on 80-GB H100s;
    priced with Transformer Engine's fused kernels and FP8 saved inputs they fit."""
    path = Path(published_runs.ROOT) / "benchmarks" / "data" / "heldout_runs.csv"
    with open(path, newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r["id"] in ("mbridge2511_llama3_70b_h100",
                                                                   "mbridge2511_llama31_405b_h100")]
    assert len(rows) == 2
    for row in rows:
        *_, notes = published_runs.predict(row)
        assert not [n for n in notes if "memory model" in n], (row["id"], notes)


def test_llm_foundry_layouts_that_ran_are_not_refused():
    """MPT 1B at 20 sequences of 2,048 tokens a micro-batch, no recomputation, ran on 80-GB H100s
    under FSDP: llm-foundry's MPT computes its loss with flash-attn's fused cross-entropy, which
    keeps the 16-bit logits (`costmodel.loss`). Priced with torch's fp32 log-probabilities and
    gradients it read 84 GiB of tensors and was refused."""
    path = Path(published_runs.ROOT) / "benchmarks" / "data" / "fsdp_runs.csv"
    with open(path, newline="") as handle:
        (row,) = [r for r in csv.DictReader(handle) if r["id"] == "mpt_1b_h100-sxm_16"]
    assert row["loss"] == "fused"
    *_, notes = published_runs.predict(row)
    assert not [n for n in notes if "memory model" in n], notes
    *_, torch_notes = published_runs.predict({**row, "loss": "torch"})
    assert [n for n in torch_notes if "memory model" in n]


def test_a_fused_loss_keeps_sixteen_bit_logits_and_an_unknown_kernel_is_named():
    import pytest

    from costmodel.loss import with_loss_kernel

    workload = published_runs.row_workload({key: str(value) for key, value in ROWS[2].items()})
    head = workload.layers[-1]
    fused = with_loss_kernel(workload, "fused").layers[-1]
    logits = workload.seq_len * workload.vocab * 2
    assert fused.act_transient == logits < head.act_transient  # torch's: two fp32 copies
    assert fused.act_replicated == head.act_input + logits + 4 * workload.seq_len
    assert with_loss_kernel(workload, "torch") is workload
    with pytest.raises(ValueError, match="fused"):
        with_loss_kernel(workload, "liger")
