"""Trace a HuggingFace model from its config alone: no download, no weights.

The model is built under `FakeTensorMode` (weights are shapes only) at the
real width but a reduced depth (2 layers), traced, and the block profile is
repeated to the real depth by `to_workload` ("price repeated layers once"):
a 126-layer 405B model costs what a 2-layer one does.
"""
from __future__ import annotations

import copy
import inspect
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hardware.errors import ModelError
from planner.trace.graph import OpGraph
from planner.trace.module import trace_module
from planner.trace.ops import DTYPES

DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers")
ATTENTION_DROPOUT_KEYS = ("attn_pdrop", "attention_probs_dropout_prob", "attention_dropout")


def reduced_config(config: Any, depth: int = 2) -> tuple[Any, dict[str, int]]:
    """A copy of `config` with every depth key capped at `depth`; the real depths."""
    small = copy.deepcopy(config)
    real = {}
    for key in DEPTH_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            real[key] = value
            setattr(small, key, min(value, depth))
    for key in ATTENTION_DROPOUT_KEYS:  # as the executor runs HF models: no dropout, so ranks match the reference
        if isinstance(getattr(small, key, None), float):
            setattr(small, key, 0.0)
    layer_types = getattr(small, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) > depth:
        small.layer_types = layer_types[-depth:]
    return small, real


def _model_class(config: Any):
    import transformers

    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    auto = transformers.AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) \
        else transformers.AutoModelForCausalLM
    try:
        auto._model_mapping[type(config)]
        return auto
    except KeyError:
        return transformers.AutoModel


def build_hf_model(config: Any, fake_mode: FakeTensorMode, dtype: str = "bf16") -> torch.nn.Module:
    """Instantiate the config's architecture with fake weights, in training mode."""
    cls = _model_class(config)
    try:
        with fake_mode:
            if hasattr(cls, "from_config"):
                model = cls.from_config(config, dtype=DTYPES.get(dtype, torch.bfloat16))
            else:
                model = cls._from_config(config, dtype=DTYPES.get(dtype, torch.bfloat16))
    except Exception as error:  # noqa: BLE001
        first = (str(error).strip().splitlines() or [""])[0][:300]
        raise ModelError("model", f"cannot build {getattr(cls, '__name__', cls)} from its config: "
                                  f"{type(error).__name__}: {first}") from error
    return model.train()


def config_meta(config: Any) -> dict[str, Any]:
    """heads / kv_heads / hidden / vocab as the Workload wants them."""
    heads = getattr(config, "num_attention_heads", None)
    return {"heads": heads, "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "hidden": getattr(config, "hidden_size", None), "vocab": getattr(config, "vocab_size", None),
            "max_seq_len": learned_positions(config),
            "n_experts": next((getattr(config, k) for k in ("num_local_experts", "num_experts", "n_routed_experts")
                               if isinstance(getattr(config, k, None), int)), None),
            "top_k": getattr(config, "num_experts_per_tok", None)}


def learned_positions(config: Any) -> int | None:
    """The size of a learned position table (GPT-2's n_positions, BERT's absolute
    embeddings): a hard limit on seq_len. Rotary and relative positions have none."""
    if isinstance(getattr(config, "n_positions", None), int):
        return config.n_positions
    absolute = getattr(config, "position_embedding_type", None) == "absolute"
    return getattr(config, "max_position_embeddings", None) if absolute else None


def _block_counts(og: OpGraph, config: Any, real: dict[str, int]) -> dict[str, int]:
    """Real depth per block group; the decoder stack of an encoder-decoder has its own."""
    main = next((real[k] for k in DEPTH_KEYS if k in real), 1)
    decoder = real.get("num_decoder_layers", main)
    counts = {}
    for group in og.meta["blocks"]:
        is_decoder = getattr(config, "is_encoder_decoder", False) and "decoder" in group["prefix"]
        counts[group["prefix"]] = decoder if is_decoder else main
    return counts


@contextmanager
def masks_as_in_a_real_run():
    """HF passes SDPA no mask (is_causal instead) for unpadded, unpacked sequences of equal
    query and key length, unless it is tracing, and it counts fake tensors as tracing: the
    trace would price a materialised mask that a real run of such sequences, the executor's
    included, never builds. Its two decisions are restated for that case (no padding mask,
    no sliding window; positions 0..s-1, so nothing packed) for the length of the trace."""
    try:
        import transformers.masking_utils as masking
    except ImportError:
        yield
        return
    names = ("_ignore_causal_mask_sdpa", "find_packed_sequence_indices")
    originals = {name: getattr(masking, name, None) for name in names}
    if None in originals.values():
        yield
        return

    def unpadded(padding_mask, q_length, kv_length, q_offset=0, kv_offset=0, local_attention_size=None):
        return padding_mask is None and local_attention_size is None and q_length in (1, kv_length)

    masking._ignore_causal_mask_sdpa = unpadded
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(masking, name, original)


def trace_hf(config: Any, *, seq_len: int, dtype: str = "bf16", batch: int = 1, name: str | None = None,
             depth: int = 2) -> OpGraph:
    """Trace an HF config's model at reduced depth; block_counts hold the real depth."""
    small, real = reduced_config(config, depth)
    small._attn_implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = build_hf_model(small, fake_mode, dtype)
    with fake_mode:
        inputs = {"input_ids": torch.zeros(batch, seq_len, dtype=torch.long)}
        if getattr(config, "is_encoder_decoder", False):
            inputs["decoder_input_ids"] = torch.zeros(batch, seq_len, dtype=torch.long)
    extra = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    with masks_as_in_a_real_run():
        og = trace_module(model, inputs, name=name or getattr(config, "model_type", "hf"), seq_len=seq_len,
                          dtype=dtype, fake_mode=fake_mode, call_kwargs=extra)
    og.meta.update(config_meta(config))
    og.block_counts = _block_counts(og, config, real)
    return og
