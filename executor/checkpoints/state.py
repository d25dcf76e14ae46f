"""What a checkpoint holds of one rank: model and optimizer state by name, and RNG states.

Each chunk and its optimizers go through `get_state_dict` with the optimizer state
flattened (`StateDictOptions(flatten_optimizer_state_dict=True)`): every entry is keyed by
the unsplit model's parameter name, so the union over chunks is one flat dict whose keys
do not depend on the layout. Loading builds the same dict for the new layout's chunks,
lets DCP fill it (resharding DTensors, reading replicated entries from whoever wrote them)
and hands each chunk its own keys back through `set_state_dict`.
"""
from __future__ import annotations

import random

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
OPTIM_PREFIXES = ("state.", "param_groups.")


def _aliased(flat: dict, groups: list[tuple[str, ...]]) -> dict:
    """`flat` plus each tied weight's entries under every name of its group (a pipeline
    stage holding only the LM head's copy then finds the state the embedding's name saved)."""
    out = dict(flat)
    for names in groups:
        for key, value in flat.items():
            for name in names:
                prefix = next((p for p in ("", *OPTIM_PREFIXES) if key == p + name or key.startswith(p + name + ".")), None)
                if prefix is None:
                    continue
                rest = key[len(prefix + name):]
                for other in names:
                    out.setdefault(prefix + other + rest, value)
    return out


def chunk_states(run, tied: list[tuple[str, ...]]) -> list[tuple[dict, dict]]:
    """Per chunk: its own flat state (model entries and its optimizers' flattened state, as
    `get_state_dict` gives them) and what DCP saves of it: tied weights' entries under every
    name, each expert under its own (executor/checkpoints/experts.py)."""
    from executor.checkpoints.experts import expert_rows, split_experts

    out = []
    for chunk, optimizers in zip(run.modules, run.optimizer.per_chunk):
        model, optim = get_state_dict(chunk, tuple(optimizers), options=OPTIONS)
        own = {**model, **optim}
        out.append((own, split_experts(_aliased(own, tied), expert_rows(chunk))))
    return out


def merged(states: list[tuple[dict, dict]]) -> dict:
    """The rank's whole state, as DCP saves and loads it."""
    out: dict = {}
    for _, saved in states:
        out.update(saved)
    return out


def load_chunks(run, states: list[tuple[dict, dict]], loaded: dict) -> None:
    """Hand each chunk its own entries through `set_state_dict`: those DCP filled in `loaded`,
    and the expert weights it filled in place through their views."""
    for chunk, optimizers, (own, _) in zip(run.modules, run.optimizer.per_chunk, states):
        model = {k: loaded.get(k, v) for k, v in own.items() if not k.startswith(OPTIM_PREFIXES)}
        optim = {k: loaded.get(k, v) for k, v in own.items() if k.startswith(OPTIM_PREFIXES)}
        set_state_dict(chunk, tuple(optimizers), model_state_dict=model, optim_state_dict=optim, options=OPTIONS)


def rng_states() -> dict:
    """Every random generator a step may draw from."""
    out = {"torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), "numpy_rng": np.random.get_state()}
    if torch.cuda.is_available():
        out["cuda_rng"] = torch.cuda.get_rng_state()
    return out


def restore_rng(extra: dict) -> None:
    torch.set_rng_state(extra["torch_rng"])
    if "python_rng" in extra:
        random.setstate(extra["python_rng"])
    if "numpy_rng" in extra:
        np.random.set_state(extra["numpy_rng"])
    if "cuda_rng" in extra and torch.cuda.is_available():
        torch.cuda.set_rng_state(extra["cuda_rng"])


def to_plain(value):
    """`value` in the types `torch.load(weights_only=True)` reads back (tensors, containers, numbers,
    strings): numpy arrays become tensors and numpy generators their state, each tagged so that
    `from_plain` rebuilds it. Why: a checkpoint must hold data a load cannot turn into code."""
    if isinstance(value, np.ndarray):
        return {_ARRAY: torch.from_numpy(value.astype(np.int64) if value.dtype == np.uint32 else value),
                "dtype": str(value.dtype)}
    if isinstance(value, np.random.RandomState):
        return {_GENERATOR: to_plain(value.get_state())}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {key: to_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_plain(item) for item in value)
    return value


def from_plain(value):
    """What `to_plain` stored, rebuilt."""
    if isinstance(value, dict) and _ARRAY in value:
        return value[_ARRAY].numpy().astype(value["dtype"])
    if isinstance(value, dict) and _GENERATOR in value:
        generator = np.random.RandomState()
        generator.set_state(from_plain(value[_GENERATOR]))
        return generator
    if isinstance(value, dict):
        return {key: from_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(from_plain(item) for item in value)
    return value


_ARRAY, _GENERATOR = "__numpy_array__", "__numpy_random_state__"


def layout_words(plan) -> str:
    """A layout as a resume message names it: "dp2 pp2 interleaved v2 zero1", "dp2 tp2+sp zero3"."""
    parts = [f"dp{plan.dp}"]
    parts += [f"ep{plan.ep}"] if plan.ep > 1 else []
    parts += [f"cp{plan.cp}"] if plan.cp > 1 else []
    parts += [f"tp{plan.tp}{'+sp' if plan.sp else ''}"] if plan.tp > 1 else []
    if plan.pp > 1:
        parts += [f"pp{plan.pp}", plan.schedule] + ([f"v{plan.vpp}"] if plan.vpp > 1 else [])
    parts.append(f"zero{plan.zero}")
    if plan.zero >= 2 and plan.dp_replicate > 1:
        parts.append(f"hsdp{plan.dp_replicate}x{plan.shard_degree}")
    return " ".join(parts)
