"""Tied weights across pipeline stages (GPT-2's word embedding and LM head).

One Parameter used by two layers becomes two copies once the pipeline cuts
the model between them, each on the rank that owns its layer. They start
equal (same seed); summing their gradients over the ranks that hold a copy,
before every optimizer step, keeps them equal and makes the update the one
the uncut model takes (Megatron keeps its embedding group the same way).
Under TP and FSDP both copies are split alike (dim 0 by vocabulary and by dp),
so the local gradient shards line up.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from layout.plan import Plan
from executor.runtime.compare import canonical_name
from executor.apply.layers import LayerMap


def tied_groups(module: nn.Module) -> list[tuple[str, ...]]:
    """Parameter names that share one Parameter, the canonical (first) name first."""
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [tuple(names) for names in by_id.values() if len(names) > 1]


def _layer_of(name: str, lmap: LayerMap) -> int:
    for layer in range(lmap.n_layers):
        if any(name == m or name.startswith(m + ".") for m in lmap.modules_of(layer)):
            return layer
    return 0


def _pp_rank_of(layer: int, plan: Plan) -> int:
    index = next(i for i, s in enumerate(plan.stages) if s.start <= layer < s.end)
    return plan.stage_rank(index)


class TiedGradients:
    """Sums each tied weight's gradient over the copies: those of this rank's chunks (a V
    schedule runs the first and last stage on one rank, each chunk its own copy) and those
    of the other pipeline ranks holding one."""

    def __init__(self, groups: list[tuple[str, ...]], lmap: LayerMap, plan: Plan, mesh: DeviceMesh,
                 modules: list[nn.Module]) -> None:
        """`modules`: this rank's fully wrapped chunks (their parameters no longer change)."""
        self.entries: list[tuple[list[nn.Parameter], object]] = []
        params = {canonical_name(n): p for m in modules for n, p in m.named_parameters()}
        ranks = mesh.mesh  # (pp, dp, tp) global ranks
        me = dist.get_rank()
        for names in groups:
            holders = sorted({_pp_rank_of(_layer_of(n, lmap), plan) for n in names})
            copies = list({id(params[n]): params[n] for n in names if n in params}.values())
            if len(holders) < 2:
                if len(copies) > 1:
                    self.entries.append((copies, None))
                continue
            for d in range(ranks.shape[1]):
                for t in range(ranks.shape[2]):
                    members = [int(ranks[p, d, t]) for p in holders]
                    group = dist.new_group(members)  # every rank creates every group, in one order
                    if me in members and copies:
                        self.entries.append((copies, group))

    @torch.no_grad()
    def sync(self) -> None:
        for copies, group in self.entries:
            grads = [p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad for p in copies if p.grad is not None]
            if not grads:
                continue
            total = grads[0]
            for grad in grads[1:]:
                total = total + grad
            if group is not None:
                dist.all_reduce(total, group=group)
            for grad in grads:
                if grad is not total:
                    grad.copy_(total)


def aliases(groups: list[tuple[str, ...]]) -> dict[str, str]:
    """alias name -> canonical name, for comparing and saving under the uncut model's names."""
    return {alias: names[0] for names in groups for alias in names[1:]}

