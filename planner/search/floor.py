"""A floor under every plan of a layout, priced before its coefficients are built.

Building a layout's stage-model coefficients (`coefficients.stage_model_data`) prices its
collectives, memory moments and pipeline ranks: most of the search's enumeration time, for
thousands of layouts of which a few dozen can beat the best. The floor needs only the
layers' unrecomputed compute and TP time, which depends on a handful of axes (TP, SP,
micro-batch, CP, EP, stack) and so is priced once per handful: the pipeline composition
(`costmodel.terms.pipeline_seconds`) of that work spread evenly over the ranks, with a
zero-bubble schedule's fill (on CPU ranks sharing cores, `bounds._pipeline`'s form).
Every term the coefficients add (recomputation, exposed ZeRO and data-parallel
collectives, sends, the optimizer, an uneven split) only raises a plan's time, and
`pipeline_seconds` grows with its slowest rank, so no plan of the layout is faster than
its floor: a layout whose floor cannot beat the search's best is never built.
"""
from __future__ import annotations

from costmodel.layout import context_of
from costmodel.terms import bubble_fill, pipeline_seconds
from costmodel.workload import Workload
from hardware.schema import Cluster
from layout.layout import Layout

from planner.search.coefficients import LayerTimes


class Floors:
    """`floor(layout)` for the layouts of one search (one workload, cluster, dtype and batch)."""

    def __init__(self, workload: Workload, cluster: Cluster, dtype: str, global_batch: int, times: LayerTimes) -> None:
        self.workload, self.cluster, self.dtype, self.global_batch, self.times = workload, cluster, dtype, global_batch, times
        self._work: dict[tuple, tuple[float, float]] = {}

    def floor(self, layout: Layout) -> float:
        """Seconds no plan of `layout` beats."""
        work, weight_grads = self._layers_work(layout)
        m = self.global_batch // (layout.dp * layout.micro_batch)
        slowest = work / layout.pp
        sharing = self.cluster.node.oversubscription or 1.0
        if layout.pp > 1 and sharing > 1.0:  # CPU ranks sharing cores (`bounds._pipeline`)
            return m * slowest / sharing
        return pipeline_seconds(slowest, work, m, layout.vpp, bubble_fill(layout.schedule, weight_grads, layout.pp))

    def _layers_work(self, layout: Layout) -> tuple[float, float]:
        """Every layer's unrecomputed time per micro-batch (compute and TP collectives) and its
        weight gradients' share, summed over the model, for the axes a layer's time depends on."""
        key = (layout.tp, layout.sp, layout.micro_batch, layout.cp, layout.ep, layout.stack, layout.tp_overlap)
        if key not in self._work:
            ctx = context_of(layout, self.dtype, self.cluster, self.workload)
            parts = [self.times(layer, ctx, "none") for layer in self.workload.layers]
            self._work[key] = (sum(p.total for p in parts), sum(p.weight_grad for p in parts))
        return self._work[key]
