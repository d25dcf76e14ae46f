"""Activation checkpointing per layer, as the plan's recompute policies say
(`layout.axes.RECOMPUTE_MEANS`, what the cost model prices).

"full": the composable `checkpoint` keeps parameter names intact (unlike a
wrapper module), so FSDP, pipeline cuts and comparisons see the same names.

"selective" is Megatron's: only the attention core is recomputed. Inside the
layer, each `scaled_dot_product_attention` call that torch will run on its math
path (scores materialised, softmaxed and saved) runs under `checkpoint`, so its
s x s intermediates are dropped and rebuilt in the backward; a call torch runs
with a fused kernel (flash, memory-efficient, cuDNN, the CPU's flash loop) keeps
no scores and runs as it is, so there selective keeps what none keeps, as priced
(costmodel/compute.py and memory.py drop `act_attention_scores` only).
Torch's selective activation checkpointing (an op policy) is not used for it:
it caches the output of every op it is told to save, needed by the backward or
not, which holds more than no checkpointing at all.

"op" is that op policy, as torchtitan's selective checkpointing runs it: the
layer's forward runs under `checkpoint` with `create_selective_checkpoint_contexts`,
saving the outputs of its attention kernels, of every other matrix multiply and
of SP's reduce-scatters (`SAVED_OPS`), and recomputing the rest (norms,
activations, casts, rotary, the other multiplies and collectives) in the
backward from them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as checkpoint_call

from layout.plan import Plan
from executor.apply.layers import LayerMap, get_or_none


def recompute_by_layer(plan: Plan) -> dict[int, str]:
    """Expanded layer index -> recompute policy."""
    return {stage.start + i: policy for stage in plan.stages for i, policy in enumerate(stage.recompute)}


def apply_recompute(module: nn.Module, mesh: DeviceMesh, plan: Plan, lmap: LayerMap) -> nn.Module:
    """Checkpoint every layer whose policy is not "none" (layers this chunk dropped are skipped)."""
    for layer, policy in recompute_by_layer(plan).items():
        if policy == "none":
            continue
        for name in lmap.modules_of(layer):
            sub = get_or_none(module, name)
            if sub is None or not any(True for _ in sub.parameters()):
                continue
            if policy == "full":
                checkpoint(sub, use_reentrant=False)
            elif policy == "op":
                keep_products(sub)
            else:
                recompute_attention_core(sub)
    return module


# the ops whose outputs "op" keeps, as torchtitan's selective checkpointing: the attention kernels,
# batched and biased products, SP's reduce-scatters, and every odd-numbered plain multiply (`aten.mm`,
# counted in forward order: every second one is recomputed)
SAVED_OP_NAMES = ("addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                  "_scaled_dot_product_flash_attention_for_cpu")
SAVED_OPS = frozenset([getattr(torch.ops.aten, name).default for name in SAVED_OP_NAMES
                       if hasattr(torch.ops.aten, name)] + [torch.ops._c10d_functional.reduce_scatter_tensor.default])
MULTIPLY = torch.ops.aten.mm.default


def keep_products(sub: nn.Module) -> None:
    """`sub.forward` runs checkpointed under the op policy. Its forward, not the module call: the
    policy replays every op of the region in the backward, and FSDP2's hooks around the call
    (their profiler ranges) must stay outside it."""
    forward = sub.forward

    def checkpointed(*args, **kwargs):
        return checkpoint_call(forward, *args, use_reentrant=False, context_fn=_save_products, **kwargs)

    sub.forward = checkpointed


def _save_products():
    """A region's policy: its own count of the multiplies it has seen, the forward's and the
    recompute's apart. torch 2.13 replays the forward's decisions without asking again, but
    torch before it asks the policy during the recompute too, and one shared count would
    then look up a saved product under the wrong index."""
    multiplies = {False: 0, True: 0}  # by ctx.is_recompute

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op is MULTIPLY:
            multiplies[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if multiplies[ctx.is_recompute] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def recompute_attention_core(sub: nn.Module) -> None:
    """While `sub` runs its forward, its math-path attention calls run checkpointed."""
    mode = _MathAttentionCheckpointed()

    def enter(*_) -> None:  # a pre-hook's return value would replace the forward's arguments
        mode.__enter__()

    def leave(*_) -> None:
        mode.__exit__(None, None, None)

    sub.register_forward_pre_hook(enter)
    sub.register_forward_hook(leave, always_call=True)


class _MathAttentionCheckpointed(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and runs_on_math_path(*args, **kwargs):
            return checkpoint_call(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)


def runs_on_math_path(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False) -> bool:
    """Whether torch's dispatcher sends this call to the math path, asked with stand-ins of the
    same shapes, dtypes and device (each one row of storage, expanded): its choice reads those
    alone, and a stand-in is real where the arguments are fake (the dry run) or distributed."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        stand_ins = [_stand_in(t) for t in (query, key, value, attn_mask)]
        choice = torch._fused_sdp_choice(*stand_ins, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return SDPBackend(choice) == SDPBackend.MATH


def _stand_in(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None:
        return None
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    row = torch.empty(local.shape[-1], dtype=local.dtype, device=local.device.type)
    return row.expand(local.shape)
