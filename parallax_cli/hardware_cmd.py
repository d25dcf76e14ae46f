"""`parallax hardware`: list the GPU catalog and show a resolved hardware spec.

`show` prints every number next to its source, so a user can see which figures
are datasheet values, estimates, or their own overrides before planning.
"""
from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from hardware import Cluster, gpu_entry, list_catalog, load, price_per_gpu_hour
from parallax_cli import app, wide_console

hw_app = typer.Typer(help="GPU catalog and hardware specs (e.g. 64xh100-sxm).", no_args_is_help=True)
app.add_typer(hw_app, name="hardware")


def _console():
    """A wide console: tables are read in logs and tests as well as terminals."""
    return wide_console()


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


@hw_app.command("list")
def list_cmd() -> None:
    """One row per catalog GPU type with its default node and network."""
    table = Table(title="GPU catalog (dense peaks; per-GPU bandwidths)")
    columns = ("name", "bf16 TFLOP/s", "HBM GB", "HBM GB/s", "GPUs/node", "intra GB/s", "NIC Gb/s", "$/GPU-h")
    for column in columns:
        table.add_column(column, justify="left" if column == "name" else "right")
    for name in list_catalog():
        entry = gpu_entry(name)
        gpu, node = entry.gpu, entry.node
        table.add_row(name, _fmt(gpu.peak_flops("bf16") / 1e12), _fmt(gpu.hbm_gb), _fmt(gpu.hbm_gbps),
                      _fmt(node.gpus_per_node), _fmt(node.link_gbps), _fmt(entry.network.nic_gbps),
                      _fmt(price_per_gpu_hour(name).usd))
    _console().print(table)


def _rows(cluster: Cluster) -> list[tuple[str, str, str]]:
    """(field, value, source) for every field of the cluster, GPU, node and efficiency."""
    gpu, node, eff = cluster.gpu, cluster.node, cluster.gpu.efficiency
    rows = [("spec", cluster.spec(), ""), ("n_nodes", _fmt(cluster.n_nodes), "spec"),
            ("n_gpus", _fmt(cluster.n_gpus), "spec")]
    for dtype, tflops in gpu.peak_tflops.items():
        source = gpu.sources.get(f"peak_tflops.{dtype}", gpu.sources.get("peak_tflops", ""))
        rows.append((f"gpu.peak_tflops.{dtype}", _fmt(tflops), source))
    rows += [(f"gpu.{f}", _fmt(getattr(gpu, f)), gpu.sources.get(f, "")) for f in ("hbm_gb", "hbm_gbps", "mtbf_hours")]
    rows += [(f"gpu.efficiency.{f}", _fmt(getattr(eff, f)), eff.sources.get(f, ""))
             for f in type(eff).model_fields if f not in ("sources", "stacks", "priced_stack")]
    rows += [(f"gpu.efficiency.stacks.{stack}.{f}", _fmt(getattr(own, f)), own.sources.get(f, ""))
             for stack, own in eff.stacks.items() for f in type(own).model_fields
             if f != "sources" and getattr(own, f) is not None]
    rows += [(f"node.{f}", _fmt(getattr(node, f)), node.sources.get(f, ""))
             for f in type(node).model_fields if f != "sources"]
    rows += [(f, _fmt(getattr(cluster, f)), cluster.sources.get(f, ""))
             for f in ("nic_gbps", "nic_latency_us", "inter_fabric", "price_per_gpu_hour")]
    return rows


@hw_app.command("show")
def show_cmd(
    spec: str = typer.Argument(..., help="e.g. 64xh100-sxm, 2xcpu, a100, or a JSON profile file"),
    gpus_per_node: Optional[int] = typer.Option(None, help="override GPUs per node"),
    nic_gbps: Optional[float] = typer.Option(None, help="override per-GPU NIC bandwidth, Gb/s"),
    intra_gbps: Optional[float] = typer.Option(None, help="override per-GPU intra-node bandwidth, GB/s"),
    price: Optional[float] = typer.Option(None, help="override USD per GPU-hour"),
) -> None:
    """Every field of the resolved cluster, with the source of each number."""
    cluster = load(spec, gpus_per_node=gpus_per_node, nic_gbps=nic_gbps, intra_gbps=intra_gbps,
                   price_per_gpu_hour=price)
    table = Table(title=f"{cluster.spec()}: {cluster.n_nodes} node(s) x {cluster.gpus_per_node} {cluster.gpu.name}")
    for column in ("field", "value", "source"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for row in _rows(cluster):
        table.add_row(*row)
    _console().print(table)
