"""Plans in the formats of the tools users already run, both ways.

`export` writes a plan as a tool takes it (torchtitan's overrides, a DeepSpeed `ds_config`,
an Accelerate config file, Megatron-LM's arguments; for serving plans the vLLM, SGLang and
TensorRT-LLM command lines), refusing in one line what the tool cannot express unless the
user accepts the loss. `read` takes a user's own configuration back as a `Stated` layout,
which `formats.stated.to_plan` makes the Plan the estimator prices.

A floor above the planner (it reads plans and the model catalog) and below the executor and
the CLI; it imports neither.
"""
from __future__ import annotations

from pathlib import Path

from hardware.errors import FormatError
from hardware.untrusted import read_text

from . import accelerate, deepspeed, megatron, serving, torchtitan
from .common import Exported, Stated

TRAINING = {"torchtitan": torchtitan, "deepspeed": deepspeed, "accelerate": accelerate, "megatron": megatron}
SERVING = tuple(serving.FLAGS)
FORMATS = (*TRAINING, *SERVING)
SUFFIX = {"torchtitan": ".args", "deepspeed": ".json", "accelerate": ".yaml", "megatron": ".args",
          "vllm": ".args", "sglang": ".args", "trtllm": ".args"}


def check_format(name: str, field: str = "--to", kinds: tuple[str, ...] = FORMATS) -> str:
    if name not in kinds:
        raise FormatError(field, f"unknown format {name!r}", f"use one of {', '.join(kinds)}")
    return name


def export(plan, to: str, lossy: bool = False) -> Exported:
    """`plan` (a training `Plan` or a serving `InferencePlan`) in format `to`."""
    check_format(to)
    serving_plan = hasattr(plan, "prompt_len")
    if serving_plan != (to in SERVING):
        kind = "a serving plan" if serving_plan else "a training plan"
        wanted = SERVING if serving_plan else tuple(TRAINING)
        raise FormatError("--to", f"{to} does not take {kind}", f"use one of {', '.join(wanted)}")
    if serving_plan:
        return serving.export(plan, to, lossy)
    if getattr(plan, "groups", None):
        raise FormatError("plan", "a mixed-GPU plan runs under Parallax only (no tool places stages on GPU types)",
                          "plan one GPU type to export")
    return TRAINING[to].export(plan, lossy)


def guess(path: Path, text: str) -> str:
    """The training format a configuration file is in, from its name and content."""
    if path.suffix == ".json" or text.lstrip().startswith("{"):
        return "deepspeed"
    if path.suffix in (".yaml", ".yml") or "distributed_type" in text:
        return "accelerate"
    if path.suffix == ".toml" or any(mark in text for mark in ("--parallelism.", "--training.", "--config llama",
                                                                  "activation_checkpoint:", "-m torchtitan")):
        return "torchtitan"
    if "--tensor-model-parallel-size" in text or "--micro-batch-size" in text or "--num-layers" in text:
        return "megatron"
    raise FormatError("--from", f"cannot tell which tool {path.name} is for",
                      f"name it with --from-format ({', '.join(TRAINING)})")


def read(path: Path, fmt: str | None = None) -> Stated:
    """A user's training configuration file as a stated layout (the format guessed unless named)."""
    text = read_text(path, "--from", "configuration")
    fmt = check_format(fmt, "--from-format", tuple(TRAINING)) if fmt else guess(path, text)
    module = TRAINING[fmt]
    return module.read(text, path.suffix) if fmt == "torchtitan" else module.read(text)


__all__ = ["FORMATS", "SERVING", "TRAINING", "Exported", "Stated", "export", "read"]
