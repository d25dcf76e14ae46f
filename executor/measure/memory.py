"""Per-rank peak memory: CUDA allocator statistics, or live tensor bytes on CPU.

On CPU there is no allocator to ask, so a dispatch mode counts the bytes of
every tensor storage that an op creates and subtracts them when the storage is
freed; parameters that existed before are registered up front. It sees
parameters, gradients, optimizer states and saved activations alike.

Two things keep the count honest under DTensor and FSDP2:
- a DTensor (TP- or FSDP-sharded parameter, wrapped in nn.Parameter or not)
  is counted by its local shard, never by its global size;
- FSDP2 frees and re-allocates unsharded parameters by resizing their storage
  in place (`untyped_storage().resize_(0)`), which no dispatch mode sees and
  which never finalises the storage; while measuring, storage resizes are
  intercepted and the count follows each storage's current size.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


def _local(tensor: torch.Tensor) -> torch.Tensor | None:
    inner = getattr(tensor, "_local_tensor", None)  # DTensor, also as nn.Parameter
    if isinstance(inner, torch.Tensor):
        return _local(inner)
    if type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter:
        return tensor
    return None


class LiveBytes(TorchDispatchMode):
    """Counts live storage bytes created inside the mode, plus registered tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen = WeakIdKeyDictionary()  # storage -> [current bytes]
        self._resize = None

    def track(self, tensor: torch.Tensor) -> None:
        local = _local(tensor)
        if local is None or local.device.type == "meta":
            return
        self._track_storage(local.untyped_storage())

    def _track_storage(self, storage) -> None:
        if storage in self._seen:
            return
        cell = [storage.nbytes()]
        self._seen[storage] = cell
        self._add(cell[0])
        weakref.finalize(storage, self._free, cell)

    def _add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _free(self, cell: list[int]) -> None:
        self.live -= cell[0]

    def _resized(self, storage, before: int) -> None:
        cell = self._seen.get(storage)
        if cell is None:
            if storage.nbytes() > before:  # grown while measuring: memory of this run
                self._track_storage(storage)
            return
        after = storage.nbytes()
        self._add(after - cell[0])
        cell[0] = after

    def __enter__(self):
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            before = storage.nbytes()
            out = original(storage, size)
            if storage.device.type != "meta":
                tracker._resized(storage, before)
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        if self._resize is not None:
            torch.UntypedStorage.resize_ = self._resize
            self._resize = None
        return super().__exit__(*exc)

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
        """On a CPU the tracked steps run eagerly, even on the compile stack: dynamo does not
        compile under a dispatch mode (and a frame first met there is never compiled), and
        inductor's kernels allocate out of the mode's sight. The allocator counts a GPU's."""
        import contextlib

        if self.cpu is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.compiler.set_stance("force_eager"))
        stack.enter_context(self.cpu)
        return stack

    @property
    def peak_bytes(self) -> int:
        if self.cpu is not None:
            return int(self.cpu.peak)
        return int(torch.cuda.max_memory_allocated(self.device))

    @property
    def reserved_bytes(self) -> int:
        """What the caching allocator held at most (`max_memory_reserved`): the figure a GPU runs
        out of. A CPU has no caching allocator: there it is the tensors' peak."""
        if self.cpu is not None:
            return int(self.cpu.peak)
        return int(torch.cuda.max_memory_reserved(self.device))


class DoesNotFit(RuntimeError):
    """A rank's memory ran out, or its first step peaked above the device's: the run stops, and
    the launcher names the rank (executor.runtime.launch.first_failure)."""


def check_fits(memory: PeakMemory, limit: float | None, step: int) -> None:
    """After the first step: the rank's peak against its device's memory."""
    if limit is not None and memory.peak_bytes > limit:
        raise DoesNotFit(f"{memory.peak_bytes / 2**20:,.1f} MiB peaked in step {step} (the run's first), more than "
                         f"the device's {limit / 2**20:,.1f} MiB")


def out_of_memory(error: Exception, phase: str, step: int) -> DoesNotFit:
    """A device's out-of-memory error as the run's one line: where it happened."""
    first = " ".join(str(error).split())[:160]
    return DoesNotFit(f"out of memory in the {phase} of step {step}: {first}")
