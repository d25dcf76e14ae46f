"""Predict published large-scale training runs and report the error.

    python benchmarks/published_runs.py [--csv FILE]

Each CSV row gives a model's dimensions, the cluster and (some of) the layout,
and one published metric. Blank layout fields are left to the planner under
the fixed ones; a fully pinned layout the search does not offer, or that the
memory model rejects, is estimated as given and flagged. The script prints
published vs predicted with the signed error, a row it cannot predict with
why, the MAPE per mechanism class (GPU, and ZeRO-3/FSDP, HSDP, Megatron
TP x PP, or plain DP), then `MAPE: X% over N rows (K not predicted)`.

Each row's model is its dimensions (`row_dims`), handed to the tracer as users may hand
them to `planner.plan` (`planner/trace/dims.py`): gated rows as an HF llama config (mixtral
with experts), the others as the reference GPT (learned positions, LayerNorm, GELU, biases,
a tied head); the biases, dropout and learned_positions columns then matter only to
`--door dims`, the analytic workload of `costmodel/transformer.py`.

Row conventions (not per-row fudge factors): a blank kv_heads means
kv_heads = heads, a blank ffn_hidden means 4*hidden, a blank gated_mlp means
no. Rows with a gated MLP are taken as Llama-era models (flash attention, no
dropout, no biases, rotary positions); the others as GPT-era Megatron models
(attention scores materialised, dropout, biases, learned positions), which
is what the 2021-22 Megatron-LM runs used. Optional yes/no columns
flash_attention, biases, dropout and learned_positions state the model where
it is neither (MPT: flash attention, no biases, no dropout, learned positions);
n_experts, top_k and ep describe a mixture-of-experts run (blank: dense), cp a
context-parallel one;
a blank nic_gbps_per_gpu takes the catalog's network. `dtype` (bf16, fp16, fp8,
fp32; blank bf16) is the precision the run trained in and is priced so (FP8: the
blocks' GEMMs at the GPU's FP8 peak, their casts by stack, costmodel/fp8.py). An
optional yes/no tp_comm_overlap says the run overlapped TP's collectives with its
GEMMs (Megatron-LM's --tp-comm-overlap, torchtitan's async TP), as its launcher
config states; an optional yes/no fp8_param_gather that an FP8 run on the fused stack held
and gathered its weights in FP8 (Megatron-LM's --fp8-param-gather). `stack` names the software that ran it: eager (PyTorch
ops, FSDP2/DTensor, what `parallax run` executes), compile (torch.compile) or
fused (Megatron-LM / Transformer Engine kernels); blank is fused, which every
Megatron-LM row is. Rows are grouped by stack and GPU for the MAPE lines; each
stack is priced with its own efficiencies where the GPU's profile has them
(`Efficiency.stacks`, fitted by `fit_efficiency.py --stack`). An optional peak_memory_gib
(published peak per GPU) is compared with the predicted peak: its error prints
beside the time error and a memory MAPE line follows the time MAPE; a row with
a peak and no metric is a memory row alone (`memory_runs.csv`). Its optional
`memory_figure` says which counter the source read, and the prediction is of that
counter: `allocated` (max_memory_allocated) the tensors' peak; `reserved`
(max_memory_reserved, what torchtitan logs) and `unstated` what torch's caching
allocator holds (costmodel/reserved.py); `nvidia-smi` that and the runtime's memory
(CUDA context, workspaces, NCCL buffers). Optional master_dtype and optimizer_dtype (fp32, bf16), reduce_dtype
(fp32, bf16) and accumulation (reduce_each, hold_unsharded) state the run's recipe; blank is the
stack's default (fp32 weights and moments, each stack's reduction, a reduce-scatter per
micro-batch); ddp_bucket_view (yes/no, blank: yes) says whether a DDP run's gradients are views
into its buckets (torch's default, no, keeps a copy beside each); tied_embeddings (yes/no, blank:
no for gated rows) ties a Llama-era head to its embedding; loss (torch, fused; blank torch) names the
run's cross-entropy kernel (costmodel/loss.py: llm-foundry's MPT runs flash-attn's fused one, keeping
16-bit logits where torch's keeps fp32). Other columns (source) are ignored.
"""
from __future__ import annotations

import argparse
import csv
import sys
import warnings
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hardware  # noqa: E402
from costmodel import TransformerDims, estimate, transformer_workload  # noqa: E402
from costmodel.loss import with_loss_kernel  # noqa: E402
from planner.trace.workload_for import workload_for  # noqa: E402
from planner.request import PlanRequest  # noqa: E402
from planner.search.branch_and_bound import best_plan  # noqa: E402

DEFAULT_CSV = ROOT / "benchmarks" / "data" / "calibration_runs.csv"
STACKS = ("eager", "compile", "fused")
METRICS = ("tflops_per_gpu_incl_recompute", "tflops_per_gpu_model", "s_per_iter", "mfu_pct", "tokens_per_s_per_gpu")


def _int(row: dict, key: str, default: int | None = None) -> int | None:
    value = (row.get(key) or "").strip()
    return int(float(value)) if value else default


def _yes(row: dict, key: str) -> bool | None:
    value = (row.get(key) or "").strip().lower()
    if not value:
        return None
    return value in ("yes", "true", "1", "y")


def _flag(row: dict, key: str, default: bool) -> bool:
    value = _yes(row, key)
    return default if value is None else value


def row_dims(row: dict, name: str = "row") -> TransformerDims:
    """The row's architecture by its dimensions, its columns' flags or the era's defaults."""
    hidden, heads = _int(row, "hidden"), _int(row, "heads")
    gated = bool(_yes(row, "gated_mlp"))
    return TransformerDims(
        name=name, n_layers=_int(row, "n_layers"), hidden=hidden, heads=heads, kv_heads=_int(row, "kv_heads", heads),
        ffn_hidden=_int(row, "ffn_hidden", 4 * hidden), vocab=_int(row, "vocab"), seq_len=_int(row, "seq_len"),
        gated_mlp=gated, dropout=_flag(row, "dropout", not gated), biases=_flag(row, "biases", not gated),
        learned_positions=_flag(row, "learned_positions", not gated), flash_attention=_flag(row, "flash_attention", gated),
        tied_embeddings=bool(_yes(row, "tied_embeddings")), n_experts=_int(row, "n_experts", 0),
        top_k=_int(row, "top_k", 0))


MODEL_COLUMNS = ("n_layers", "hidden", "heads", "kv_heads", "ffn_hidden", "gated_mlp", "vocab", "seq_len", "n_experts",
                 "top_k", "tied_embeddings", "flash_attention", "biases", "dropout", "learned_positions",
                 "dtype", "loss")  # what `row_workload` reads


def row_workload(row: dict):
    """The row's workload through the tracer, the door users plan by; a row run without a fused
    attention kernel (its flash_attention column, blank: GPT-era rows) materialises the scores.
    Traced once per model (the fit prices every row many times)."""
    return _traced(tuple((column, (row.get(column) or "").strip()) for column in MODEL_COLUMNS))


@lru_cache(maxsize=None)
def _traced(model: tuple):
    """The row's dimensions through the tracer (`planner.trace.dims`: the architecture they describe)."""
    row = dict(model)
    dtype = row["dtype"].lower() or "bf16"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        workload, _ = workload_for(row_dims(row), seq_len=_int(row, "seq_len"), dtype=dtype)
    return with_loss_kernel(workload, row["loss"].lower() or "torch")


def row_dims_workload(row: dict):
    """The row through the analytic door (`costmodel.transformer`: Korthikanti et al.'s
    accounting of Megatron's kernels), kept beside the traced one for comparison (--door dims)."""
    return transformer_workload(row_dims(row, row["id"]))


def row_cluster(row: dict):
    return hardware.load(
        f"{_int(row, 'n_gpus')}x{row['gpu']}",
        gpus_per_node=_int(row, "gpus_per_node"),
        nic_gbps=float(row["nic_gbps_per_gpu"]) if (row.get("nic_gbps_per_gpu") or "").strip() else None,
    )


def row_pins(row: dict) -> dict:
    pins: dict = {}
    for key, field in (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("micro_batch", "micro_batch"), ("zero_stage", "zero"),
                       ("dp_shard", "dp_shard"), ("ep", "ep"), ("cp", "cp")):
        value = _int(row, key)
        if value is not None:
            pins[field] = value
    if pins.get("zero", 0) >= 2 and "dp" in pins and "dp_shard" not in pins:
        pins["dp_shard"] = pins["dp"]  # a published ZeRO-2/3 run shards over all of dp unless it says otherwise
    vpp = _int(row, "vpp")
    if vpp is not None:
        pins["vpp"] = vpp
        pins["schedule"] = "interleaved" if vpp > 1 else "1f1b"
    sp = _yes(row, "seq_parallel")
    if sp is not None:
        pins["sp"] = sp
    if _yes(row, "tp_comm_overlap"):  # Megatron-LM's --tp-comm-overlap, torchtitan's async TP: where a run states it
        pins["tp_overlap"] = True
    if _yes(row, "fp8_param_gather"):  # Megatron-LM's --fp8-param-gather, where a run states it
        pins["fp8_param_gather"] = True
    recompute = (row.get("recompute") or "").strip().lower()
    if recompute:
        pins["recompute"] = recompute
    for column in ("master_dtype", "optimizer_dtype", "reduce_dtype", "accumulation"):  # the recipe, where stated
        value = (row.get(column) or "").strip().lower()
        if value:
            pins[column] = value
    pins.setdefault("accumulation", "reduce_each")  # a published run's own, not the planner's choice
    view = _yes(row, "ddp_bucket_view")  # torch DDP's gradient_as_bucket_view, where a run's code sets or defaults it
    if view is not None:
        pins["ddp_bucket_view"] = view
    pins["stack"] = row_stack(row)
    return pins


def row_stack(row: dict) -> str:
    stack = (row.get("stack") or "").strip().lower() or "fused"
    if stack not in STACKS:
        raise ValueError(f"unknown stack {stack!r} (use one of {', '.join(STACKS)})")
    return stack


def mechanism(plan, stack: str = "fused") -> str:
    """The class a row's error is reported under: its stack, what dominates its communication, its GPU."""
    if plan.zero >= 2 and plan.dp_replicate > 1:
        kind = "hsdp"
    elif plan.zero >= 2 and plan.dp > 1:
        kind = "zero3/fsdp" if plan.zero == 3 else "zero2"
    elif plan.tp > 1 or plan.pp > 1:
        kind = "megatron tp x pp"
    else:
        kind = "dp"
    return f"{stack} {kind} {plan.hardware.split('x', 1)[-1]}"


DOORS = {"traced": row_workload, "dims": row_dims_workload}


def predict(row: dict, door: str = "traced") -> tuple[float | None, float, str, str, list[str]]:
    """(predicted metric (None for a memory row), predicted peak GiB per GPU, layout, class, notes)."""
    workload, cluster = DOORS[door](row), row_cluster(row)
    dtype = (row.get("dtype") or "").strip().lower() or "bf16"
    request = PlanRequest(global_batch=_int(row, "global_batch"), seq_len=workload.seq_len, fixed=row_pins(row),
                          dtype=dtype, time_limit_s=8.0)
    plan = best_plan(workload, cluster, request, model=row["id"])
    if plan is None:
        raise ValueError("no layout fits under the unpinned fields; pin tp and pp to estimate the layout as given")
    est = plan.estimate or estimate(workload, plan, cluster)
    metric = (row.get("metric") or "").strip()
    value = None if not metric else {
        "tflops_per_gpu_incl_recompute": est.tflops_per_gpu_hw,
        "tflops_per_gpu_model": est.tflops_per_gpu_model,
        "s_per_iter": est.step_time_s,
        "mfu_pct": est.mfu * 100,
        "tokens_per_s_per_gpu": est.tokens_per_s / plan.n_gpus,
    }[metric]
    layout = f"{plan.layout_tag} {dtype}" if dtype not in ("bf16", "fp8") else plan.layout_tag  # the tag names fp8
    return value, peak_as_read(est, row, cluster.gpu.hbm_gb * 2 ** 30) / 2 ** 30, layout, mechanism(plan, row_stack(row)), \
        plan.notes


FIGURES = ("allocated", "reserved", "nvidia-smi", "unstated")


def peak_as_read(est, row: dict, gpu_bytes: float) -> float:
    """The predicted peak per GPU in the counter the row's source read (`memory_figure`). A
    reservation past what the runtime leaves of the GPU is read as that: torch's allocator gives
    its cache back and retries there rather than reserve more (costmodel/allocator.py)."""
    figure = (row.get("memory_figure") or "unstated").strip().lower()
    if figure not in FIGURES:
        raise ValueError(f"unknown memory_figure {figure!r} (use one of {', '.join(FIGURES)})")
    if figure == "allocated":
        return est.peak_memory_bytes
    runtime = sum(est.runtime_memory_bytes.values())
    reserved = max(est.peak_memory_bytes, min(est.held_bytes, gpu_bytes - runtime))
    return reserved + (runtime if figure == "nvidia-smi" else 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    parser.add_argument("--door", choices=sorted(DOORS), default="traced",
                        help="traced: each row's model through the tracer, as users plan (default); dims: the "
                        "analytic workload of costmodel.transformer")
    args = parser.parse_args(argv)
    try:
        with open(args.csv, newline="") as handle:
            rows = list(csv.DictReader(handle))
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        print(f"cannot read {args.csv}: {error}")
        return 1
    errors: dict[str, list[float]] = {}
    memory_errors: dict[str, list[float]] = {}
    missed = 0
    print(f"{'id':32} {'metric':32} {'published':>10} {'predicted':>10} {'error':>8} {'memory':>8}  layout")
    for row in rows:
        name = (row.get("id") or "?").strip()
        metric = (row.get("metric") or "").strip()
        has_peak = bool((row.get("peak_memory_gib") or "").strip())
        try:
            if metric not in METRICS and not (has_peak and not metric):
                raise ValueError(f"unknown metric {row.get('metric')!r} (use one of {', '.join(METRICS)})")
            published = float(row["value"]) if metric else None
            predicted, peak_gib, layout, kind, notes = predict(row, args.door)
        except Exception as error:  # noqa: BLE001 - one bad row must not stop the table
            missed += 1
            print(f"{name:32} not predicted: {type(error).__name__}: {' '.join(str(error).split())}")
            continue
        flags = f"  [{'; '.join(notes)}]" if notes else ""
        memory = "-"
        if has_peak:
            published_gib = float(row["peak_memory_gib"])
            memory_errors.setdefault(kind, []).append(abs(peak_gib / published_gib - 1))
            memory = f"{peak_gib / published_gib - 1:+.1%}"
        if published is None:
            figure = (row.get("memory_figure") or "unstated").strip()
            print(f"{name:32} {'peak GiB (' + figure + ')':32} {float(row['peak_memory_gib']):10.2f} {peak_gib:10.2f} "
                  f"{'':>8} {memory:>8}  {layout}{flags}")
            continue
        error = (predicted - published) / published
        errors.setdefault(kind, []).append(abs(error))
        print(f"{name:32} {metric:32} {published:10.2f} {predicted:10.2f} {error:+8.1%} {memory:>8}  {layout}{flags}")
    every = [e for values in errors.values() for e in values]
    if len(errors) > 1:
        for kind, values in sorted(errors.items()):
            print(f"  MAPE {kind}: {100 * sum(values) / len(values):.1f}% over {len(values)} rows")
    memory = [e for values in memory_errors.values() for e in values]
    if memory:
        for kind, values in sorted(memory_errors.items()):
            print(f"  memory MAPE {kind}: {100 * sum(values) / len(values):.1f}% over {len(values)} rows")
        print(f"memory MAPE: {100 * sum(memory) / len(memory):.1f}% over {len(memory)} rows with a published peak")
    mape = f"{100 * sum(every) / len(every):.1f}%" if every else "n/a"
    print(f"MAPE: {mape} over {len(every)} rows ({missed} not predicted)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
