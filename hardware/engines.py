"""Serving engines as data: what an engine family adds to the serving roofline on one GPU type.

`costmodel.inference` prices a decode iteration as a roofline: weights and KV cache streamed at
the HBM's bandwidth times an efficiency, compute where it exceeds that, the TP all-reduces. An
engine reaches its own share of the bandwidth with its own kernels, and spends time per iteration
outside them: scheduling, sampling, launches, its all-reduce kernels' latency. Each entry holds
those two figures for one engine family on the GPU types its fit covered, each with its source
(`benchmarks/fit_serving.py` over the cited rows of `benchmarks/data/serving_runs.csv`).

The weight-only quantization methods the engines serve are data too (`WeightQuantization`):
the bytes a packed weight and its group's scale and zero point take, and the GPUs whose
kernels run them.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hardware.catalog_io import gpu_entry
from hardware.errors import PlanError
from hardware.schema import GPU, _Sourced

ENGINES_FILE = Path(__file__).parent / "catalog" / "engines" / "serving_engines.json"


class EngineFit(_Sourced):
    """One engine family on one GPU type."""

    unsourced_fields = frozenset({"gpu"})
    gpu: str = Field(description="the catalog GPU type the fit is for")
    hbm_efficiency: float = Field(gt=0, le=1, description="share of the HBM bandwidth a decode iteration streams at")
    step_overhead_ms: float = Field(ge=0, description="time a decode iteration spends beyond the roofline, ms")


class Engine(_Sourced):
    """An engine family: its default cap on running sequences, its KV page, how it schedules
    prompts beside decodes, and its fits per GPU type."""

    unsourced_fields = frozenset({"name", "fits"})
    name: str
    aliases: list[str] = Field(default_factory=list, description="other names a run of this engine goes by (its "
                               "spellings, and products built on it), lower case")
    max_sequences: int | None = Field(None, ge=1, description="sequences the engine runs at once unless told "
                                      "otherwise (None: as many as the KV cache holds)")
    kv_block_tokens: int | None = Field(None, ge=1, description="tokens a KV cache page holds by default (None: "
                                        "not sourced, priced at vLLM's)")
    mixes_prefill: bool = Field(description="whether the engine runs prompt chunks in one batch with the decoding "
                                "sequences by default (one weight read an iteration), or prefills in passes of their own")
    kv_memory_of: Literal["total", "free"] | None = Field(
        None, description="what its memory fraction is a share of: the GPU's whole memory, which the weights, the "
        "activations and the KV cache share (total), or the memory left free once the weights and the runtime are "
        "loaded, which the KV cache takes (free); None: not sourced, priced as vLLM's total")
    fits: list[EngineFit]

    def fit_on(self, gpu: str) -> EngineFit | None:
        """The family's fit on GPU type `gpu` (None: the fit did not cover it)."""
        return next((fit for fit in self.fits if fit.gpu == gpu), None)

    def fit_of_arch(self, arch: str | None) -> EngineFit | None:
        """The family's fit on a catalog GPU of architecture `arch` (an H200 runs the H100's sm90
        kernels; None: no fit on that architecture)."""
        return next((fit for fit in self.fits if arch and gpu_entry(fit.gpu).gpu.arch == arch), None)


class EngineCatalog(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    engines: list[Engine]


@lru_cache(maxsize=None)
def _read(path: Path, model: type[BaseModel]):
    """A catalog file, validated once."""
    return model.model_validate(json.loads(path.read_text()))


def _named(items: list, name: str, field: str, what: str, none_name: str, hint: str = ""):
    """The catalog item called `name`; None for `none_name`; any other name refused by name."""
    if name == none_name:
        return None
    found = next((item for item in items if item.name == name), None)
    if found is None:
        raise PlanError(field, f"unknown {what} {name!r}",
                        f"use one of {', '.join([none_name, *(item.name for item in items)])}{hint}")
    return found


def engine_catalog() -> EngineCatalog:
    return _read(ENGINES_FILE, EngineCatalog)


def engine_names() -> list[str]:
    return ["generic", *(engine.name for engine in engine_catalog().engines)]


def engine_aliases() -> dict[str, str]:
    """Every name an engine family answers to (its own and its aliases) -> the family's name."""
    return {alias: engine.name for engine in engine_catalog().engines for alias in (engine.name, *engine.aliases)}


def _family(name: str) -> Engine | None:
    """The catalog's engine family `name` (or one of its aliases); None for "generic". An unknown
    engine is refused by name."""
    return _named(engine_catalog().engines, engine_aliases().get(name.lower(), name), "engine", "serving engine",
                  "generic")


def engine_fit(name: str, gpu: str) -> EngineFit | None:
    """The fit of engine `name` on `gpu`; None for "generic" or a GPU the fit did not cover."""
    family = _family(name)
    return family.fit_on(gpu) if family is not None else None


@dataclass(frozen=True)
class ServingEngine:
    """An engine family as one GPU type runs it: its fit there (None: the generic roofline), its
    cap on running sequences (None: as many as the KV cache holds), its KV page and whether it
    batches prompt chunks with the decodes."""

    name: str = "generic"
    fit: EngineFit | None = None
    max_sequences: int | None = None
    kv_block_tokens: int | None = None  # its default KV page (None: vLLM's, `costmodel.inference.KV_BLOCK_TOKENS`)
    mixes_prefill: bool = True  # prompt chunks batched with the decodes (the roofline: as current vLLM and TensorRT-LLM)
    host_overhead_ms: float = 0.0  # per iteration where `fit` is None: the family's fitted overhead, host work
    kv_memory_of: str = "total"  # the memory fraction's base: the whole GPU (vLLM, SGLang) or what loading left free

    @property
    def step_overhead_ms(self) -> float:
        """What an iteration spends beyond the roofline: the fit's, else the family's host work."""
        return self.fit.step_overhead_ms if self.fit is not None else self.host_overhead_ms


def resolve_engine(engine: "str | ServingEngine", gpu: "str | GPU") -> tuple[ServingEngine, str]:
    """The engine family `engine` names, on `gpu` (a catalog name or a profile's GPU): its fit
    there, else its fit on a GPU of the same architecture (the engine runs the same kernels),
    else the roofline with the family's per-iteration overhead (the median of its fits': host
    work, scheduling and sampling, whatever the GPU); a note says which."""
    if isinstance(engine, ServingEngine):
        return engine, ""
    family = _family(engine)
    if family is None:
        return ServingEngine(engine), ""
    name, arch = (gpu, gpu_entry(gpu).gpu.arch) if isinstance(gpu, str) else (gpu.name, gpu.arch)
    fit, host, note = _priced_by(family, name, arch)
    return ServingEngine(family.name, fit, family.max_sequences, family.kv_block_tokens, family.mixes_prefill, host,
                         family.kv_memory_of or "total"), note


def _priced_by(family: Engine, gpu: str, arch: str | None) -> tuple[EngineFit | None, float, str]:
    """(fit, host overhead ms where there is no fit, note) of `family` on GPU type `gpu`."""
    own = family.fit_on(gpu)
    if own is not None:
        return own, 0.0, ""
    where = "hardware/catalog/engines/serving_engines.json"
    kin = family.fit_of_arch(arch)
    if kin is not None:
        return kin, 0.0, (f"{family.name} has no fit on {gpu} ({where}): priced with its fit on {kin.gpu}, the same "
                          f"{arch} architecture")
    if not family.fits:
        return None, 0.0, f"{family.name} has no fit ({where}): priced by the generic roofline"
    host = statistics.median(f.step_overhead_ms for f in family.fits)
    return None, host, (f"{family.name} has no fit on {gpu} or its architecture ({where}): priced by the generic "
                        f"roofline and the family's {host:g} ms per iteration of host work (fitted on "
                        f"{', '.join(f.gpu for f in family.fits)})")


QUANTIZATION_FILE = Path(__file__).parent / "catalog" / "engines" / "weight_quantization.json"


class WeightQuantization(_Sourced):
    """A quantization method an engine serves: the bytes a weight takes, the activations' bits
    (16: weight-only, the GEMMs at the 16-bit rate; 8: W8A8, the blocks' GEMMs at the GPU's INT8
    rate) and the GPUs whose kernels run it."""

    unsourced_fields = frozenset({"name", "description"})
    name: str
    description: str
    bits: int = Field(ge=1, le=16)
    group_size: int = Field(ge=1, description="weights sharing one scale and zero point")
    group_bytes: float = Field(ge=0, description="bytes of one group's scale and zero point")
    min_cuda_arch: int = Field(description="the oldest NVIDIA compute capability (x10) its kernels run on; AMD: none")
    activation_bits: Literal[8, 16] = Field(16, description="16: weight-only; 8: INT8 activations and GEMMs")

    @property
    def gemm_dtype(self) -> str | None:
        """The dtype the blocks' GEMMs run in, where the method sets one (None: the activations')."""
        return "int8" if self.activation_bits == 8 else None

    @property
    def bytes_per_weight(self) -> float:
        return self.bits / 8 + self.group_bytes / self.group_size


class QuantizationCatalog(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    methods: list[WeightQuantization]


def quantization_catalog() -> QuantizationCatalog:
    return _read(QUANTIZATION_FILE, QuantizationCatalog)


def quantization_names() -> list[str]:
    return [method.name for method in quantization_catalog().methods]


def weight_quantization(name: str, gpu) -> WeightQuantization | None:
    """Method `name` on `gpu` (a `hardware.schema.GPU`); None for "none". A method not in the
    catalog, or one the GPU's kernels lack, is refused by name."""
    method = _named(quantization_catalog().methods, name, "quantization", "weight quantization", "none",
                    " (fp8 weights: --dtype fp8)")
    if method is None:
        return None
    arch = gpu.arch or ""
    if not (arch.startswith("sm") and int(arch[2:]) >= method.min_cuda_arch):
        raise PlanError("quantization", f"{name} weights run on NVIDIA GPUs of compute capability "
                        f"{method.min_cuda_arch / 10:.1f} and newer, and {gpu.name} is {arch or 'not one'}",
                        "use none, or fp8 weights (--dtype fp8) where the GPU has FP8")
    if method.gemm_dtype is not None and method.gemm_dtype not in gpu.peak_tflops:
        raise PlanError("quantization", f"{name} runs its GEMMs in {method.gemm_dtype}, and {gpu.name}'s profile "
                        f"states no {method.gemm_dtype} peak", "use a weight-only method (int8, int4), or none")
    return method
