"""`parallax serve-plan`: a serving deployment (TP, PP, replicas) for a model."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from hardware.untrusted import check_name
from parallax_cli import app, emit, wide_console
from planner.inference import InferencePlan, plan_inference

console = wide_console()
GIB = 2**30


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def render_inference(plan: InferencePlan) -> Table:
    weights = f", {plan.quantization} weights" if plan.quantization != "none" else ""
    table = Table(title=f"Serving {plan.model} on {plan.hardware} ({plan.prompt_len} in / {plan.output_len} out"
                        f"{weights})")
    table.add_column("layout")
    for col in ("GPUs", "batch/rep", "max seqs", "W GiB/GPU", "KV KiB/tok/GPU", "TTFT ms", "TPOT ms",
                "step ms", "tok/s", "tok/s/GPU", "$/1M out"):
        table.add_column(col, justify="right")
    for i, p in enumerate([plan, *plan.alternatives]):
        x = p.estimate
        usd = f"{x.usd_per_million_output_tokens:.2f}" if x.usd_per_million_output_tokens is not None else "n/a"
        label = f"tp={p.tp}{' ep' if p.expert_parallel else ''} pp={p.pp} x{p.replicas}" + (" (chosen)" if i == 0 else "")
        table.add_row(label, str(p.gpus_used), f"{p.batch_per_replica:.1f}", str(x.max_concurrent_sequences),
                      f"{x.weights_bytes_per_gpu / GIB:.1f}", f"{x.kv_bytes_per_token_per_gpu / 1024:.0f}",
                      _ms(x.ttft_s), _ms(x.tpot_s), _ms(x.decode_step_s), f"{p.tokens_per_s:,.0f}",
                      f"{x.tokens_per_s_replica / (p.tp * p.pp):,.0f}", usd)
    return table


def _slo_line(plan: InferencePlan) -> str:
    e = plan.estimate
    parts = [f"TTFT {_ms(e.ttft_s)} ms" + (f" (SLO {plan.slo_ttft_ms:g})" if plan.slo_ttft_ms else ""),
             f"TPOT {_ms(e.tpot_s)} ms" + (f" (SLO {plan.slo_tpot_ms:g})" if plan.slo_tpot_ms else "")]
    verdict = "meets the SLO" if plan.feasible else "[red]SLO NOT MET[/red]"
    return ", ".join(parts) + f": {verdict}"


def _engine_pins(path: Path, fmt: str | None) -> tuple[dict[str, int], str, bool]:
    """tp, pp and replicas of an engine's command line, its KV cache dtype and whether it holds
    whole experts on each rank, the engine told from --from-format or the flags."""
    from formats import SERVING, check_format
    from formats.serving import engine_pins
    from hardware.errors import FormatError
    from hardware.untrusted import read_text

    text = read_text(path, "--from", "engine command line")
    if fmt is None:
        marks = {"vllm": ("vllm serve", "--tensor-parallel-size"), "sglang": ("sglang", "--tp-size"),
                 "trtllm": ("trtllm-serve", "--tp_size")}
        fmt = next((engine for engine, found in marks.items() if any(mark in text for mark in found)), None)
        if fmt is None:
            raise FormatError("--from", f"cannot tell which engine {path.name} is for", "name it with --from-format "
                              f"({', '.join(SERVING)})")
    engine = check_format(fmt, "--from-format", SERVING)
    pins = engine_pins(text, engine)
    return pins.degrees, pins.kv_dtype, pins.expert_parallel


@app.command("serve-plan")
def serve_plan_command(
    model: str = typer.Argument(..., help="built-in name (see `parallax models`), a config.json path or folder, or a cached HF id (org/name)"),
    hw: str = typer.Option(..., "--hw", help="hardware spec, e.g. 8xh100-sxm"),
    prompt_len: int = typer.Option(..., "--prompt-len", help="prompt tokens per request"),
    output_len: int = typer.Option(..., "--output-len", help="generated tokens per request"),
    batch: Optional[int] = typer.Option(None, "--batch", help="total concurrent sequences"),
    rate: Optional[float] = typer.Option(None, "--rate", help="requests per second"),
    tpot_ms: Optional[float] = typer.Option(None, "--tpot-ms", help="SLO: time per output token, ms"),
    ttft_ms: Optional[float] = typer.Option(None, "--ttft-ms", help="SLO: time to first token, ms"),
    objective: str = typer.Option("throughput", "--objective", help="throughput or cost"),
    dtype: str = typer.Option("bf16", "--dtype"),
    kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="the KV cache's dtype: auto (16-bit), bf16, fp16 "
                                           "or fp8 (GPUs with FP8)"),
    engine: str = typer.Option("generic", "--engine", help="the engine family to price: trtllm, vllm, sglang or "
                               "lmdeploy (its fitted HBM efficiency and per-iteration overhead where fitted for the "
                               "GPU), or generic (the roofline alone)"),
    quantization: str = typer.Option("none", "--quantization", help="int8 or int4 weight-only (16-bit "
                                     "activations), w8a8 (INT8 GEMMs), on GPUs whose kernels run them, or none; fp8 "
                                     "weights: --dtype fp8"),
    expert_parallel: Optional[bool] = typer.Option(None, "--expert-parallel/--no-expert-parallel", help="a mixture "
                                                   "of experts: pin whole experts on each TP rank (vLLM's "
                                                   "--enable-expert-parallel) or a slice of every expert on each; "
                                                   "unset, both are priced"),
    price: Optional[float] = typer.Option(None, "--price-per-gpu-hour"),
    top: int = typer.Option(3, "--top"),
    tp: Optional[int] = typer.Option(None, "--tp", help="pin the tensor-parallel degree of each replica"),
    pp: Optional[int] = typer.Option(None, "--pp", help="pin the pipeline degree of each replica"),
    replicas: Optional[int] = typer.Option(None, "--replicas", help="pin the number of replicas"),
    from_file: Optional[Path] = typer.Option(None, "--from", help="an engine's command line (vllm serve, sglang, "
                                             "trtllm-serve) or its flags: its degrees and replicas are pinned"),
    from_format: Optional[str] = typer.Option(None, "--from-format", help="vllm, sglang or trtllm"),
    out: Optional[Path] = typer.Option(None, "--out", help="write the plan JSON here"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Choose TP, PP and the number of replicas to serve MODEL on the hardware (or price the ones pinned)."""
    check_name(model, "model")
    check_name(hw, "--hw")
    fixed = {k: v for k, v in (("tp", tp), ("pp", pp), ("replicas", replicas)) if v is not None}
    engine_kv = "auto"
    if from_file is not None:
        pins, engine_kv, engine_ep = _engine_pins(from_file, from_format)
        fixed = {**pins, **fixed}
        expert_parallel = engine_ep if expert_parallel is None else expert_parallel
    plan = plan_inference(model, hw, prompt_len=prompt_len, output_len=output_len, batch=batch, request_rate=rate,
                          slo_tpot_ms=tpot_ms, slo_ttft_ms=ttft_ms, objective=objective, dtype=dtype, top_k=top,
                          price_per_gpu_hour=price, fixed=fixed, kv_dtype=kv_dtype or engine_kv, engine=engine,
                          quantization=quantization, expert_parallel=expert_parallel)
    if emit(plan, out, as_json):
        return
    console.print(render_inference(plan))
    console.print(_slo_line(plan))
    e = plan.estimate
    console.print(f"KV cache ({plan.kv_dtype}): {e.kv_bytes_per_token:,.0f} bytes/token for the model, "
                  f"{e.kv_bytes_per_token_per_gpu:,.0f} per GPU; decode step parts (ms): "
                  + ", ".join(f"{k}={v * 1e3:.2f}" for k, v in e.decode_breakdown_s.items() if v > 0))
    for note in plan.notes:
        console.print(f"note: {note}")
