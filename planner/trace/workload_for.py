"""One entry point from "a model" to the cost model's `Workload`.

`model` may be a built-in name (see `planner.trace.models.catalog`), a HuggingFace
config object or dict, a reference GPT's `GPTConfig`, a `TransformerDims` (traced as the
architecture it describes, `planner.trace.dims`), a path to an .onnx file, or an
nn.Module (with example inputs; the ReferenceGPT's are made from its config). Built-in names are
cached: the planner asks for the same (name, seq_len, dtype) many times.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from costmodel.workload import Workload
from hardware.errors import ModelError
from planner.trace.graph import OpGraph
from planner.trace.to_workload import to_workload

__all__ = ["workload_for", "to_workload"]


def workload_for(model: Any, *, seq_len: int, dtype: str = "bf16", example_inputs: Any = None,
                 batch: int = 1) -> tuple[Workload, OpGraph]:
    """(Workload, OpGraph) for `model` at `seq_len` tokens per sequence."""
    if seq_len <= 0:
        raise ModelError("seq_len", f"must be positive, got {seq_len}")
    if dtype == "fp8":  # FP8 is how the GEMMs run (the cost model's choice); the model is traced in bf16
        dtype = "bf16"
    if isinstance(model, str) and not model.endswith(".onnx"):
        return _named(model, seq_len, dtype)
    from costmodel.transformer import TransformerDims
    from planner.trace.models.reference_gpt import GPTConfig

    if isinstance(model, TransformerDims):  # by its dimensions: the architecture they describe, traced
        from planner.trace.dims import model_of_dims, on_its_attention_path

        workload, graph = workload_for(model_of_dims(model), seq_len=seq_len, dtype=dtype, batch=batch)
        return on_its_attention_path(workload, model).model_copy(update={"name": model.name}), graph
    if isinstance(model, GPTConfig):  # the reference GPT by its dimensions (a GPT-era decoder)
        return _reference_gpt(model, seq_len, dtype, "reference-gpt")
    if isinstance(model, (str, Path)):
        from planner.trace.onnx_file import trace_onnx

        graph = trace_onnx(model, seq_len=seq_len, batch=batch)
        return to_workload(graph), graph
    if isinstance(model, dict) or _is_hf_config(model):
        return _hf(model, seq_len, dtype, batch)
    return _module(model, seq_len, dtype, example_inputs, batch)


@lru_cache(maxsize=64)
def _named(name: str, seq_len: int, dtype: str) -> tuple[Workload, OpGraph]:
    from planner.trace.models.build import is_reference
    from planner.trace.models.catalog import hf_config

    if is_reference(name):  # two blocks on the meta device, priced at the entry's real depth
        return _reference(name, seq_len, dtype)
    config = hf_config(name)
    from planner.trace.hf import trace_hf

    graph = trace_hf(config, seq_len=seq_len, dtype=dtype, name=name)
    return to_workload(graph), graph


def _reference(name: str, seq_len: int, dtype: str) -> tuple[Workload, OpGraph]:
    from planner.trace.models.build import reference_config

    return _reference_gpt(reference_config(name), seq_len, dtype, name)


@lru_cache(maxsize=64)
def _reference_gpt(real, seq_len: int, dtype: str, name: str) -> tuple[Workload, OpGraph]:
    """The reference GPT of config `real` (a `GPTConfig`), traced on two blocks and priced at its depth."""
    import dataclasses

    import torch

    from planner.trace.models.reference_gpt import ReferenceGPT
    from planner.trace.module import trace_module

    with torch.device("meta"):
        module = ReferenceGPT(dataclasses.replace(real, n_layers=min(2, real.n_layers)))
        tokens = torch.zeros(1, seq_len, dtype=torch.long)
    graph = trace_module(module, (tokens,), seq_len=seq_len, dtype=dtype, name=name)
    graph.meta.update({k: v for k, v in _module_meta(module).items() if v is not None})
    return to_workload(graph, n_blocks=real.n_layers), graph


def _is_hf_config(model: Any) -> bool:
    return any(cls.__name__ == "PretrainedConfig" or cls.__name__ == "PreTrainedConfig" for cls in type(model).__mro__)


def _hf(config: Any, seq_len: int, dtype: str, batch: int) -> tuple[Workload, OpGraph]:
    from planner.trace.models.catalog import hf_config
    from planner.trace.hf import trace_hf

    if isinstance(config, dict):
        config = hf_config(config)
    graph = trace_hf(config, seq_len=seq_len, dtype=dtype, batch=batch)
    return to_workload(graph), graph


def _module_meta(module: Any) -> dict[str, Any]:
    """heads / kv_heads / hidden / vocab from a module's `config` or `cfg` attribute."""
    cfg = getattr(module, "config", None) or getattr(module, "cfg", None)
    if cfg is None:
        return {}

    def pick(*names):
        return next((getattr(cfg, n) for n in names if isinstance(getattr(cfg, n, None), int)), None)

    heads = pick("num_attention_heads", "heads", "n_head", "num_heads")
    return {"heads": heads, "kv_heads": pick("num_key_value_heads", "kv_heads") or heads,
            "hidden": pick("hidden_size", "hidden", "n_embd", "d_model"), "vocab": pick("vocab_size", "vocab"),
            "max_seq_len": pick("max_seq_len", "n_positions")}


def _module(module: Any, seq_len: int, dtype: str, example_inputs: Any, batch: int) -> tuple[Workload, OpGraph]:
    import torch

    from planner.trace.module import trace_module

    if not isinstance(module, torch.nn.Module):
        raise ModelError("model", f"cannot trace a {type(module).__name__}",
                         "a built-in name, an HF config, an .onnx path or an nn.Module")
    if example_inputs is None:
        cfg = getattr(module, "cfg", None)
        if cfg is None or not hasattr(cfg, "vocab_size"):
            raise ModelError("example_inputs", f"needed to trace a {type(module).__name__}",
                             "pass example_inputs=(tensor, ...)")
        example_inputs = (torch.zeros(batch, seq_len, dtype=torch.long),)
    graph = trace_module(module, example_inputs, seq_len=seq_len, dtype=dtype)
    graph.meta.update({k: v for k, v in _module_meta(module).items() if v is not None})
    return to_workload(graph), graph
