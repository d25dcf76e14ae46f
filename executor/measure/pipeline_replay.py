"""A pipeline rank's step on fake tensors, as torch's schedule runs it: its own chunks in the
order the schedule gives it (`pipeline_order`), each fed what the schedule would receive.

What a stage receives lives where torch keeps it. torch 2.13's `PipelineStage` allocates, when it
first runs, one input buffer per micro-batch on every stage but the first and one output-gradient
buffer per micro-batch on every stage but the last, and keeps them (pytorch/pytorch#136380); a
held micro-batch's input is its buffer, and the gradient a backward starts from is the buffer it
was received into. So the replay allocates them for every micro-batch of the plan's step, also
those it does not replay (`receive_micro_batches`), and feeds its chunks from them.
"""
from __future__ import annotations

import torch

from layout.plan import Plan


def replay_pipeline(run, plan: Plan, tokens: torch.Tensor, hidden: int, receive_micro_batches: int) -> None:
    """This rank's actions in torch's own schedule order, over `plan`'s micro-batches; FSDP2
    defers resharding and the reduction to the last backward, as the schedule sets it."""
    from executor.apply.materialize import lm_loss

    pp_rank = run.mesh.get_local_rank("pp")
    stages = {s.stage_index: s for s in _stages(run.schedule)}
    order = [a for a in run.schedule.pipeline_order[pp_rank] if a is not None]
    n = plan.num_micro_batches
    micro = tokens.chunk(n)
    inputs = {i: [_hidden_stand_in(micro[0], hidden, plan) for _ in range(receive_micro_batches)]
              for i, stage in stages.items() if not stage.is_first}
    grads = {i: [_hidden_stand_in(micro[0], hidden, plan, wants_grad=False) for _ in range(receive_micro_batches)]
             for i, stage in stages.items() if not stage.is_last}
    outputs: dict[tuple[int, int], tuple[torch.nn.Module, torch.Tensor]] = {}  # its parent kept for the trackers
    for stage in stages.values():
        _defer_fsdp(stage.submod, True)
    backwards_left = {i: n for i in stages}
    # Each stage runs its forwards, and its backwards, in micro-batch order: numbered here by
    # their turn, as torch's 1F1B order names its last rank's first forward micro-batch 1.
    turn = {(i, k): 0 for i in stages for k in ("F", "B")}
    for action in order:
        kind, index = action.computation_type.name, action.stage_index
        stage = stages[index]
        # a zero-bubble schedule's input-gradient backward (I) keeps the chunk's autograd graph for
        # its weight gradients (W: torch's stage_backward_input retains it), so the whole backward
        # runs here at W, where the chunk's activations free
        step = ("F" if kind in ("FORWARD", "F") else
                "B" if kind in ("FULL_BACKWARD", "B", "BACKWARD", "BACKWARD_WEIGHT", "W") else None)
        if step is None:
            continue
        mb, turn[(index, step)] = turn[(index, step)], turn[(index, step)] + 1
        if step == "F":
            x = micro[mb] if stage.is_first else inputs[index][mb]
            parent = MicroBatch(stage.submod)
            outputs[(index, mb)] = parent, parent(x)
            continue
        _, out = outputs.pop((index, mb))
        backwards_left[index] -= 1
        if backwards_left[index] == 0:
            _defer_fsdp(stage.submod, False)
        if stage.is_last:
            (lm_loss(out, micro[mb]) / n).backward()
        else:
            out.backward(_as_output(grads[index][mb], out))
        if not stage.is_first:  # sent back, then dropped, as torch's stage_backward does
            inputs[index][mb].grad = None


class MicroBatch(torch.nn.Module):
    """A fresh parent per micro-batch's forward: torch's trackers refuse a top-level module
    called again before its backward, which is what a pipeline schedule does."""

    def __init__(self, chunk: torch.nn.Module) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x):
        return self.chunk(x)


def _stages(schedule) -> list:
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def _hidden_stand_in(tokens: torch.Tensor, hidden: int, plan: Plan, wants_grad: bool = True) -> torch.Tensor:
    """A receive buffer: hidden states in the weights' dtype (the residual stream keeps it under
    autocast: fp32, or bf16 master weights'), an input as a leaf that wants its gradient; under SP
    the local sequence shard, which the stage wraps back into its sequence-sharded DTensor."""
    rows, seq = tokens.shape
    dtype = torch.bfloat16 if plan.master_dtype == "bf16" and plan.dtype != "fp32" else torch.float32
    return torch.zeros(rows, seq // plan.tp if plan.sp else seq, hidden, dtype=dtype, requires_grad=wants_grad)


def _as_output(buffer: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The received gradient as the stage's output is laid out (torch rebuilds a DTensor's
    gradient from its local buffer); a fresh one where the output is not the hidden states the
    buffer was shaped for."""
    from torch.distributed.tensor import DTensor

    local_shape = out.to_local().shape if isinstance(out, DTensor) else out.shape
    if buffer.numel() != local_shape.numel() or buffer.dtype != out.dtype:  # a stage output not of hidden states
        return torch.zeros_like(out)
    if isinstance(out, DTensor):
        return DTensor.from_local(buffer.view(local_shape), out.device_mesh, out.placements, shape=out.shape,
                                  stride=out.stride(), run_check=False)
    return buffer.view(local_shape)


def _defer_fsdp(module, defer: bool) -> None:
    if hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(not defer)
    if hasattr(module, "set_reshard_after_backward"):
        module.set_reshard_after_backward(not defer)
