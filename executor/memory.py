"""Per-rank peak memory: CUDA allocator statistics, or live tensor bytes on CPU.

On CPU there is no allocator to ask, so a dispatch mode counts the bytes of
every tensor storage that an op creates and subtracts them when the storage is
freed; parameters that existed before are registered up front. It sees
parameters, gradients, optimizer states and saved activations alike.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


def _local(tensor: torch.Tensor) -> torch.Tensor | None:
    if type(tensor) is torch.Tensor or isinstance(tensor, torch.nn.Parameter):
        return tensor
    inner = getattr(tensor, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else None


class LiveBytes(TorchDispatchMode):
    """Counts live storage bytes created inside the mode, plus registered tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen = WeakIdKeyDictionary()

    def track(self, tensor: torch.Tensor) -> None:
        local = _local(tensor)
        if local is None or local.device.type == "meta":
            return
        storage = local.untyped_storage()
        if storage in self._seen:
            return
        size = storage.nbytes()
        self._seen[storage] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, size)

    def _free(self, size: int) -> None:
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)
        return out


class PeakMemory:
    """One interface for both devices: `with tracker.measure(): ...`, then `tracker.peak_bytes`."""

    def __init__(self, device: torch.device, tensors=()) -> None:
        self.device = device
        self.cpu = LiveBytes() if device.type == "cpu" else None
        if self.cpu is not None:
            for tensor in tensors:
                self.cpu.track(tensor)
        else:
            torch.cuda.reset_peak_memory_stats(device)

    def measure(self):
        import contextlib

        return self.cpu if self.cpu is not None else contextlib.nullcontext()

    @property
    def peak_bytes(self) -> int:
        if self.cpu is not None:
            return int(self.cpu.peak)
        return int(torch.cuda.max_memory_allocated(self.device))
