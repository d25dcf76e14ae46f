"""Hardware profiles: validated, sourced descriptions of GPUs, nodes and clusters.

`load("64xh100-sxm")` is the one entry point the planner and CLI need; the
catalog data lives in `hardware/catalog/*.json` and prices in `prices.json`.
The bottom of the data flow: it imports none of costmodel, planner, executor or the CLI.
"""
from hardware.catalog_io import CatalogEntry, gpu_entry, list_catalog
from hardware.errors import HardwareError, ParallaxError
from hardware.loader import load, loads_back
from hardware.prices import PriceQuote, load_price_table, price_per_gpu_hour
from hardware.schema import GPU, Cluster, Efficiency, Node

__all__ = [
    "load", "loads_back", "list_catalog", "gpu_entry", "CatalogEntry", "Cluster", "GPU", "Node", "Efficiency",
    "HardwareError", "ParallaxError", "price_per_gpu_hour", "PriceQuote", "load_price_table",
]
