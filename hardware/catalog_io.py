"""The GPU catalog: one JSON file per GPU type under `hardware/catalog/`.

A catalog entry holds the GPU, the node it usually ships in, and the usual
network between such nodes, each number with its source. Keeping them as data
(not Python) lets a user copy an entry, edit it, and pass the file to
`hardware.load`. Parsed files are cached: the planner calls `load` often.
"""
from __future__ import annotations

import difflib
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hardware.errors import HardwareError
from hardware import untrusted
from hardware.schema import GPU, Collectives, Node, _Sourced

CATALOG_DIR = Path(__file__).parent / "catalog"
LIBRARY_DIR = CATALOG_DIR / "collectives"


class Network(_Sourced):
    """The inter-node network of a catalog entry: one NIC per GPU."""

    nic_gbps: float = Field(gt=0, description="per-GPU NIC bandwidth, Gb/s (bits)")
    nic_latency_us: float = Field(ge=0)
    inter_fabric: str = "infiniband"
    storage_gbps_per_node: float | None = Field(None, gt=0, description="checkpoint write bandwidth per node, GB/s")
    collectives: Collectives | None = None


class CatalogEntry(BaseModel):
    """One GPU type with its default node and network; `count` only in user files."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1)
    aliases: list[str] = Field(default_factory=list)
    description: str = ""
    gpu: GPU
    node: Node
    network: Network
    count: int | None = Field(default=None, gt=0)


def first_error(error: ValidationError) -> tuple[str, str]:
    """(field path, message) of pydantic's first complaint, for a one-line error."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "(top level)"
    return where, first["msg"]


def read_json(path: Path) -> object:
    """Parse a profile file, bounded and checked (`hardware.untrusted`), every problem a HardwareError."""
    if not path.exists():
        raise HardwareError("hw", f"profile file {path} does not exist",
                            "give a catalog name such as 8xh100-sxm or an existing JSON file")
    return untrusted.read_json(path, "hw", "profile", error=HardwareError)


def with_library(data: dict, origin: str) -> dict:
    """Expand `network.collectives.library_file` ("nccl") into the protocols of
    `hardware/catalog/collectives/<name>.json`, so that the library's figures are
    written once and each fabric adds only its own measured `nic_scaling`."""
    network = data.get("network")
    spec = network.get("collectives") if isinstance(network, dict) else None
    if not isinstance(spec, dict) or "library_file" not in spec:
        return data
    name = spec["library_file"]
    path = LIBRARY_DIR / f"{name}.json"
    if not isinstance(name, str) or not path.is_file():
        known = ", ".join(sorted(p.stem for p in LIBRARY_DIR.glob("*.json")))
        raise HardwareError("network.collectives.library_file", f"unknown collective library {name!r} in {origin}",
                            f"use one of {known}")
    library = read_json(path)
    rest = {k: v for k, v in spec.items() if k != "library_file"}
    merged = {**library, **rest, "sources": {**library.get("sources", {}), **rest.get("sources", {})}}
    return {**data, "network": {**network, "collectives": merged}}


def parse_entry(data: object, origin: str) -> CatalogEntry:
    """Validate a catalog-entry dict; `origin` names the file in the error."""
    if not isinstance(data, dict):
        raise HardwareError("hw", f"{origin} must hold a JSON object, not {type(data).__name__}")
    data = with_library(data, origin)
    try:
        return CatalogEntry.model_validate(data)
    except ValidationError as error:
        where, message = first_error(error)
        raise HardwareError(where, f"{message} in {origin}",
                            "every number needs a source; see hardware/catalog/*.json") from None


@lru_cache(maxsize=None)
def _catalog() -> dict[str, CatalogEntry]:
    """All shipped entries by canonical name (parsed once per process)."""
    entries = {}
    for path in sorted(CATALOG_DIR.glob("*.json")):
        entry = parse_entry(read_json(path), str(path))
        entries[entry.name.lower()] = entry
    return entries


@lru_cache(maxsize=None)
def _alias_index() -> dict[str, str]:
    """Lower-case name or alias -> canonical catalog name."""
    index: dict[str, str] = {}
    for name, entry in _catalog().items():
        for key in (name, *entry.aliases):
            index[key.lower()] = name
    return index


def list_catalog() -> list[str]:
    """Canonical names of the shipped GPU types, sorted."""
    return sorted(_catalog())


def canonical_name(name: str) -> str | None:
    """The catalog name for `name` or any alias (case-insensitive), else None."""
    return _alias_index().get(name.strip().lower())


def unknown_gpu(name: str) -> HardwareError:
    """Error for an unknown GPU name, suggesting the closest known names."""
    close = difflib.get_close_matches(name.strip().lower(), list(_alias_index()), n=3, cutoff=0.5)
    close = list(dict.fromkeys(_alias_index()[c] for c in close))
    valid = ", ".join(list_catalog())
    hint = f"did you mean {' or '.join(close)}? valid: {valid}" if close else f"valid: {valid}"
    return HardwareError("hw", f"unknown GPU type {name!r}", hint)


def gpu_entry(name: str) -> CatalogEntry:
    """The catalog entry for a GPU name or alias; HardwareError if unknown."""
    canonical = canonical_name(name)
    if canonical is None:
        raise unknown_gpu(name)
    return _catalog()[canonical]
