"""What every format shares: the exported file, the stated configuration read back, and the
record of what a tool cannot say.

A plan is written for another tool (`Exported`) and another tool's configuration is read
as a layout (`Stated`). Both sides speak of the plan's blocks, not its expanded layer list:
a tool partitions transformer blocks over pipeline stages and checkpoints blocks, and the
embedding and head go with the first and last stage.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from hardware.errors import FormatError
from layout.axes import REBUILT, RECOMPUTE
from layout.plan import Plan

LOSSY_FLAG = "--lossy"


class Exported(BaseModel):
    """A plan as another tool takes it: the file's text, the command that runs it, and what the
    tool could not express (empty unless the export was asked to be lossy)."""
    model_config = ConfigDict(extra="forbid")

    format: str
    text: str = Field(description="the file to write: a config (JSON, YAML) or an argument list")
    launch: str = Field(description="the command line that starts the tool on this file")
    lost: list[str] = Field(default_factory=list, description="'field: why' for each plan field the tool cannot say")


class Stated(BaseModel):
    """A configuration read from another tool, in the plan's terms. `axes` holds the layout axes the
    file states (the rest take their declared defaults); `block_recompute` one policy per block in
    model order; `stage_blocks` the blocks of each virtual stage (None: split as evenly as the
    tool does); `unpriced` names what the file asks for that Parallax does not price."""
    model_config = ConfigDict(extra="forbid")

    format: str
    model: str | None = None
    n_gpus: int | None = None
    global_batch: int | None = None
    local_batch: int | None = Field(None, description="sequences per data-parallel replica and step, where the "
                                    "tool makes the global batch of it (torchtitan's default)")
    seq_len: int | None = None
    dtype: str | None = None
    axes: dict[str, Any] = Field(default_factory=dict)
    stage_blocks: list[int] | None = None
    block_recompute: list[str] | str = "none"
    unpriced: list[str] = Field(default_factory=list)


class Losses:
    """What a tool cannot say of a plan, collected while exporting; refused in one line unless
    the user accepts the loss with --lossy."""

    def __init__(self, tool: str) -> None:
        self.tool = tool
        self.items: list[str] = []

    def add(self, field: str, why: str) -> None:
        self.items.append(f"{field}: {why}")

    def settle(self, lossy: bool) -> list[str]:
        if self.items and not lossy:
            first = self.items[0]
            more = f" (and {len(self.items) - 1} more)" if len(self.items) > 1 else ""
            raise FormatError(first.partition(":")[0], f"{self.tool} cannot express {first.partition(': ')[2]}{more}",
                              f"re-plan with that axis pinned to what {self.tool} runs, or pass {LOSSY_FLAG} to "
                              "export without it")
        return list(self.items)


RECIPE_DEFAULTS = {"master_dtype": "fp32", "optimizer_dtype": "fp32", "reduce_dtype": None, "accumulation": "reduce_each",
                   "tp_overlap": False, "fp8_param_gather": False, "ddp_bucket_view": True}


def recipe_losses(plan: Plan, losses: Losses, says: dict[str, tuple] | None = None) -> None:
    """The precision, accumulation and TP-overlap pins a tool's file cannot state: each field off
    its default unless `says` lists the value among those the tool writes."""
    says = says or {}
    for field, default in RECIPE_DEFAULTS.items():
        value = getattr(plan, field)
        if value != default and value not in says.get(field, ()):
            losses.add(field, f"{field} {value} (its file states the default recipe's)")


def blocks_of_stages(plan: Plan) -> list[int]:
    """Transformer blocks in each virtual stage: the stage's layers less the embedding (layer 0)
    and the head (the last layer)."""
    last = plan.stages[-1].end
    return [(s.end - s.start) - (s.start == 0) - (s.end == last) for s in plan.stages]


def block_recompute(plan: Plan) -> list[str]:
    """One checkpointing policy per block, in model order (the embedding's and head's left out)."""
    last = plan.stages[-1].end
    return [policy for s in plan.stages for i, policy in enumerate(s.recompute, s.start) if 0 < i < last - 1]


def rebuilds_any(policies: list[str]) -> bool:
    """Whether a tool that checkpoints every block or none must checkpoint them all to recompute
    no less than the plan: some block re-runs its forward ops (full or op)."""
    return any(p in REBUILT for p in policies)


def uniform(policies: list[str]) -> str | None:
    """The one policy every block has, or None when they differ."""
    return policies[0] if policies and len(set(policies)) == 1 else None


def is_even_split(blocks: list[int]) -> bool:
    """Whether the blocks are split as evenly as possible, the remainder on the middle stages
    (`layout.plan.uniform_stages`): what a tool does when it is told no partition."""
    from layout.plan import uniform_stages

    kinds = ["embedding"] + ["block"] * sum(blocks) + ["head"]
    even = uniform_stages(kinds, len(blocks))
    return [(s.end - s.start) - (s.start == 0) - (s.end == len(kinds)) for s in even] == blocks


def n_nodes(plan: Plan) -> tuple[int, int]:
    """(nodes, GPUs per node) the plan runs on."""
    cluster = plan.cluster()
    per_node = min(cluster.node.gpus_per_node, plan.n_gpus)
    return max(1, plan.n_gpus // per_node), per_node


def section(config: dict, key: str, tool: str) -> dict:
    """A config file's nested section (absent: empty), refused by name when it is not a mapping."""
    value = config.get(key) or {}
    if not isinstance(value, dict):
        raise FormatError(key, f"is a {type(value).__name__}, not a section", f"see {tool}'s config documentation")
    return value


def whole_number(value: Any, field: str, tool: str, low: int | None = None) -> int:
    """A config file's integer (not a bool), at least `low` where one is given."""
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        at_least = f" >= {low}" if low is not None else ""
        raise FormatError(field, f"{value!r} is not a whole number{at_least}", f"{tool} takes an integer here")
    return value


def check_policy(value: str, field: str) -> str:
    if value not in RECOMPUTE:
        raise FormatError(field, f"{value!r} is not a recompute policy", f"use one of {', '.join(RECOMPUTE)}")
    return value
