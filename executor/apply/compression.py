"""Gradient compression as DDP communication hooks (ZeRO 0, tp 1).

- int8: per-chunk-scaled 8-bit quantisation with error feedback, run as an
  all-to-all of int8 chunks (the reduce-scatter half: each rank dequantises
  and averages the chunk it owns, adds its own residual of that chunk and
  requantises it) then an all-gather of the int8 result: 1 byte per element
  on the wire each way, the all-reduce volume of 1-byte values. Rounding is to
  nearest, or stochastic (`stochastic_rounding`) from a per-rank generator.
  Scales: one fp32 scale per chunk of a bucket (dp per bucket).
- topk: the k = ceil(fraction * N) largest-magnitude entries of (gradient +
  residual) per bucket, sent as values and int32 indices with all-gather;
  every rank scatter-adds the dp payloads. What was not sent stays in the
  residual (error feedback) and is added to the next step's gradient.
- fp16: torch's `fp16_compress_hook`; bf16: a small hook of our own (torch's
  `bf16_compress_hook` needs CUDA + NCCL), gloo reduces bf16 sums.
- powersgd: torch's `powerSGD_hook` (rank `powersgd_rank`, error feedback,
  compression from the 3rd step so DDP's bucket rebuild is done).

Residuals are kept per parameter (by name), not per bucket, so they survive
DDP's bucket rebuild after the first step; the int8 owner-side residual is
kept per bucket composition. Every hook counts the bytes this rank sends
(ring algorithms), which is `costmodel.compression.wire_bytes_per_rank`.

FSDP2 (ZeRO 2/3) reduce-scatters inside its own hooks and the per-weight all-reduce
(executor/apply/gradient_reduce.py, used for tp > 1) has no comm hooks: compression with
those raises PlanError.

The options (k, PowerSGD's rank, stochastic rounding) are the plan's fields;
the run's seed (the worker's --seed) seeds the rounding and PowerSGD.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from costmodel.compression import METHODS
from layout.plan import DEFAULT_POWERSGD_RANK, DEFAULT_TOPK_FRACTION, Plan
from hardware.errors import PlanError

INT8_MAX = 127


@dataclass
class CompressionConfig:
    topk_fraction: float = DEFAULT_TOPK_FRACTION
    stochastic_rounding: bool = False
    powersgd_rank: int = DEFAULT_POWERSGD_RANK
    seed: int = 0

    @classmethod
    def from_plan(cls, plan: Plan, seed: int = 0) -> "CompressionConfig":
        """The plan's compression options and the run's seed."""
        return cls(topk_fraction=plan.topk_fraction, stochastic_rounding=plan.stochastic_rounding,
                   powersgd_rank=plan.powersgd_rank, seed=seed)


def check_compression(plan: Plan) -> None:
    """Refuse what the hooks cannot do, before any process starts."""
    if plan.compression not in METHODS:
        raise PlanError("compression", f"unknown method {plan.compression!r}", f"use one of {', '.join(METHODS)}")
    if plan.compression == "none" or plan.data_parallel == 1:
        return
    if plan.zero >= 1:
        raise PlanError("compression", f"{plan.compression} compression runs as DDP communication hooks; "
                        f"zero={plan.zero} shards with ZeRO-1's rows or FSDP2, whose reductions are not hookable here",
                        "use zero 0 with compression, or compression none with ZeRO")
    if plan.tp > 1:
        raise PlanError("compression", "with tp > 1 data parallelism runs as a per-weight all-reduce, which has no comm hooks",
                        "use tp 1 with compression, or compression none")


# ---------------------------------------------------------------- pure pieces

def quantize_int8(x: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `x` ([chunks, m]) to int8 with one fp32 scale per row: max|row| / 127."""
    scale = x.abs().amax(dim=-1, keepdim=True).float() / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = x.float() / scale
    if generator is not None:
        y = torch.floor(y + torch.rand(y.shape, generator=generator, dtype=y.dtype).to(y.device))
    else:
        y = torch.round(y)
    return y.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale.squeeze(-1)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.unsqueeze(-1)


def topk_count(numel: int, fraction: float) -> int:
    return max(1, min(numel, math.ceil(fraction * numel)))


def topk_select(x: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Values and int32 indices of the largest-magnitude entries of flat `x` (ties: lowest index first)."""
    k = topk_count(x.numel(), fraction)
    if k == x.numel():
        idx = torch.arange(x.numel(), device=x.device)
    else:
        idx = torch.topk(x.abs(), k, sorted=False).indices.sort().values
    return x[idx], idx.to(torch.int32)


# ---------------------------------------------------------------- hook state

class CompressionState:
    """Per-DDP-module state: residuals, generator, and the bytes this rank sent."""

    def __init__(self, method: str, group: dist.ProcessGroup | None, names: dict[int, str], config: CompressionConfig) -> None:
        self.method = method
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.names = names  # id(param) -> name
        self.config = config
        self.residual: dict[str, torch.Tensor] = {}  # worker-side error feedback, per parameter
        self.owner_residual: dict[tuple, torch.Tensor] = {}  # int8: residual of the chunk this rank requantises
        self.generator = None
        if config.stochastic_rounding:
            self.generator = torch.Generator().manual_seed(config.seed * 1_000_003 + dist.get_rank())
        self.bytes_sent = 0
        self.powersgd = None

    # residuals by parameter, flattened in bucket order
    def _keys(self, params) -> list[str]:
        return [self.names.get(id(p), str(i)) for i, p in enumerate(params)]

    def take_residual(self, params, like: torch.Tensor) -> torch.Tensor:
        parts = [self.residual.get(k) for k in self._keys(params)]
        if all(p is None for p in parts):
            return torch.zeros_like(like)
        flat = [p if p is not None else torch.zeros(q.numel(), dtype=like.dtype, device=like.device)
                for p, q in zip(parts, params)]
        return torch.cat(flat)

    def keep_residual(self, params, flat: torch.Tensor) -> None:
        offset = 0
        for key, p in zip(self._keys(params), params):
            n = p.numel()
            self.residual[key] = flat[offset:offset + n].clone()
            offset += n

    def state_dict(self) -> dict:
        out = {"residual": dict(self.residual), "owner_residual": {"|".join(k): v for k, v in self.owner_residual.items()},
               "bytes_sent": self.bytes_sent}
        if self.generator is not None:
            out["generator"] = self.generator.get_state()
        if self.powersgd is not None:
            out["powersgd"] = self.powersgd.__getstate__()
        return out

    def load_state_dict(self, state: dict) -> None:
        self.residual = dict(state.get("residual", {}))
        self.owner_residual = {tuple(k.split("|")): v for k, v in state.get("owner_residual", {}).items()}
        if self.generator is not None and "generator" in state:
            self.generator.set_state(state["generator"])
        if self.powersgd is not None and "powersgd" in state:
            self.powersgd.__setstate__(state["powersgd"])
            self.powersgd.process_group = self.group


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def _ring_allreduce_bytes(n: int, nbytes: int) -> int:
    return int(2 * (n - 1) * nbytes / n)


# ---------------------------------------------------------------- reductions on flat buffers

def int8_allreduce(state: CompressionState, flat: torch.Tensor, params) -> torch.Tensor:
    """Mean over the group of `flat` through int8 on the wire, with error feedback."""
    n, length = state.world, flat.numel()
    corrected = flat.float() + state.take_residual(params, flat).float()
    m = math.ceil(length / n)
    dev = flat.device
    padded = torch.zeros(n * m, device=dev)
    padded[:length] = corrected
    q, scale = quantize_int8(padded.view(n, m), state.generator)
    state.keep_residual(params, (padded - dequantize_int8(q, scale).flatten())[:length].to(flat.dtype))
    # reduce-scatter half: chunk j goes to rank j
    q_in, scale_in = torch.empty_like(q), torch.empty_like(scale)
    dist.all_to_all_single(q_in, q, group=state.group)
    dist.all_to_all_single(scale_in, scale, group=state.group)
    mine = torch.zeros(m, device=dev)
    for i in range(n):  # fixed order: deterministic sums
        mine += q_in[i].float() * scale_in[i]
    mine /= n
    key = tuple(state._keys(params))
    owner = state.owner_residual.get(key)
    if owner is not None and owner.numel() == m:
        mine += owner
    q_mine, s_mine = quantize_int8(mine.view(1, m), state.generator)
    state.owner_residual[key] = mine - dequantize_int8(q_mine, s_mine).flatten()
    # all-gather half
    q_all, s_all = torch.empty(n * m, dtype=torch.int8, device=dev), torch.empty(n, device=dev)
    dist.all_gather_into_tensor(q_all, q_mine.flatten(), group=state.group)
    dist.all_gather_into_tensor(s_all, s_mine, group=state.group)
    q_all = q_all.view(n, m)
    state.bytes_sent += 2 * (n - 1) * m + 2 * (n - 1) * 4  # int8 chunks + fp32 scales, both halves
    return dequantize_int8(q_all, s_all).flatten()[:length].to(flat.dtype)


def topk_allreduce(state: CompressionState, flat: torch.Tensor, params) -> torch.Tensor:
    """Mean over the group of the Top-K of each rank's (gradient + residual), all-gathered."""
    n = state.world
    corrected = flat + state.take_residual(params, flat)
    values, idx = topk_select(corrected, state.config.topk_fraction)
    left = corrected.clone()
    left[idx.long()] = 0
    state.keep_residual(params, left)
    k = values.numel()
    all_values = torch.empty(n * k, dtype=values.dtype, device=flat.device)
    all_idx = torch.empty(n * k, dtype=torch.int32, device=flat.device)
    dist.all_gather_into_tensor(all_values, values.contiguous(), group=state.group)
    dist.all_gather_into_tensor(all_idx, idx.contiguous(), group=state.group)
    state.bytes_sent += (n - 1) * k * (values.element_size() + 4)
    out = torch.zeros_like(flat)
    for i in range(n):  # fixed order: deterministic sums
        out.index_add_(0, all_idx[i * k:(i + 1) * k].long(), all_values[i * k:(i + 1) * k])
    return out / n


def bf16_allreduce(state: CompressionState, flat: torch.Tensor, params=None) -> torch.Tensor:
    low = (flat / state.world).to(torch.bfloat16)
    dist.all_reduce(low, group=state.group)
    state.bytes_sent += _ring_allreduce_bytes(state.world, low.numel() * 2)
    return low.to(flat.dtype)


# ---------------------------------------------------------------- DDP hooks

def _flat_hook(reduce):
    def hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        buffer.copy_(reduce(state, buffer, bucket.parameters()))
        return _done(buffer)
    return hook


def _fp16_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    state.bytes_sent += _ring_allreduce_bytes(state.world, bucket.buffer().numel() * 2)
    return fp16_compress_hook(state.group, bucket)


def _powersgd_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress, powerSGD_hook

    ps = state.powersgd
    size = bucket.buffer().element_size()
    if ps.iter < ps.start_powerSGD_iter:
        elems = bucket.buffer().numel()
    else:
        elems = 0
        for g in bucket.gradients():
            if g.ndim > 1 and _should_compress(g.shape[0], g.numel() // g.shape[0], ps.matrix_approximation_rank,
                                               ps.min_compression_rate)[0]:
                elems += (g.shape[0] + g.numel() // g.shape[0]) * ps.matrix_approximation_rank
            else:
                elems += g.numel()
    state.bytes_sent += _ring_allreduce_bytes(state.world, elems * size)
    # Wait here: PowerSGD chains its collectives in future callbacks, and with several buckets
    # gloo would see them issued in different orders on different ranks (a collective mismatch).
    return _done(powerSGD_hook(ps, bucket).wait())


HOOKS = {"int8": _flat_hook(int8_allreduce), "topk": _flat_hook(topk_allreduce), "bf16": _flat_hook(bf16_allreduce),
         "fp16": _fp16_hook, "powersgd": _powersgd_hook}


def register_compression(ddp: nn.Module, plan: Plan, group: dist.ProcessGroup | None,
                         seed: int = 0) -> CompressionState | None:
    """Register `plan.compression`'s hook on a DDP module, with the plan's options and the run's
    `seed`; the state is kept as `ddp.parallax_compression`."""
    check_compression(plan)
    if plan.compression == "none" or plan.data_parallel == 1:
        return None
    config = CompressionConfig.from_plan(plan, seed)
    module = getattr(ddp, "module", ddp)
    names = {id(p): name for name, p in module.named_parameters()}
    state = CompressionState(plan.compression, group, names, config)
    if plan.compression == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        state.powersgd = PowerSGDState(process_group=group, matrix_approximation_rank=config.powersgd_rank,
                                       start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
                                       random_seed=config.seed)
    ddp.register_comm_hook(state, HOOKS[plan.compression])
    ddp.parallax_compression = state
    return state


def compression_states(modules) -> list[CompressionState]:
    return [m.parallax_compression for m in modules if getattr(m, "parallax_compression", None) is not None]
