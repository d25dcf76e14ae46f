"""`parallax plan` and `parallax estimate`."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from layout.plan import Plan, every_kth_block, uniform_stages
from costmodel.validate import default_dtype
from hardware.errors import ParallaxError, PlanError
from hardware.limits import COUNT_LIMITS, check_count
from hardware.untrusted import check_name
from layout.axes import AXES, AXIS
from planner.api import estimate, is_mixed, plan
from planner.request import PlanRequest
from planner.resolve import resolve_hardware, resolve_workload
from parallax_cli import TRUST_MODULE_HELP, app, emit, load_plan, wide_console
from parallax_cli.layout_flags import layout_flags
from planner.summary import render

console = wide_console()
ASKED = PlanRequest.model_fields  # the defaults of what a plan is asked, declared once
FROM_HELP = ("your own configuration: torchtitan overrides or TOML, a DeepSpeed ds_config, an Accelerate config "
             "file, or Megatron-LM arguments")
FROM_FORMAT_HELP = "the --from file's tool (torchtitan, deepspeed, accelerate, megatron); default: told from the file"


def _progress() -> Progress:
    """A spinner on a terminal; nothing at all when stderr is a file or a pipe (a failure stays one line)."""
    import sys

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=Console(stderr=True),
                    transient=True, disable=not sys.stderr.isatty())


@app.command("plan")
@layout_flags
def plan_command(
    model: Optional[str] = typer.Argument(None, help="built-in name (see `parallax models`), a config.json path or folder, a cached HF id (org/name), or an .onnx path"),
    hw: str = typer.Option(..., "--hw", help="hardware spec, e.g. 64xh100-sxm, a profile file, or a mixed cluster "
                                            "such as 16xa100-80g+8xh100-sxm"),
    global_batch: Optional[int] = typer.Option(None, "--global-batch", help="sequences per optimizer step"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="tokens per sequence (with --module: the "
                                          "example shape's)"),
    module: Optional[str] = typer.Option(None, "--module", help="your own module instead of MODEL: "
                                         "package.module:function returning the nn.Module (built on the meta device)"),
    example_shape: Optional[str] = typer.Option(None, "--example-shape", help="with --module: the token ids' shape, "
                                                "batch,sequence (e.g. 1,2048)"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="fp32, bf16, fp16 or fp8; default bf16, or fp32 on "
                                        "hardware whose bf16 is no faster than its fp32"),
    objective: str = typer.Option(ASKED["objective"].default, "--objective", help="time or cost"),
    allow_compression: bool = typer.Option(False, "--allow-compression",
                                           help="let the solver pick lossy gradient compression (int8, Top-K) for DDP layouts"),
    top: int = typer.Option(ASKED["top_k"].default, "--top", help="alternatives to keep"),
    time_limit: float = typer.Option(ASKED["time_limit_s"].default, "--time-limit", help="most search seconds (it stops sooner once the gap is proven)"),
    gap: float = typer.Option(ASKED["target_gap"].default, "--gap", min=0.0, max=1.0, help="stop once the pick is proven within this fraction of the best"),
    price: Optional[float] = typer.Option(None, "--price-per-gpu-hour"),
    memory_reserve: float = typer.Option(ASKED["memory_reserve"].default, "--memory-reserve",
                                         help="share of each GPU's memory kept free beyond what the plan is "
                                              "priced to reserve (its tensors, torch's caching allocator, the CUDA "
                                              "context, NCCL buffers): the prediction's error band"),
    memory_headroom: float = typer.Option(0.0, "--memory-headroom", min=0.0,
                                          help="GiB of each GPU kept free on top, a margin of your own"),
    check_memory: bool = typer.Option(False, "--check-memory",
                                      help="dry-run the pick, replay its allocations through torch's caching "
                                           "allocator, and search again keeping free what that replay reserves "
                                           "beyond the prediction"),
    mtbf_hours: Optional[float] = typer.Option(None, "--mtbf-hours", min=0.001,
                                               help="mean time between failures per GPU, hours (default: the "
                                                    "profile's, from the Llama 3 paper's 419 interruptions in 54 days "
                                                    "on 16,384 H100s); sets the checkpoint interval"),
    out: Optional[Path] = typer.Option(None, "--out", help="write the plan JSON here (with --from: the proposal in "
                                       "the file's format)"),
    as_json: bool = typer.Option(False, "--json", help="print the plan JSON instead of tables"),
    from_file: Optional[Path] = typer.Option(None, "--from", help=FROM_HELP),
    from_format: Optional[str] = typer.Option(None, "--from-format", help=FROM_FORMAT_HELP),
    axes: dict | None = None,
) -> None:
    """Find the best layout for MODEL on the hardware and print it (any layout flag pins that axis)."""
    if from_file is not None:  # layout flags complete the user's file here, as on `estimate --from`; they pin nothing
        return _propose(from_file, from_format, model, hw, dict(global_batch=global_batch, seq_len=seq_len,
                        dtype=dtype, **(axes or {})), dict(time_limit_s=time_limit, target_gap=gap,
                        memory_reserve=memory_reserve), out)
    if global_batch is None:
        raise PlanError("--global-batch", "is needed", "sequences per optimizer step, e.g. --global-batch 512")
    for name in filter(None, (model, module, hw)):  # what the plan will print as its own name
        check_name(name, "model" if name != hw else "--hw")
    model, traced, seq_len = _model_door(model, module, example_shape, seq_len, dtype)
    if check_memory and (module or is_mixed(hw)):
        raise PlanError("--check-memory", "dry-runs a named model on one GPU type",
                        "drop it, or check a --module's or a mixed cluster's plan with `parallax dry-run`")
    request = _request(global_batch=global_batch, seq_len=seq_len, dtype=dtype, objective=objective,
                       fixed=dict(axes or {}), top_k=top, time_limit_s=time_limit, target_gap=gap,
                       allow_compression=allow_compression, price_per_gpu_hour=price, mtbf_hours=mtbf_hours,
                       memory_reserve=memory_reserve)
    if is_mixed(hw):  # one door: a mixed cluster goes through the same command and prints the same way
        with _progress() as progress:
            progress.add_task(f"planning {model} on the mixed cluster {hw}", total=None)
            result = plan(traced or model, hw, request)
        print_plan(result, model, out, as_json)
        return
    with _progress() as progress:
        progress.add_task(f"tracing {model}", total=None)
        cluster = resolve_hardware(hw, price_per_gpu_hour=price)
        workload = traced or resolve_workload(model, seq_len=seq_len, dtype=dtype or default_dtype(cluster)[0])
    request = _with_headroom(request, memory_headroom, cluster)
    with _progress() as progress:
        progress.add_task(f"searching layouts on {cluster.spec()}", total=None)
        result = plan(workload, cluster, request)
    lines = []
    if check_memory:
        from parallax_cli.memory_check import checked_plan

        def replan(reserve: float) -> Plan:  # the replay's excess kept free beside the user's own reserve
            return plan(workload, cluster, request.model_copy(update={"memory_reserve": request.memory_reserve + reserve}))

        with _progress() as progress:
            progress.add_task(f"replaying {result.layout_tag}'s allocations", total=None)
            result, lines = checked_plan(result, model, replan)
    print_plan(result, model, out, as_json)
    for line in lines:
        console.print(line, markup=False)


def _with_headroom(request: PlanRequest, headroom_gib: float, cluster) -> PlanRequest:
    """The user's own margin, in GiB of each GPU, added to the share kept free."""
    if not headroom_gib:
        return request
    reserve = request.memory_reserve + headroom_gib / cluster.gpu.hbm_gb
    if reserve >= 1:
        raise PlanError("--memory-headroom", f"{headroom_gib:g} GiB leaves nothing of the {cluster.gpu.hbm_gb:g} GiB "
                        "GPU", f"keep it below {cluster.gpu.hbm_gb * (1 - request.memory_reserve):.0f}")
    return request.model_copy(update={"memory_reserve": reserve})


def _propose(path: Path, fmt: str | None, model: str | None, hw: str, given: dict, options: dict, out: Path | None):
    """`plan --from`: the user's layout priced, the best one their tool runs, and the speed-up."""
    from formats import export
    from parallax_cli import write_output
    from parallax_cli.from_config import comparison, propose, stated_plan

    with _progress() as progress:
        progress.add_task(f"pricing {path}", total=None)
        own, stated, workload, cluster = stated_plan(path, fmt, model, hw, given)
    with _progress() as progress:
        progress.add_task(f"searching layouts {stated.format} runs on {cluster.spec()}", total=None)
        proposed, lost = propose(own, stated, workload, cluster, options)
    console.print(render(proposed))
    for line in [*(f"not priced: {u}" for u in stated.unpriced), *(f"not expressible in {stated.format}: {x}" for x in lost)]:
        console.print(line, markup=False)
    console.print(comparison(own, proposed), markup=False)
    if out:
        exported = export(proposed, stated.format, lossy=bool(lost))
        write_output(out, exported.text)
        console.print(f"proposal written to {out} ({stated.format}); run: {exported.launch.replace('FILE', str(out))}",
                      markup=False)


FLAG_OF = {"top_k": "--top", "time_limit_s": "--time-limit", "target_gap": "--gap", "price_per_gpu_hour": "--price-per-gpu-hour",
           "memory_reserve": "--memory-reserve"}


def _request(**options) -> PlanRequest:
    """The request, an error in it naming the flag the user typed where the field's name differs."""
    try:
        return PlanRequest.of(**options)
    except ParallaxError as error:
        if error.field not in FLAG_OF:
            raise
        raise PlanError(FLAG_OF[error.field], error.problem, error.hint) from None


def _model_door(model: str | None, module: str | None, example_shape: str | None, seq_len: int | None,
                dtype: str | None):
    """(the model's name, its traced Workload for --module else None, seq_len): one of MODEL and
    --module, the sequence length from --example-shape when --seq-len is not given."""
    if module and model:
        raise PlanError("--module", f"both MODEL ({model}) and --module ({module}) given", "give one of them")
    if not module:
        if model is None:
            raise PlanError("model", "no model given", "name one (see `parallax models`) or pass --module pkg.mod:factory")
        if example_shape:
            raise PlanError("--example-shape", "is for --module", "drop it, or plan a module with --module")
        if seq_len is None:
            raise PlanError("--seq-len", "is needed with MODEL", "e.g. --seq-len 4096")
        return model, None, seq_len
    import torch

    from planner.factory import build_on_meta, parse_shape

    if example_shape is None:
        raise PlanError("--example-shape", "is needed with --module", "the token ids' batch,sequence, e.g. 1,2048")
    shape = parse_shape(example_shape)
    if seq_len is not None and seq_len != shape[1]:
        raise PlanError("--seq-len", f"{seq_len} differs from --example-shape's sequence {shape[1]}", "drop --seq-len")
    with _progress() as progress:
        progress.add_task(f"tracing {module}", total=None)
        traced = resolve_workload(build_on_meta(module), seq_len=shape[1], dtype=dtype or "bf16",
                                  example_inputs=(torch.zeros(shape, dtype=torch.long),))
    return module, traced, shape[1]


def print_plan(result: Plan, model: str, out: Path | None, as_json: bool) -> None:
    """The plan (named as the user named its model) to --out, as JSON, or as tables."""
    result = result.model_copy(update={"model": model, "alternatives": [a.model_copy(update={"model": model}) for a in result.alternatives]})
    if not emit(result, out, as_json):
        console.print(render(result))
        if out:
            console.print(f"plan written to {out}")


@app.command("estimate")
@layout_flags
def estimate_command(
    model: Optional[str] = typer.Argument(None, help="the model; with --plan, default the plan's"),
    hw: Optional[str] = typer.Option(None, "--hw", help="hardware spec or profile; with --plan, default the plan's "
                                     "(another of the same GPU count re-prices the plan there)"),
    plan_file: Optional[Path] = typer.Option(None, "--plan", help="a plan JSON (hand-written or solved)"),
    global_batch: Optional[int] = typer.Option(None, "--global-batch"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="default bf16"),
    trust_module: bool = typer.Option(False, "--trust-module", help=TRUST_MODULE_HELP),
    as_json: bool = typer.Option(False, "--json"),
    from_file: Optional[Path] = typer.Option(None, "--from", help=FROM_HELP),
    from_format: Optional[str] = typer.Option(None, "--from-format", help=FROM_FORMAT_HELP),
    recompute_every: Optional[int] = typer.Option(None, "--recompute-every", min=1,
                                                  help="full recomputation on every k-th block and none on the rest"),
    axes: dict | None = None,
) -> None:
    """Price one given layout (from flags, --plan FILE or --from a tool's config) without searching; unset axes
    take their defaults."""
    options = dict(global_batch=global_batch, seq_len=seq_len, dtype=dtype, recompute_every=recompute_every, **(axes or {}))
    given = {k: v for k, v in options.items() if v is not None}
    for name, field in ((model, "model"), (hw, "--hw")):
        if name is not None:
            check_name(name, field)
    if from_file is not None and plan_file is not None:
        raise PlanError("--from", "given with --plan", "price one of them")
    if recompute_every and from_file is not None:
        raise PlanError("--recompute-every", "is for a layout given by flags", "drop it, or the --from file")
    if from_file is not None:
        from parallax_cli.from_config import stated_plan

        priced, stated, _, _ = stated_plan(from_file, from_format, model, hw, given)
        _print_priced(priced, as_json, "", [f"not priced: {u}" for u in stated.unpriced])
        return
    if plan_file is not None:
        model, cluster, plan, note = _plan_as_asked(plan_file, model, hw, given, trust_module)
    else:
        model, cluster, plan, note = _layout_from_flags(model, hw, given)
    _print_priced(plan.model_copy(update={"estimate": estimate(model, plan, cluster)}), as_json, note, [])


def _print_priced(priced: Plan, as_json: bool, note: str, lines: list[str]) -> None:
    if as_json:
        print(priced.to_json())
        return
    if note:
        console.print(note, markup=False)
    console.print(render(priced))
    for line in lines:
        console.print(line, markup=False)
    if not priced.estimate.fits:
        from planner.search.pinned import memory_note

        colour = "yellow" if priced.estimate.fits_with_retries else "red"
        console.print(f"[{colour}]{memory_note(priced.estimate)}[/{colour}]")


def _plan_as_asked(plan_file: Path, model: str | None, hw: str | None, given: dict, trust_module: bool):
    """(model, cluster, plan, first line) for --plan: options that the plan fixes are refused by name,
    another model is refused, other hardware of the same GPU count re-prices the plan there."""
    plan = load_plan(plan_file, trust_module)
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise PlanError(flags, f"given with --plan, whose layout fixes {'it' if len(given) == 1 else 'them'}",
                        "drop them to price the plan as written, or edit the plan")
    if model is not None and model != plan.model:
        raise PlanError("model", f"{model} differs from the plan's {plan.model}",
                        f"drop MODEL to price the plan's, or plan {model} with `parallax plan`")
    if hw is None or hw == plan.hardware:
        return plan.model, plan.cluster(), plan, ""
    cluster = resolve_hardware(hw)
    if cluster.spec() == plan.hardware and plan.hardware_profile is None:  # the plan's own, spelled otherwise
        return plan.model, cluster, plan, ""
    if plan.groups or cluster.n_gpus != plan.n_gpus:
        raise PlanError("--hw", f"{cluster.spec()} is not the plan's {plan.hardware}, and the plan's layout needs "
                        f"{plan.n_gpus} GPUs of one kind", f"drop --hw, or plan again with `parallax plan --hw {hw}`")
    repriced = plan.model_copy(update={"hardware": cluster.spec(), "hardware_profile": _profile(cluster)})
    return plan.model, cluster, repriced, f"re-priced on {cluster.spec()}, not the plan's {plan.hardware} (--hw)"


def _profile(cluster):
    from hardware import loads_back

    return None if loads_back(cluster) else cluster


def _layout_from_flags(model: str | None, hw: str | None, given: dict):
    """(model, cluster, plan, "") for a layout given by flags (defaults: dp=tp=pp=1, zero 0, bf16, 1f1b)."""
    if model is None or hw is None:
        raise PlanError("model" if model is None else "--hw", "is needed without --plan",
                        "e.g. parallax estimate llama-3-8b --hw 8xh100-sxm --global-batch 64 --seq-len 4096 --dp 8")
    if "global_batch" not in given or "seq_len" not in given:
        raise PlanError("--global-batch/--seq-len", "both are needed without --plan", "pass them, or --plan FILE")
    for key in set(given) & set(COUNT_LIMITS):
        check_count(key, given[key], COUNT_LIMITS[key])
    for key in set(given) & set(AXIS):
        if (why := AXIS[key].check(given[key])) is not None:
            raise PlanError(AXIS[key].flag, why)
    cluster = resolve_hardware(hw)
    layout = {"dtype": "bf16", **{axis.name: axis.default for axis in AXES}, **given}
    workload = resolve_workload(model, seq_len=layout["seq_len"], dtype=layout["dtype"])
    kinds = [layer.kind for layer in workload.layers]
    stages = layout["pp"] * layout["vpp"]
    if stages > workload.n_blocks:
        raise PlanError("pp", f"pp*vpp = {stages} stages exceed the {workload.n_blocks} blocks",
                        f"use pp <= {workload.n_blocks}")
    recompute, every = layout.pop("recompute"), layout.pop("recompute_every", None)
    parts = uniform_stages(kinds, stages, recompute)
    if every:
        if recompute != "none":
            raise PlanError("--recompute-every", f"given with --recompute {recompute}", "give one of them")
        parts = every_kth_block(parts, kinds, every)
    # a profile file's cluster travels with the plan (its spec names no catalog GPU)
    plan = Plan(model=model, hardware=cluster.spec(), hardware_profile=_profile(cluster), stages=parts, **layout)
    return model, cluster, plan, ""
