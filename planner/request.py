"""What a user asks the planner: one validated object from the public entry point down to
the search, so an option is declared, checked and documented once.

`planner.plan(model, hw, global_batch=..., seq_len=...)` keeps its keywords for people;
they become a `PlanRequest` there, and an unknown or bad one is a `PlanError` naming it.
"""
from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from costmodel.terms import DEFAULT_MEMORY_RESERVE
from layout.layout import Layout
from layout.plan import DTYPES
from layout.rules import precision_problem
from hardware.errors import ParallaxError, PlanError
from hardware.limits import MAX_GLOBAL_BATCH, MAX_SEQ_LEN, check_count, check_positive

OBJECTIVES = ("time", "cost")
TARGET_GAP = 0.01  # the search stops once its pick is proven within 1% of any layout's best
LOSSY_COMPRESSION = ("none", "int8", "topk")  # what --allow-compression lets the solver pick (bf16 too for fp32)


class PlanRequest(BaseModel):
    """The workload's shape, the pins, the objective and the search's budget."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    global_batch: int = Field(description="sequences per optimizer step")
    seq_len: int = Field(description="tokens per sequence")
    dtype: Optional[str] = Field(None, description="bf16, fp16, fp32 or fp8; None: bf16, or fp32 where bf16 is no faster")
    objective: str = Field("time", description="'time' (fastest step) or 'cost' (cheapest per token)")
    fixed: dict[str, Any] = Field(default_factory=dict, description="pinned axes, e.g. {'tp': 8, 'zero': 1}")
    top_k: int = Field(3, ge=1, le=100, description="the pick and top_k - 1 alternatives")
    time_limit_s: float = Field(2.0, description="the whole search's budget, tracing excluded")
    memory_reserve: float = Field(DEFAULT_MEMORY_RESERVE, ge=0.0, lt=1.0, description="share of each GPU kept free beyond the plan's predicted "
                                "reservation (tensors and the caching allocator's blocks) and the runtime's memory")
    price_per_gpu_hour: Optional[float] = Field(None, description="overrides the profile's price")
    allow_compression: bool = Field(False, description="the solver may pick lossy gradient compression")
    target_gap: float = Field(TARGET_GAP, ge=0.0, le=1.0, description="stop once proven within this of the best")
    mtbf_hours: Optional[float] = Field(None, description="per GPU; default the profile's sourced figure")

    @field_validator("global_batch", "seq_len", mode="before")
    @classmethod
    def _count(cls, value: Any, info) -> int:
        high, hint = (MAX_GLOBAL_BATCH, "e.g. 512") if info.field_name == "global_batch" else (MAX_SEQ_LEN, "e.g. 4096")
        return check_count(info.field_name, value, high, hint=hint)

    @field_validator("fixed", mode="before")
    @classmethod
    def _no_pins(cls, value: Any) -> Any:
        return {} if value is None else value  # `fixed=None`: nothing pinned

    @field_validator("time_limit_s", "price_per_gpu_hour", "mtbf_hours", mode="before")
    @classmethod
    def _positive(cls, value: Any, info) -> Any:
        hint = "seconds, e.g. 4" if info.field_name == "time_limit_s" else "e.g. 4"
        return value if value is None else check_positive(info.field_name, value, hint)

    @model_validator(mode="after")
    def _choices(self) -> "PlanRequest":
        if self.dtype is not None and self.dtype not in DTYPES:
            raise PlanError("dtype", f"unknown dtype {self.dtype!r}", f"use one of {', '.join(DTYPES)}")
        if self.objective not in OBJECTIVES:
            raise PlanError("objective", f"unknown objective {self.objective!r}", "use 'time' or 'cost'")
        from planner.search.space import check_pins

        check_pins(self.fixed)
        precision = Layout(**{k: self.fixed[k] for k in ("master_dtype", "optimizer_dtype", "reduce_dtype") if k in self.fixed})
        if (problem := precision_problem(precision, self.dtype or "bf16")) is not None:
            raise problem
        return self

    @classmethod
    def of(cls, **options: Any) -> "PlanRequest":
        """The request, or a PlanError naming the first unknown or invalid option."""
        unknown = sorted(set(options) - set(cls.model_fields))
        if unknown:
            raise PlanError(unknown[0], "is not a planning option", f"use one of {', '.join(cls.model_fields)}")
        try:
            return cls(**options)
        except ValidationError as error:
            raise _as_plan_error(error) from None

    def pins(self, dtype: str) -> dict[str, Any]:
        """The pins the search honours: `fixed`, and where compression is allowed and not pinned,
        the set of methods the solver may pick from (bf16 only for fp32 training)."""
        fixed = dict(self.fixed)
        if self.allow_compression and "compression" not in fixed:
            fixed["compression"] = LOSSY_COMPRESSION + (("bf16",) if dtype == "fp32" else ())
        return fixed

    @property
    def lets_solver_compress(self) -> bool:
        return self.allow_compression and "compression" not in self.fixed


def _as_plan_error(error: ValidationError) -> ParallaxError:
    first = error.errors()[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, ParallaxError):
        return cause
    field = ".".join(str(part) for part in first["loc"]) or "request"
    value = first.get("input")
    shown = "" if isinstance(value, dict) else f"{value!r}: "
    return PlanError(field, f"{shown}{first['msg']}", "see planner.PlanRequest")
