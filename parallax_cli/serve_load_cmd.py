"""`parallax serve-load`: a serving deployment under a request rate, simulated request by request."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from hardware.errors import PlanError
from hardware.untrusted import check_name
from parallax_cli import app, emit, wide_console
from planner.serving_load import LoadReport, load_report, read_lengths

console = wide_console()


def _rates(text: str | None) -> list[float]:
    if not text:
        return []
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise PlanError("--rates", f"{text!r} is not a comma-separated list of numbers", "e.g. 1,2,4,8") from None


def render_load(report: LoadReport) -> Table:
    slo = " ".join(f"{name} {value:g} ms" for name, value in (("p99 TTFT <=", report.slo_ttft_ms),
                                                               ("p99 TPOT <=", report.slo_tpot_ms)) if value)
    table = Table(title=f"{report.model} on {report.hardware}, {report.prompt_len:g} in / {report.output_len:g} out "
                        f"({report.lengths})" + (f", SLO {slo}" if slo else ""))
    for col in ("layout", "rate/s", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99", "out tok/s", "batch",
                "preempted", "SLO met"):
        table.add_column(col, justify="right" if col != "layout" else "left")
    for lay in report.layouts:
        label = f"tp={lay.tp}{' ep' if report.expert_parallel else ''} pp={lay.pp} x{lay.replicas}"
        if lay.highest_rate is not None and lay.at_highest is None:
            table.add_row(label, "0", *[""] * 9, "missed even at a trickle")
        elif lay.at_highest is not None:
            table.add_row(*_row(label, lay.at_highest, lay.replicas, "highest rate meeting it"))
        if lay.at_target is not None:
            t = lay.at_target
            given = "" if t.fits else f", more than the {report.gpus_available} given"
            table.add_row(*_row(label.replace(f"x{lay.replicas}", f"x{t.replicas}"), t.at, t.replicas,
                                f"target: {t.gpus} GPUs{given}"))
        for sim in lay.points:
            table.add_row(*_row(label, sim, lay.replicas, f"{sim.slo_met_share:.0%}" if sim.slo_met_share is not None
                                else ""))
    return table


def _row(label: str, sim, replicas: int, met: str) -> list[str]:
    return [label, f"{sim.rate * replicas:,.4g}", *(f"{v:,.0f}" for v in (sim.ttft_ms.p50, sim.ttft_ms.p90,
            sim.ttft_ms.p99)), *(f"{v:,.1f}" for v in (sim.tpot_ms.p50, sim.tpot_ms.p90, sim.tpot_ms.p99)),
            f"{sim.output_tokens_per_s * replicas:,.0f}", f"{sim.mean_batch:.1f}", str(sim.preemptions), met]


@app.command("serve-load")
def serve_load_command(
    model: str = typer.Argument(..., help="built-in name (see `parallax models`), a config.json path or folder, or a cached HF id"),
    hw: str = typer.Option(..., "--hw", help="hardware spec, e.g. 8xh100-sxm"),
    prompt_len: Optional[int] = typer.Option(None, "--prompt-len", help="prompt tokens of every request"),
    output_len: Optional[int] = typer.Option(None, "--output-len", help="output tokens of every request"),
    lengths: Optional[Path] = typer.Option(None, "--lengths", help="a CSV of prompt_len,output_len rows to draw "
                                           "each request's lengths from (instead of fixed lengths)"),
    rates: Optional[str] = typer.Option(None, "--rates", help="total requests/s to simulate, e.g. 1,2,4,8"),
    slo_ttft_ms: Optional[float] = typer.Option(None, "--slo-ttft-ms", help="find the highest rate with p99 TTFT "
                                                "at most this"),
    slo_tpot_ms: Optional[float] = typer.Option(None, "--slo-tpot-ms", help="... and p99 TPOT at most this"),
    target_rate: Optional[float] = typer.Option(None, "--target-rate", help="with SLOs: the fewest GPUs (replicas of "
                                                "each layout) that take this many requests/s with the p99s met"),
    tp: Optional[int] = typer.Option(None, "--tp", help="pin the tensor-parallel degree of each replica"),
    pp: Optional[int] = typer.Option(None, "--pp", help="pin the pipeline degree of each replica"),
    replicas: Optional[int] = typer.Option(None, "--replicas", help="pin the number of replicas"),
    dtype: str = typer.Option("bf16", "--dtype"),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="auto (16-bit), bf16, fp16 or fp8"),
    engine: str = typer.Option("generic", "--engine", help="trtllm, vllm, sglang, lmdeploy (fitted where the GPU "
                               "was) or generic"),
    quantization: str = typer.Option("none", "--quantization", help="int8 or int4 weight-only (16-bit "
                                     "activations), w8a8 (INT8 GEMMs), on GPUs whose kernels run them, or none; fp8 "
                                     "weights: --dtype fp8"),
    expert_parallel: bool = typer.Option(False, "--expert-parallel/--no-expert-parallel", help="a mixture of "
                                         "experts: whole experts on each TP rank (vLLM's --enable-expert-parallel)"),
    requests: int = typer.Option(600, "--requests", help="requests simulated per rate (the first tenth warm up)"),
    seed: int = typer.Option(0, "--seed"),
    top: int = typer.Option(3, "--top"),
    out: Optional[Path] = typer.Option(None, "--out", help="write the report JSON here"),
    plan_out: Optional[Path] = typer.Option(None, "--plan-out", help="with SLOs: write the best layout at its highest "
                                            "rate as a serving plan (`parallax export FILE --to vllm`)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """TTFT and TPOT percentiles (p50, p90, p99) of serving MODEL at request rates (Poisson
    arrivals, continuous batching, chunked prefill, paged KV admission and preemption), and with
    p99 SLOs the highest rate each layout sustains."""
    from hardware.limits import MAX_REQUESTS, MAX_SEQ_LEN, check_count

    check_name(model, "model")
    check_name(hw, "--hw")
    check_count("requests", requests, MAX_REQUESTS, low=20, hint="e.g. 600")
    if lengths is not None:
        mix, source = read_lengths(lengths), str(lengths.name)
    elif prompt_len is None or output_len is None:
        raise PlanError("--prompt-len", "request lengths are not given", "--prompt-len N --output-len M, or "
                        "--lengths FILE")
    else:
        check_count("prompt_len", prompt_len, MAX_SEQ_LEN, hint="e.g. 1024")
        check_count("output_len", output_len, MAX_SEQ_LEN, hint="e.g. 256")
        mix, source = [(prompt_len, output_len)], "fixed"
    fixed = {k: v for k, v in (("tp", tp), ("pp", pp), ("replicas", replicas)) if v is not None}
    report = load_report(model, hw, lengths=mix, rates=_rates(rates), lengths_source=source, slo_ttft_ms=slo_ttft_ms,
                         slo_tpot_ms=slo_tpot_ms, dtype=dtype, kv_dtype=kv_dtype, fixed=fixed, requests=requests,
                         seed=seed, top_k=top, engine=engine, quantization=quantization,
                         expert_parallel=expert_parallel, target_rate=target_rate)
    if not emit(report, out, as_json):
        console.print(render_load(report))
        best = report.layouts[0]
        e = best.engine
        console.print(f"engine settings of tp={best.tp} pp={best.pp}: max sequences {e.max_sequences}, max batched "
                      f"tokens {e.max_batched_tokens}, KV pages of {e.block_size} tokens ({e.kv_cache_tokens:,} tokens)")
    if plan_out is not None:
        _write_plan(report, plan_out, model, hw, dtype, kv_dtype, engine)


def _write_plan(report: LoadReport, path: Path, model: str, hw: str, dtype: str, kv_dtype: str, engine: str) -> None:
    from formats.serving import settings_of
    from parallax_cli import write_output
    from planner.serving_load import plan_at_highest_rate

    plan = plan_at_highest_rate(report, model, hw, dtype=dtype, kv_dtype=kv_dtype, engine=engine)
    if plan is None:
        raise PlanError("--plan-out", "no layout met the SLOs, so there is no plan to write", "relax --slo-ttft-ms or "
                        "--slo-tpot-ms, or add GPUs")
    write_output(path, plan.to_json(), "--plan-out")
    s = settings_of(plan)
    console.print(f"wrote {path}: tp={plan.tp} pp={plan.pp} x{plan.replicas} at {plan.request_rate:.2f} requests/s; "
                  f"engine settings: max sequences {s.max_sequences}, max batched tokens {s.max_batched_tokens}, "
                  f"memory fraction {s.memory_fraction}, KV cache {s.kv_dtype}, max model length {s.max_model_len} "
                  f"(`parallax export {path} --to vllm` writes the engine's flags)")
