"""Built-in named models, stored as HuggingFace-style config dicts.

The configs are data (one JSON file per model next to this module) so that a
user can read, copy or add one without touching code. Each carries the generic
HF keys (hidden_size, num_hidden_layers, ...) that every `transformers` config
maps to its own names, plus the family-specific keys where the generic one is
not mapped (`n_inner` for GPT-2, `d_ff`/`d_kv` for T5), and a `_source`.
"""
from __future__ import annotations

import difflib
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from hardware.errors import ModelError
from hardware.untrusted import read_json

from planner.trace.models.config_checks import check_config

_DIR = Path(__file__).parent


def list_models() -> list[str]:
    """Names of the built-in models, sorted."""
    return sorted(path.stem for path in _DIR.glob("*.json"))


@lru_cache(maxsize=None)
def _load(name: str) -> dict[str, Any]:
    return json.loads((_DIR / f"{name}.json").read_text())


def model_config(name: str) -> dict[str, Any]:
    """The config dict of a model name: a built-in name, a path to a HuggingFace
    `config.json` or to a folder holding one, or a HuggingFace model id found in the
    local HF cache (never fetched: planning runs offline). A fresh copy: callers may edit it."""
    names = list_models()
    if name in names:
        return json.loads(json.dumps(_load(name)))
    path = _as_path(name)
    if path is not None and (path.is_dir() or path.is_file() or name.endswith(".json")):
        return _config_file(path / "config.json" if path.is_dir() else path)
    if _looks_like_hub_id(name):
        return _cached_hub_config(name)
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(names)}"
    raise ModelError("model", f"unknown model {name!r}",
                     f"{hint}; or give a config.json path, a folder holding one, or a cached HF id (org/name)")


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]{0,95}/[A-Za-z0-9][\w.\-]{0,95}$")


def _as_path(name: str) -> Path | None:
    """`name` as a filesystem path, or None where it cannot be one ("~nobody", a NUL byte)."""
    try:
        path = Path(name).expanduser()
        path.exists()
        return path
    except (RuntimeError, KeyError, OSError, ValueError):
        return None


def _looks_like_hub_id(name: str) -> bool:
    """org/name as the Hub spells repository ids (letters, digits, '-', '_', '.')."""
    return bool(_HUB_ID.match(name)) and ".." not in name


def _config_file(path: Path) -> dict[str, Any]:
    """A transformers config.json, checked to be one."""
    if not path.exists():
        raise ModelError("model", f"{path} does not exist",
                         "give a config.json path, a folder holding config.json, or a built-in name")
    data = read_json(path, "model", "model config", error=ModelError)
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ModelError("model_type", f"{path} has no model_type, so it is not a HuggingFace model config",
                         "a config.json written by transformers (save_pretrained), e.g. with model_type 'llama'")
    data.setdefault("_source", str(path))
    return check_config(data, str(path))


def _cached_hub_config(model_id: str) -> dict[str, Any]:
    """`model_id`'s config.json from the local HF cache, without touching the network."""
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers brings huggingface_hub
        raise ModelError("model", f"{model_id!r} looks like a HuggingFace id, but huggingface_hub is not installed",
                         "pip install 'parallax[hf]' or give a config.json path") from None
    try:
        found = try_to_load_from_cache(model_id, "config.json")
    except ValueError as error:  # huggingface_hub's id validation (HFValidationError)
        raise ModelError("model", f"{model_id!r} is not a valid HuggingFace id: {error}",
                         "write org/name, or give a config.json path") from None
    if not isinstance(found, str):
        raise ModelError("model", f"{model_id!r} is not in the local HF cache ({constants.HF_HUB_CACHE}); "
                                  "planning runs offline",
                         f"download it first (huggingface-cli download {model_id} config.json) "
                         "or give a config.json path")
    return _config_file(Path(found))


def hf_config(name_or_dict: str | dict[str, Any]):
    """A `transformers` config object for a built-in name or an HF-style dict.

    transformers is an optional extra, so it is imported here and only here.
    """
    cfg = model_config(name_or_dict) if isinstance(name_or_dict, str) else dict(name_or_dict)
    try:
        from transformers import AutoConfig
    except ImportError as error:  # pragma: no cover - depends on the install
        raise ModelError("model", "HuggingFace configs need the `transformers` package",
                         "pip install 'parallax[hf]'") from error
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise ModelError("model_type", "the config dict has no model_type", "e.g. 'llama', 'gpt2', 't5'")
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    try:
        return AutoConfig.for_model(model_type, **cfg)
    except (ValueError, KeyError) as error:
        raise ModelError("model_type", str(error).splitlines()[0], "a model_type that transformers knows") from error
    except Exception as error:  # noqa: BLE001 - transformers' own field checks (a null size, a wrong type)
        first = (str(error).strip().splitlines() or [type(error).__name__])[-1][:200]
        raise ModelError("model", f"transformers refuses the config: {first}",
                         "a config.json written by transformers (save_pretrained)") from None


def family(cfg: dict[str, Any]) -> str:
    """The architecture family: what the param count and the tracer dispatch on."""
    return str(cfg.get("model_type", "?"))


def _dims(cfg: dict[str, Any]) -> tuple[int, int, int, int, int, int]:
    """(hidden, layers, heads, kv_heads, ffn, vocab), from generic or family keys."""
    h = cfg.get("hidden_size") or cfg.get("n_embd") or cfg.get("d_model")
    layers = cfg.get("num_hidden_layers") or cfg.get("n_layer") or cfg.get("num_layers")
    heads = cfg.get("num_attention_heads") or cfg.get("n_head") or cfg.get("num_heads")
    kv = cfg.get("num_key_value_heads") or heads
    ffn = cfg.get("intermediate_size") or cfg.get("n_inner") or cfg.get("d_ff") or 4 * h
    return h, layers, heads, kv, ffn, cfg["vocab_size"]


def param_count(cfg: dict[str, Any]) -> int:
    """Parameters of the model a config describes, counted analytically.

    Matches what `transformers` instantiates for the config's architecture
    (GPT-2 with tied head; Llama/Mistral gated MLP and GQA; BERT with its MLM
    head; T5 encoder-decoder); a sanity check for the traced count.
    """
    h, L, heads, kv, f, V = _dims(cfg)
    kind = family(cfg)
    tied = cfg.get("tie_word_embeddings", kind != "reference-gpt")
    if kind == "gpt2":
        block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        return V * h + cfg.get("max_position_embeddings", 1024) * h + L * block + 2 * h + (0 if tied else V * h)
    if kind == "t5":
        inner = heads * cfg.get("d_kv", h // heads)
        gated = str(cfg.get("feed_forward_proj", "relu")).startswith("gated")
        mlp = (3 if gated else 2) * h * f
        enc = 4 * h * inner + mlp + 2 * h
        dec = 8 * h * inner + mlp + 3 * h
        buckets = cfg.get("relative_attention_num_buckets", 32) * heads
        n_dec = cfg.get("num_decoder_layers") or L
        return V * h + L * enc + n_dec * dec + 2 * buckets + 2 * h + (0 if tied else V * h)
    if kind == "bert":
        emb = (V + cfg.get("max_position_embeddings", 512) + cfg.get("type_vocab_size", 2)) * h + 2 * h
        block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
        mlm_head = h * h + h + 2 * h + V  # transform dense + LayerNorm + decoder bias (weight tied)
        return emb + L * block + mlm_head
    if kind == "reference-gpt":  # planner/trace/models/reference_gpt.py: biased q/k/v/o and MLP, two LayerNorms
        block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
        return (V + cfg.get("max_position_embeddings", 2048)) * h + L * block + 2 * h + (0 if tied else V * h)
    hd = h // heads  # Llama / Mistral and other gated-MLP decoders; Mixtral: every expert's MLP and a router
    experts = cfg.get("num_local_experts") or 1
    router = h * experts if experts > 1 else 0
    block = h * heads * hd + 2 * h * kv * hd + heads * hd * h + experts * 3 * h * f + router + 2 * h
    return V * h + L * block + h + (0 if tied else V * h)


def summary(name: str) -> dict[str, Any]:
    """One row of `parallax models`."""
    cfg = model_config(name)
    h, L, heads, kv, _, _ = _dims(cfg)
    if family(cfg) == "t5":
        L = L + (cfg.get("num_decoder_layers") or L)
    return {"name": name, "family": family(cfg), "layers": L, "hidden": h, "heads": heads,
            "kv_heads": kv, "params_b": param_count(cfg) / 1e9}
