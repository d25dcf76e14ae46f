"""Refuse a plan that cannot run on a model before any process starts.

What the executor can run is declared once, in the rulebook (`layout.rules`);
this module only reads the model's facts off the nn.Module and asks it.
"""
from __future__ import annotations

from torch import nn

from layout.plan import Plan
from hardware.errors import PlanError
from layout.plan import check_plan_runs
from layout.rules import ModelFacts, check_world
from planner.executable import tp_split_classes

from executor.apply.context_parallel import cp_supported
from executor.apply.layers import LayerMap, layer_map


def validate(plan: Plan, model: nn.Module, world_size: int | None = None) -> None:
    """Raise PlanError naming the field when `plan` does not fit `model` or the launch."""
    lmap = layer_map(model)
    n = lmap.n_layers
    if world_size is not None:
        check_world(plan, world_size, "processes requested", f"use --nproc {plan.n_gpus}")
    check_plan_runs(plan, model_facts(model, lmap))
    if plan.stages[-1].end != n:
        raise PlanError("stages", f"last stage ends at {plan.stages[-1].end} but the model has {n} layers "
                        f"(embedding + {n - 2} blocks + head)", f"end the last stage at {n}")


def model_facts(model: nn.Module, lmap: LayerMap | None = None) -> ModelFacts:
    """The declaration's facts, read off the module tree."""
    lmap = lmap or layer_map(model)
    return ModelFacts(n_blocks=lmap.n_layers - 2, heads=lmap.heads, kv_heads=lmap.kv_heads,
                      tp_splittable=_blocks_hold_splittable(model, lmap), max_seq_len=_max_positions(model),
                      vocab=_vocab(model), name=type(getattr(model, "model", model)).__name__,
                      cp_routable=cp_supported(model), n_experts=_n_experts(model))


def _blocks_hold_splittable(model: nn.Module, lmap: LayerMap) -> bool:
    block = model.get_submodule(lmap.block_names[0])
    return any(isinstance(m, tp_split_classes()) for m in block.modules())


def _vocab(model: nn.Module) -> int | None:
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return embedding.num_embeddings if embedding is not None else None


def _max_positions(model: nn.Module) -> int | None:
    """A learned position table's size (see planner.trace.hf.learned_positions)."""
    cfg = getattr(model, "cfg", None)
    if isinstance(getattr(cfg, "max_seq_len", None), int):
        return cfg.max_seq_len
    config = getattr(getattr(model, "model", None), "config", None)
    if config is None:
        return None
    from planner.trace.hf import learned_positions

    return learned_positions(config)


def _n_experts(model: nn.Module) -> int:
    from executor.apply.expert_parallel import is_experts

    return max((m.num_experts for m in model.modules() if is_experts(m)), default=0)

