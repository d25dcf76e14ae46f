"""Context parallelism: every sequence split over the cp ranks of a data-parallel group.

Each rank holds two of the sequence's 2*cp chunks, i and 2*cp-1-i, so that under the
causal mask every rank has the same attention work (the load balance Llama 3 uses).
Its queries attend to the whole sequence's keys and values, all-gathered over the
group before each attention (the all-gather form of Dubey et al. 2024, sec. 3.3.2;
the cost model prices this). torch's own `context_parallel` (ring attention) would be
the library to use, but in torch 2.13 it dispatches only the CUDA SDPA kernels: on CPU
it raises "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a
sharding strategy registered". The gather is torch's autograd functional all-gather,
whose backward reduce-scatters the keys' and values' gradients back to their owners.

The applier touches the model only through its extension points: HuggingFace's
attention-function registry (`config._attn_implementation`), the reference GPT's
`Attention.attend`, and the `position_ids` the executor's model wrappers pass on.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from layout.plan import Plan
from executor.runtime.mesh import dp_view

ATTENTION_NAME = "parallax_cp"


def cp_mesh(mesh: DeviceMesh, plan: Plan) -> DeviceMesh:
    """The cp dimension: the inner factor of the data-parallel dimension (dp x cp)."""
    return dp_view(mesh, (plan.dp, plan.cp), ("dp_only", "cp"))["cp"]


def chunk_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global token positions rank `rank` holds: chunks rank and 2*cp-1-rank of 2*cp."""
    size = seq_len // (2 * cp)
    first = torch.arange(rank * size, (rank + 1) * size)
    second = torch.arange((2 * cp - 1 - rank) * size, (2 * cp - rank) * size)
    return torch.cat([first, second])


def shard_sequence(tokens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This rank's tokens of [batch, seq] (dim 1 split into its two chunks)."""
    return tokens[:, chunk_index(tokens.shape[1], cp, rank)]


class GatheredAttention:
    """Causal attention of local queries over the all-gathered keys and values."""

    def __init__(self, group, cp: int, rank: int) -> None:
        self.group, self.cp, self.rank = group, cp, rank
        self._masks: dict[tuple[int, str], torch.Tensor] = {}

    def mask(self, local_len: int, device: torch.device) -> torch.Tensor:
        key = (local_len, str(device))
        if key not in self._masks:
            total = local_len * self.cp
            queries = chunk_index(total, self.cp, self.rank)
            keys = torch.cat([chunk_index(total, self.cp, r) for r in range(self.cp)])
            self._masks[key] = (queries[:, None] >= keys[None, :]).to(device)
        return self._masks[key]

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the whole sequence, in one collective: two would let autograd run
        their backward collectives in a different order on different ranks, which mismatches them."""
        from torch.distributed._functional_collectives import all_gather_single_autograd

        both = torch.stack([k, v]).contiguous()  # [2, b, kv_heads, s_local, d]
        gathered = all_gather_single_autograd(both, gather_dim=0, group=self.group)  # [cp*2, ...] in rank order
        keys, values = gathered.view(self.cp, 2, *both.shape[1:]).unbind(1)
        return (torch.cat(t.unbind(0), dim=2) for t in (keys, values))

    def __call__(self, q, k, v, scale: float | None = None, kv_groups: int = 1) -> torch.Tensor:
        """q [b, heads, s_local, d], k and v [b, kv_heads, s_local, d] -> [b, heads, s_local, d]."""
        keys, values = self.gather(k, v)
        if kv_groups > 1:
            keys, values = (t.repeat_interleave(kv_groups, dim=1) for t in (keys, values))
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask(q.shape[2], q.device), scale=scale)


def _hf_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """HuggingFace's attention-function contract: returns ([b, s, heads, d], None)."""
    attend: GatheredAttention = module.parallax_cp
    out = attend(query, key, value, scale=scaling, kv_groups=getattr(module, "num_key_value_groups", 1))
    return out.transpose(1, 2).contiguous(), None


def _register_hf() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _hf_attention)


def apply_context_parallel(module: nn.Module, mesh: DeviceMesh, plan: Plan) -> nn.Module:
    """Route every attention through the gathered form and feed the rank's positions; cp=1: no-op."""
    if plan.cp == 1:
        return module
    group_mesh = cp_mesh(mesh, plan)
    attend = GatheredAttention(group_mesh.get_group(), plan.cp, group_mesh.get_local_rank())
    module.position_ids = chunk_index(plan.seq_len, plan.cp, group_mesh.get_local_rank())
    hf = _hf_config(module)
    if hf is not None:
        _register_hf()
        hf._attn_implementation = ATTENTION_NAME
        for sub in module.modules():
            if hasattr(sub, "num_key_value_groups") or hasattr(sub, "q_proj"):
                sub.parallax_cp = attend
        return module
    for sub in module.modules():
        if hasattr(sub, "attend"):
            sub.attend = attend
    return module


def _hf_config(module: nn.Module):
    """The HF config whose attention registry routes the model's attention, if it has one."""
    hf = getattr(getattr(module, "model", None), "config", None)
    return hf if hf is not None and hasattr(hf, "_attn_implementation") else None


def cp_supported(module: nn.Module) -> bool:
    """Whether the model has an attention the applier can route (HF registry or `attend`)."""
    return _hf_config(module) is not None or any(hasattr(m, "attend") for m in module.modules())
