"""Turn a hardware spec ("64xh100-sxm", a JSON file, a Cluster) into a `Cluster`.

Every problem with user input becomes a `HardwareError` naming the field and a
valid alternative, so the CLI prints one line instead of a traceback. Values
passed as overrides replace catalog figures and are marked "user override" in
`sources`, so a plan report always shows where each number came from.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import ValidationError

from hardware.catalog_io import (CatalogEntry, Network, canonical_name, first_error, gpu_entry,
                                 list_catalog, parse_entry, read_json, unknown_gpu)
from hardware.errors import HardwareError
from hardware.limits import MAX_GPUS
from hardware.prices import PriceQuote, price_per_gpu_hour as _price_lookup
from hardware.schema import GPU, Cluster, Collectives, Node

__all__ = ["load", "list_catalog", "gpu_entry", "loads_back"]

USER = "user override"
_COUNT_AND_NAME = re.compile(r"^\s*(\S*?)\s*[x×]\s*(\S.*?)\s*$", re.IGNORECASE)
_EXAMPLE = "e.g. 8xh100-sxm, 64 x a100-80g, h200, or a JSON profile file"


@dataclass(frozen=True)
class _Base:
    """What a spec resolves to before counts and overrides are applied."""

    name: str
    gpu: GPU
    node: Node
    network: Network
    count: int | None = None
    price: PriceQuote | None = None
    origin: str = ""  # " in FILE" for profile files, so count errors name the file


def load(spec: str | Path | Cluster, *, gpus_per_node: int | None = None, nic_gbps: float | None = None,
         nic_latency_us: float | None = None, intra_gbps: float | None = None,
         intra_latency_us: float | None = None, price_per_gpu_hour: float | None = None,
         price_table: str | Path | dict | None = None) -> Cluster:
    """Resolve `spec` to a validated Cluster; keyword overrides replace catalog figures."""
    base = _resolve(spec)
    node = _override_node(base.node, gpus_per_node, intra_gbps, intra_latency_us)
    count = base.count if base.count is not None else node.gpus_per_node
    node, n_nodes = _fit_count(count, node, base.name, base.origin)
    nic, nic_lat, net_sources = _network(base.network, nic_gbps, nic_latency_us)
    price, price_sources = _price(base, price_per_gpu_hour, price_table)
    fields = dict(name=base.name, gpu=base.gpu, node=node, n_nodes=n_nodes, nic_gbps=nic,
                  nic_latency_us=nic_lat, inter_fabric=base.network.inter_fabric,
                  storage_gbps_per_node=base.network.storage_gbps_per_node,
                  collectives=_shift_steps(base.network.collectives, node.link_latency_us - base.node.link_latency_us,
                                            nic_lat - base.network.nic_latency_us),
                  price_per_gpu_hour=price, sources={**net_sources, **price_sources})
    try:
        return Cluster(**fields)
    except ValidationError as error:
        where, message = first_error(error)
        raise HardwareError(where, message + base.origin, _EXAMPLE) from None


def loads_back(cluster: Cluster) -> bool:
    """Whether `cluster`'s spec alone rebuilds it (a catalog cluster), so that a plan need not
    embed it: not for a calibrated or edited profile."""
    try:
        return load(cluster.spec()) == cluster
    except HardwareError:
        return False


# --- resolving the spec -----------------------------------------------------

def _resolve(spec: object) -> _Base:
    """Dispatch on the spec's form: Cluster, path, or catalog spec string."""
    if isinstance(spec, Cluster):
        return _from_cluster(spec)
    if isinstance(spec, Path):
        return _from_file(spec)
    if not isinstance(spec, str):
        raise HardwareError("hw", f"expected a spec string, path or Cluster, not {type(spec).__name__}", _EXAMPLE)
    if _looks_like_path(spec):
        return _from_file(Path(spec))
    return _from_string(spec)


def _looks_like_path(text: str) -> bool:
    """A spec is a file if it says so (.json, a slash) or names an existing file."""
    stripped = text.strip()
    if stripped.lower().endswith(".json") or "/" in stripped or "\\" in stripped:
        return True
    try:
        return bool(stripped) and Path(stripped).is_file()
    except (OSError, ValueError):
        return False


def _from_string(text: str) -> _Base:
    """Parse "[COUNT x] NAME" where NAME is a catalog name or alias."""
    if not text.strip():
        raise HardwareError("hw", "empty hardware spec", f"{_EXAMPLE}; valid GPUs: {', '.join(list_catalog())}")
    if canonical_name(text):
        return _from_entry(gpu_entry(text), None)
    match = _COUNT_AND_NAME.match(text)
    if match is None or canonical_name(match.group(2)) is None:
        numeric = match is not None and re.fullmatch(r"[+-]?[\d.]+", match.group(1) or "")
        raise unknown_gpu(match.group(2) if numeric else text.strip())
    entry = gpu_entry(match.group(2))
    return _from_entry(entry, _parse_count(match.group(1), entry.name))


def _parse_count(text: str, name: str) -> int:
    """A GPU count: a positive whole number."""
    hint = f"write a positive whole number of GPUs, e.g. 8x{name}"
    if not re.fullmatch(r"[+-]?\d+", text):
        problem = "missing GPU count before 'x'" if not text else f"GPU count {text!r} is not a whole number"
        raise HardwareError("hw", problem, hint)
    count = int(text)
    if count <= 0:
        raise HardwareError("hw", f"GPU count must be positive, got {count}", hint)
    if count > MAX_GPUS:
        raise HardwareError("hw", f"{count:,} GPUs is more than the {MAX_GPUS:,} Parallax plans for", hint)
    return count


def _from_entry(entry: CatalogEntry, count: int | None) -> _Base:
    return _Base(entry.name, entry.gpu, entry.node, entry.network, count if count is not None else entry.count)


def _from_cluster(cluster: Cluster) -> _Base:
    """Re-open a Cluster so overrides can be applied the same way as to an entry."""
    net_sources = {k: v for k, v in cluster.sources.items() if k in ("nic_gbps", "nic_latency_us", "storage_gbps_per_node")}
    network = Network.model_construct(nic_gbps=cluster.nic_gbps, nic_latency_us=cluster.nic_latency_us,
                                      storage_gbps_per_node=cluster.storage_gbps_per_node,
                                      inter_fabric=cluster.inter_fabric, collectives=cluster.collectives,
                                      sources=net_sources)
    price = None
    if cluster.price_per_gpu_hour is not None:
        price = PriceQuote(cluster.price_per_gpu_hour, cluster.sources.get("price_per_gpu_hour", "profile"))
    return _Base(cluster.name, cluster.gpu, cluster.node, network, cluster.n_gpus, price)


def _from_file(path: Path) -> _Base:
    """A full Cluster dump (has "n_nodes") or a catalog-entry-style file (+ "count")."""
    data = read_json(path)
    if isinstance(data, dict) and "n_nodes" in data:
        try:
            return replace(_from_cluster(Cluster.model_validate(data)), origin=f" in {path}")
        except ValidationError as error:
            where, message = first_error(error)
            raise HardwareError(where, f"{message} in {path}", "compare with Cluster.model_dump_json()") from None
    return replace(_from_entry(parse_entry(data, str(path)), None), origin=f" in {path}")


# --- counts and overrides -----------------------------------------------------

def _fit_count(count: int, node: Node, name: str, origin: str = "") -> tuple[Node, int]:
    """(node, n_nodes) for `count` GPUs: whole nodes, or one partial node dividing the node."""
    per_node = node.gpus_per_node
    if count % per_node == 0:
        return node, count // per_node
    if count < per_node and per_node % count == 0:
        note = f"partial node: {count} of the {per_node} GPUs of a {name} node"
        return _rebuild(node, {"gpus_per_node": count}, note, "gpus_per_node"), 1
    lower, upper = _nearest_counts(count, per_node)
    options = " or ".join(f"{c}x{name}" for c in (lower, upper) if c)
    raise HardwareError("hw", f"{count} GPUs do not fill whole nodes of {per_node}{origin}",
                        f"nearest valid counts: {options}")


def _nearest_counts(count: int, per_node: int) -> tuple[int | None, int]:
    """The valid counts just below and above `count` (divisors of a node, or whole nodes)."""
    if count > per_node:
        return count // per_node * per_node, (count // per_node + 1) * per_node
    divisors = [d for d in range(1, per_node + 1) if per_node % d == 0]
    return max((d for d in divisors if d < count), default=None), min(d for d in divisors if d > count)


def _number(field: str, value: object, *, integer: bool = False, allow_zero: bool = False) -> float:
    """Check one override value; refuse bools, NaN, infinities and out-of-range numbers."""
    kind = "a positive whole number" if integer else ("a non-negative number" if allow_zero else "a positive number")
    ok_type = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_type) or not math.isfinite(value):
        raise HardwareError(field, f"{value!r} is not {kind}", f"give {kind}")
    if value < 0 or (value == 0 and not allow_zero):
        raise HardwareError(field, f"{value!r} is not {kind}", f"give {kind}")
    return value


def _rebuild(model, updates: dict, source: str, *fields: str):
    """A re-validated copy of `model` with `updates`, citing `source` for `fields`."""
    sources = {**model.sources, **{f: source for f in fields}}
    return type(model).model_validate({**model.model_dump(), **updates, "sources": sources})


def _override_node(node: Node, gpus_per_node, intra_gbps, intra_latency_us) -> Node:
    """Apply the intra-node overrides that were given."""
    updates = {}
    if gpus_per_node is not None:
        updates["gpus_per_node"] = int(_number("gpus_per_node", gpus_per_node, integer=True))
    if intra_gbps is not None:
        updates["link_gbps"] = _number("intra_gbps", intra_gbps)
    if intra_latency_us is not None:
        updates["link_latency_us"] = _number("intra_latency_us", intra_latency_us, allow_zero=True)
    return _rebuild(node, updates, USER, *updates) if updates else node


def _network(network: Network, nic_gbps, nic_latency_us) -> tuple[float, float, dict[str, str]]:
    """(nic_gbps, nic_latency_us, their sources) after overrides."""
    sources = {k: network.sources.get(k, "profile") for k in ("nic_gbps", "nic_latency_us")}
    if network.storage_gbps_per_node is not None:
        sources["storage_gbps_per_node"] = network.sources.get("storage_gbps_per_node", "profile")
    nic, latency = network.nic_gbps, network.nic_latency_us
    if nic_gbps is not None:
        nic, sources["nic_gbps"] = _number("nic_gbps", nic_gbps), USER
    if nic_latency_us is not None:
        latency, sources["nic_latency_us"] = _number("nic_latency_us", nic_latency_us, allow_zero=True), USER
    return nic, latency, sources


def _shift_steps(collectives: Collectives | None, intra_delta_us: float, inter_delta_us: float):
    """A link-latency override moves every protocol's step latency by the same amount:
    the link is that much slower (or faster) per hop, whatever the library does on it."""
    if collectives is None or (intra_delta_us == 0 and inter_delta_us == 0):
        return collectives
    ring, tree = ([p.model_copy(update={"intra_step_us": max(0.0, p.intra_step_us + intra_delta_us),
                                        "inter_step_us": max(0.0, p.inter_step_us + inter_delta_us)})
                   for p in protocols] for protocols in (collectives.ring, collectives.tree))
    return collectives.model_copy(update={"ring": ring, "tree": tree})


def _price(base: _Base, override, table) -> tuple[float | None, dict[str, str]]:
    """Price per GPU-hour and its source: override, then the profile's own, then the table."""
    if override is not None:
        return _number("price_per_gpu_hour", override, allow_zero=True), {"price_per_gpu_hour": USER}
    quote = base.price or _price_lookup(base.gpu.name if canonical_name(base.gpu.name) else base.name, table)
    if quote.usd is None:
        return None, {}
    source = f"{quote.source} ({quote.date})" if quote.date else quote.source
    return quote.usd, {"price_per_gpu_hour": source}
