"""Traced workloads kept on disk between CLI calls.

Tracing a model imports torch and transformers and walks its graph: seconds that
every `parallax plan` of the same model would repeat. A named model's workload
(built-in name, config path or cached HF id) is stored under
~/.cache/parallax/workloads, keyed by its config, the sequence length, the dtype,
the torch and transformers versions and the bytes of the tracing code, so a
changed config or tracer never reads a stale entry. An unreadable entry is
traced again; a cache that cannot be written is skipped.
"""
from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from costmodel.workload import Workload

CACHE_DIR = Path.home() / ".cache" / "parallax" / "workloads"
_ROOT = Path(__file__).resolve().parents[2]
# the code whose output a cached workload is: this package (tracers, graph -> workload, the model
# catalog), the declaration of what TP splits, the Workload schema, the allocator a layer's slack is replayed on
_SOURCES = ("planner/trace/*.py", "planner/trace/models/*.py", "planner/executable.py", "layout/rules.py",
            "costmodel/workload.py", "costmodel/allocator.py")


def fingerprinted_files() -> list[Path]:
    return [path for pattern in _SOURCES for path in sorted(_ROOT.glob(pattern))]


@lru_cache(maxsize=1)
def _code_fingerprint() -> str:
    digest = hashlib.sha256()
    for path in fingerprinted_files():
        digest.update(path.name.encode() + path.read_bytes())
    for package in ("torch", "transformers"):
        try:
            digest.update(metadata.version(package).encode())
        except metadata.PackageNotFoundError:
            digest.update(b"-")
    return digest.hexdigest()


def _key(config: dict, seq_len: int, dtype: str, name: str) -> str:
    text = json.dumps({"config": config, "seq_len": seq_len, "dtype": dtype, "name": name}, sort_keys=True, default=str)
    return hashlib.sha256((text + _code_fingerprint()).encode()).hexdigest()[:32]


def cached_workload(name: str, seq_len: int, dtype: str, trace) -> Workload:
    """The workload of the named model: from the cache, or `trace()` and stored."""
    from planner.trace.models.catalog import model_config

    path = CACHE_DIR / f"{_key(model_config(name), seq_len, dtype, name)}.json"
    try:
        return Workload.model_validate_json(path.read_text())
    except (OSError, ValueError):
        pass
    workload = trace()
    try:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        # a name of this process's own: two processes tracing the same model never write one file
        partial = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
        partial.write_text(workload.model_dump_json())
        partial.replace(path)
    except OSError:
        pass
    return workload
