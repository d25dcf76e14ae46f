"""torch's memory trackers, read in the cost model's categories.

`torch.distributed._tools` is private and versioned with torch (pinned here to
2.13.0); tests/test_dry_run.py pins the behaviour this module relies on: the
category names below and the `_update_peak_stats` call after every op.

The trackers keep one snapshot at the step's peak. The cost model prices each
category at its own high-water mark (weights, gradients and optimizer state
peak together; activations, buffers and temporaries at their worst moment), so
`CategoryPeaks` also records every category's own maximum.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule

# tracker category -> cost model category (costmodel.memory / estimate.rank_memory)
CATEGORY = {
    "Sharded Param": "weights", "Parameter": "weights",
    "Sharded Grad": "gradients", "Gradient": "gradients",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Unsharded Param": "buffers", "Unsharded Grad": "buffers", "All Gather": "buffers",
    "Reduce Scatter": "buffers", "Buffer": "buffers",
    "Activation": "activations", "Temp": "activations", "Inputs": "activations", "Other": "activations",
}
TOTAL = "Total"


OFFLOADED = ("weights", "gradients", "optimizer")  # what FSDP2's CPUOffloadPolicy keeps on the host: the shards


class CategoryPeaks:
    """The step's device peak and each cost-model category's own maximum, in bytes. The
    categories in `host` (an offloaded plan's sharded states) are the host's: the fake tensors
    share one memory, so they are counted apart, as "host", and never in the device peak."""

    def __init__(self, host: tuple[str, ...] = ()) -> None:
        self.host = host
        self.peak = 0.0
        self.categories: dict[str, float] = {}
        self.at_peak: dict[str, float] = {}

    def record(self, snapshot: dict) -> None:
        for device_snapshot in snapshot.values():
            grouped: dict[str, float] = {}
            for key, nbytes in device_snapshot.items():
                name = getattr(key, "value", key)
                if name == TOTAL:
                    continue
                target = CATEGORY.get(name, "activations")
                target = "host" if target in self.host else target
                grouped[target] = grouped.get(target, 0.0) + nbytes
            for name, nbytes in grouped.items():
                self.categories[name] = max(self.categories.get(name, 0.0), nbytes)
            device = {name: nbytes for name, nbytes in grouped.items() if name != "host"}
            total = sum(device.values())
            if total > self.peak:
                self.peak, self.at_peak = total, device


def _recording(base: type):
    class Recording(base):
        """`base`, also handing every snapshot it takes to a CategoryPeaks."""

        peaks: CategoryPeaks

        def _update_peak_stats(self, peak_state) -> None:
            super()._update_peak_stats(peak_state)
            self.peaks.record(self._curr_mem_snap)

    return Recording


_FSDPRecording = _recording(FSDPMemTracker)
_Recording = _recording(MemTracker)


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind the executor's (one per chunk, or dense and expert under EP):
    what the trackers can follow."""
    return list(getattr(optimizer, "parts", [optimizer]))


@contextlib.contextmanager
def tracker_for(run, peaks: CategoryPeaks):
    """FSDPMemTracker over a single FSDP2 root (it also labels gathers and reduce-scatters),
    MemTracker otherwise (DDP, replicate, several pipeline chunks)."""
    modules, optimizers = run.modules, torch_optimizers(run.optimizer)
    if len(modules) == 1 and isinstance(modules[0], FSDPModule):
        tracker = _FSDPRecording(modules[0], optimizers[0] if len(optimizers) == 1 else None)
        if len(optimizers) > 1:
            tracker.track_external(*optimizers)
    else:
        tracker = _Recording()
        tracker.track_external(nn.ModuleList(modules) if len(modules) > 1 else modules[0], *optimizers)
    tracker.peaks = peaks
    with tracker:
        yield tracker
