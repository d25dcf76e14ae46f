"""The run report: what was measured, beside what the cost model predicted."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from hardware.untrusted import SafeName


class RunReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: SafeName
    plan: dict
    steps: int
    world_size: int
    device: str
    losses: list[float]
    step_times_s: list[float] = Field(description="max over ranks, per step")
    step_time_s: float = Field(description="median of the steady-state steps")
    peak_memory_bytes: list[int] = Field(description="per rank: tensors allocated at most (max_memory_allocated)")
    peak_reserved_bytes: list[int] = Field(default_factory=list, description="per rank: what the caching allocator "
                                           "held at most (max_memory_reserved; on CPU the tensors' peak)")
    tp_replicated: list[str] = Field(default_factory=list, description="modules TP left replicated")
    predicted_step_time_s: float | None = None
    predicted_peak_memory_bytes: float | None = None
    predicted_peak_reserved_bytes: float | None = Field(None, description="the estimate's max_memory_reserved "
                                                        "(costmodel.reserved), held to peak_reserved_bytes on a GPU")
    step_time_error: float | None = Field(None, description="(measured - predicted) / predicted")
    memory_error: float | None = Field(None, description="(max measured - predicted) / predicted")
    notes: list[str] = Field(default_factory=list)

    def with_prediction(self, step_time_s: float | None, peak_bytes: float | None, note: str = "",
                        reserved_bytes: float | None = None) -> "RunReport":
        """A copy with predictions and relative errors filled in."""
        update: dict = {"predicted_step_time_s": step_time_s, "predicted_peak_memory_bytes": peak_bytes,
                        "predicted_peak_reserved_bytes": reserved_bytes}
        if step_time_s:
            update["step_time_error"] = (self.step_time_s - step_time_s) / step_time_s
        if peak_bytes:
            update["memory_error"] = (max(self.peak_memory_bytes) - peak_bytes) / peak_bytes
        if note:
            update["notes"] = [*self.notes, note]
        return self.model_copy(update=update)
