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
from functools import wraps

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule

# tracker category -> cost model category (costmodel.memory / peak.peak_moments)
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
        self.allocator: dict[str, float] = {}  # the trace replayed: peak allocated and reserved

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


class AllocationTrace:
    """Every storage the trackers see allocated, resized and freed, in order: the sequence the
    caching-allocator replay (`costmodel.allocator`) takes. A storage's category, read at the end
    (the trackers relabel some after creation), says its stream and whether it is the host's."""

    def __init__(self, host: tuple[str, ...] = ()) -> None:
        self.host = host
        self.events: list[tuple] = []
        self.label: dict[int, str] = {}  # the tracker's own category name, last given
        self._keys = 0

    def record(self, kind: str, winfo, old_bytes: int | None) -> None:
        key = getattr(winfo, "trace_key", None)
        if key is None:
            key = winfo.trace_key = self._keys
            self._keys += 1
        self.label[key] = getattr(winfo.reftype, "value", winfo.reftype)
        if kind in ("DEL", "SIZE") and (old_bytes if kind == "SIZE" else winfo.mem_consumed):
            self.events.append(("free", key))
        if kind in ("ADD", "SIZE") and winfo.mem_consumed:
            self.events.append(("malloc", key, winfo.mem_consumed))

    def device_events(self) -> list[tuple]:
        """The device's events with their streams: FSDP2 gathers on a stream of its own (its
        all-gather output is allocated on the copy-in stream); the rest runs on the default one."""
        out = []
        for event in self.events:
            label = self.label[event[1]]
            if CATEGORY.get(label, "activations") in self.host:
                continue
            if event[0] == "malloc":
                out.append((*event, "all_gather" if label == "All Gather" else "default"))
            else:
                out.append(event)
        return out


def _recording(base: type):
    class Recording(base):
        """`base`, also handing every snapshot it takes to a CategoryPeaks and every allocation
        to an AllocationTrace."""

        peaks: CategoryPeaks
        trace: AllocationTrace
        propagating = 0  # inside DTensor's sharding propagation (`_untracked_sharding_propagation`)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.propagating:  # global-shape fakes that only derive an output's metadata: no memory in a run
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _update_peak_stats(self, peak_state) -> None:
            # in place of torch's, which also walks every tracked module after each op for the
            # modules' own peaks (over half a dry run's time, on a model of ~700 modules): the dry
            # run reads the step's snapshots alone
            self.peaks.record(self._curr_mem_snap)

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            self.trace.record(u_type.name, winfo, old_mem_consumed)

    return Recording


class _FSDPRecording(_recording(FSDPMemTracker)):
    """Also names the gradients FSDP2 holds unsharded across micro-batches in the reduce dtype
    (`FSDPParam.unsharded_accumulated_grad`, made in its post-backward where the tracker sees a
    new tensor): unsharded gradients, as the ones it holds in the compute dtype."""

    def _fsdp_param_group_post_backward(self, fsdp_mod, orig_post_backward):
        inner = super()._fsdp_param_group_post_backward(fsdp_mod, orig_post_backward)

        @wraps(inner)
        def tagged(*args, **kwargs):
            inner(*args, **kwargs)
            group = fsdp_mod._get_fsdp_state()._fsdp_param_group
            for param in group.fsdp_params if group else ():
                if param.unsharded_accumulated_grad is not None:
                    self._update_and_maybe_create_winfos(param.unsharded_accumulated_grad,
                                                         _FSDPRefType.UNSHARDED_GRAD, update_existing=True)

        return tagged


_Recording = _recording(MemTracker)


def replay_allocator(peaks: CategoryPeaks, trace: AllocationTrace, room: float | None = None) -> None:
    """The device's allocation sequence through torch's caching allocator, with and without
    expandable segments: what `max_memory_allocated` and `max_memory_reserved` would read with
    no memory pressure. With `room` (the GPU's bytes less the runtime's), the expandable replay
    again as it runs on that device: torch gives cached pages back and retries a request that
    would pass the device (`reserved_on_device`, `allocation_retries`), and fails only when the
    live tensors themselves do not fit (`out_of_memory`, 1.0)."""
    from costmodel.allocator import OutOfMemory, replay

    events = trace.device_events()
    plain, expandable = replay(events), replay(events, expandable_segments=True)
    peaks.allocator = {"allocated": plain.peak_allocated, "reserved": plain.peak_reserved,
                       "reserved_expandable": expandable.peak_reserved}
    if room is None:
        return
    try:
        bounded = replay(events, expandable_segments=True, capacity=int(room))
    except OutOfMemory as error:
        peaks.allocator.update(reserved_on_device=float(error.reserved), allocation_retries=float("nan"),
                               out_of_memory=1.0)
        return
    peaks.allocator.update(reserved_on_device=float(bounded.peak_reserved), allocation_retries=float(bounded.retries),
                           out_of_memory=0.0)


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind the executor's (one per chunk, or dense and expert under EP):
    what the trackers can follow."""
    return list(getattr(optimizer, "parts", [optimizer]))


@contextlib.contextmanager
def tracker_for(run, peaks: CategoryPeaks, trace: AllocationTrace):
    """FSDPMemTracker over a single FSDP2 root (it also labels gathers and reduce-scatters),
    MemTracker otherwise (DDP, replicate, several pipeline chunks)."""
    modules, optimizers = run.modules, torch_optimizers(run.optimizer)
    external: tuple = ()
    if len(modules) == 1 and isinstance(modules[0], FSDPModule):
        tracker = _FSDPRecording(modules[0], optimizers[0] if len(optimizers) == 1 else None)
        external = tuple(optimizers) if len(optimizers) > 1 else ()
    else:
        tracker = _Recording()
        external = (nn.ModuleList(modules) if len(modules) > 1 else modules[0], *optimizers)
    tracker.peaks, tracker.trace = peaks, trace  # before tracking: what it tracks first is the trace's first
    if external:
        tracker.track_external(*external)
    with tracker, _untracked_sharding_propagation(tracker):
        yield tracker


@contextlib.contextmanager
def _untracked_sharding_propagation(tracker):
    """DTensor derives each op's output metadata by running the op on fake tensors of the
    global shape (`ShardingPropagator._propagate_tensor_meta_non_cached`): a fake mode of its
    own in a run, so no memory, but the dry run's own fake mode here, which the tracker would
    count (a TP embedding's whole fp32 table, twice, at a pipeline rank's peak: +3.9 GiB on
    llama-3-8b tp2 pp4). The tracker lets those ops through untracked."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    @wraps(original)
    def propagate(self, op_schema):
        tracker.propagating += 1
        try:
            return original(self, op_schema)
        finally:
            tracker.propagating -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original
