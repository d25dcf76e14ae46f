"""Human summary of a plan: rich tables for the terminal."""
from __future__ import annotations

from rich.console import Group
from rich.table import Table

from layout.axes import RECOMPUTE
from layout.plan import Plan

GIB = 2**30


def _layout_line(plan: Plan) -> str:
    sched = plan.schedule + (f" v={plan.vpp}" if plan.vpp > 1 else "") if plan.pp > 1 else "-"
    return (
        f"dp={plan.dp}{f' ({plan.hsdp_label})' if plan.hsdp_label else ''}{f' ep={plan.ep}' if plan.ep > 1 else ''}{f' cp={plan.cp}' if plan.cp > 1 else ''} tp={plan.tp}{' +sp' if plan.sp else ''}{' +overlap' if plan.tp_overlap else ''} "
        f"pp={plan.pp} zero={plan.zero}{' +offload' if plan.offload else ''} "
        f"micro_batch={plan.micro_batch} x {_micro_batches(plan)} schedule={sched}"
        + (f" compression={plan.compression}" if plan.compression != "none" else "")
        + (f" stack={plan.stack}" if plan.stack != "eager" else "") + (" (priced, not run)" if plan.stack == "fused" else "")
        + _recipe(plan)
    )


def _recipe(plan: Plan) -> str:
    """The precision and accumulation policies off their defaults."""
    return "".join(f" {name}={value}" for name, value in plan.recipe_changes().items())


def _micro_batches(plan: Plan) -> str:
    """Micro-batches per replica: one count, or each distinct share ("3/5") when they differ."""
    if not plan.dp_micro_batches:
        return str(plan.num_micro_batches)
    return "/".join(str(m) for m in sorted(set(plan.dp_micro_batches)))


def _policy_counts(recompute: list[str]) -> str:
    parts = [f"{recompute.count(p)} {p}" for p in RECOMPUTE if recompute.count(p)]
    return ", ".join(parts)


def stage_table(plan: Plan) -> Table:
    table = Table(title="Stages", show_lines=False)
    for col in ("stage", "rank", "layers", "recompute", "fwd ms", "bwd ms", "GiB", "memory"):
        table.add_column(col, justify="right" if col not in ("layers", "recompute", "memory") else "left")
    est = {s.index: s for s in plan.estimate.stages} if plan.estimate else {}
    for index, stage in enumerate(plan.stages):
        e = est.get(index)
        mem = e.memory_bytes if e else {}
        table.add_row(
            str(index),
            str(plan.stage_rank(index)),
            f"{stage.start}-{stage.end - 1}",
            _policy_counts(stage.recompute),
            f"{e.forward_s * 1e3:.1f}" if e else "",
            f"{e.backward_s * 1e3:.1f}" if e else "",
            f"{sum(mem.values()) / GIB:.1f}" if mem else "",
            " ".join(f"{k[:3]} {v / GIB:.1f}" for k, v in mem.items() if v > 0),
        )
    return table


def breakdown_table(plan: Plan) -> Table:
    est = plan.estimate
    table = Table(title="Step time", show_header=True)
    table.add_column("part")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for key, value in est.breakdown_s.items():
        if value > 0:
            table.add_row(key, f"{value:.3f}", f"{value / est.step_time_s:.1%}")
    table.add_row("[bold]step[/bold]", f"[bold]{est.step_time_s:.3f}[/bold]", "100%")
    return table


def _tflops(value: float) -> str:
    """Whole TFLOP/s on a GPU; three figures below 100 (a CPU rank's 0.0762, not 0)."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _memory(est) -> str:
    """The tensors' peak (max_memory_allocated) and, where torch's caching allocator holds more, its
    reservation (max_memory_reserved), the figure held to the GPU's usable memory."""
    of = f"of {est.memory_capacity_bytes / GIB:.1f} GiB"
    if est.peak_reserved_bytes is None or est.peak_reserved_bytes <= est.peak_memory_bytes:
        return f"{est.peak_memory_bytes / GIB:.1f} {of}"
    return f"{est.peak_memory_bytes / GIB:.1f} GiB allocated, {est.peak_reserved_bytes / GIB:.1f} reserved {of}"


def headline(plan: Plan) -> str:
    est = plan.estimate
    guess = plan.cluster().guess_warning()
    lines = [f"[bold yellow]{guess}[/bold yellow]"] if guess else []
    lines += [f"[bold]{plan.model}[/bold] on [bold]{plan.hardware}[/bold]: global batch {plan.global_batch} x {plan.seq_len} tokens, {plan.dtype}",
              f"layout: {_layout_line(plan)}"]
    if est:
        lines.append(
            f"step {est.step_time_s:.3f} s | {est.tokens_per_s:,.0f} tokens/s | {_tflops(est.tflops_per_gpu_model)} TFLOP/s "
            f"per GPU (model), {_tflops(est.tflops_per_gpu_hw)} with recompute | MFU {est.mfu:.1%} | peak memory "
            f"{_memory(est)}"
        )
        if est.usd_per_million_tokens is not None:
            lines.append(f"cost ${est.usd_per_hour:,.2f}/hour, ${est.usd_per_million_tokens:.3f} per 1M tokens")
        if plan.offload:
            lines.append(offload_line(plan))
    if plan.solver:
        s = plan.solver
        lines.append(f"solver: {s.status}, {s.layouts_considered} layouts, {s.layouts_solved} solved with CP-SAT, "
                     f"{'no proven bound' if s.gap is None else f'gap {s.gap:.1%}'}, {s.wall_s:.1f} s")
        lines += s.notes
    if plan.checkpointing:
        lines.append(plan.checkpointing.line())
    lines += plan.notes
    return "\n".join(lines)


def offload_line(plan: Plan) -> str:
    """Where the offloaded states live and what crossing to them costs per step."""
    est = plan.estimate
    host = (f"{est.host_memory_bytes / 1e9:,.0f} of {est.host_memory_capacity_bytes / 1e9:,.0f} GB host memory per node"
            if est.host_memory_bytes else "states in the ranks' own (host) memory")
    return (f"offload: {host}; host<->device copies {est.host_copy_s:.2f} s per step before overlap "
            f"({est.host_copy_s / est.step_time_s:.1%} of the step), AdamW on the host "
            f"{est.breakdown_s.get('optimizer', 0.0):.2f} s")


def alternatives_table(plan: Plan) -> Table:
    table = Table(title="Alternatives")
    mixed = bool(plan.groups)
    for col in (("on",) if mixed else ()) + ("layout", "step s", "tokens/s", "MFU", "reserved GiB"):
        table.add_column(col)
    for alt in plan.alternatives:
        e = alt.estimate
        where = (f"{alt.split} split" if alt.split else f"{alt.hardware} alone",) if mixed else ()
        table.add_row(*where, _layout_line(alt), f"{e.step_time_s:.3f}", f"{e.tokens_per_s:,.0f}", f"{e.mfu:.1%}",
                      f"{e.held_bytes / GIB:.1f}")
    return table


def _span(values: list[int]) -> str:
    return f"{values[0]}-{values[-1]}" if len(values) > 1 else str(values[0])


def groups_table(plan: Plan) -> Table:
    """A mixed-cluster plan's share per GPU group: its ranks, stages, blocks, micro-batches and memory."""
    table = Table(title=f"GPU groups ({plan.split} split)")
    for col in ("group", "ranks", "stages", "blocks/stage", "replicas", "micro-batches", "per-mb ms", "busy s", "idle",
                "GiB"):
        table.add_column(col, justify="left" if col in ("group", "ranks", "stages", "blocks/stage") else "right")
    for g in plan.estimate.groups:
        table.add_row(g.group, g.ranks, _span(g.stages), ",".join(map(str, g.blocks_per_stage)),
                      str(g.replicas), str(g.micro_batches), f"{g.per_micro_batch_s * 1e3:.1f}", f"{g.busy_s:.2f}",
                      f"{g.idle_fraction:.0%}", f"{g.held_bytes / GIB:.1f}/{g.memory_capacity_bytes / GIB:.0f}")
    return table


def render(plan: Plan) -> Group:
    parts = [headline(plan)]
    if plan.estimate and plan.estimate.groups:
        parts.append(groups_table(plan))
    if plan.estimate:
        parts += [stage_table(plan), breakdown_table(plan)]
    if plan.alternatives:
        parts.append(alternatives_table(plan))
    return Group(*parts)
