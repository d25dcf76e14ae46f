"""A configuration read from another tool, turned into the Plan it describes.

The stated layout enters the estimator by the same door as every plan: a validated `Plan`.
What the file leaves out (the model for DeepSpeed, the batch for Accelerate) comes from the
command line; a value given both ways must agree, so a user never prices a layout other
than the one their file runs.
"""
from __future__ import annotations

from typing import Any

from hardware.errors import FormatError
from layout.axes import AXES, AXIS
from layout.plan import Plan, StagePlan

from .common import Stated, check_policy


def merge(stated: Stated, given: dict[str, Any]) -> Stated:
    """`stated` with what the command line adds (model, global_batch, seq_len, dtype, layout axes);
    a value the file states differently is refused, naming the option and the file's value.
    `--recompute` replaces the file's checkpointing (which a tool may leave to the training script)."""
    own = {"model": stated.model, "global_batch": stated.global_batch, "seq_len": stated.seq_len,
           "dtype": stated.dtype, **stated.axes}
    for key, value in given.items():
        if value is None:
            continue
        if own.get(key) is not None and own[key] != value:
            flag = "model" if key == "model" else "--" + key.replace("_", "-")
            raise FormatError(flag, f"{value} differs from the {stated.format} file's {own[key]}",
                              "drop the option to price the file as written, or edit the file")
    axes = {**stated.axes, **{k: v for k, v in given.items() if k in AXIS and v is not None}}
    if "recompute" in axes:
        policy = axes.pop("recompute")
        stated = stated.model_copy(update={"block_recompute": policy})
    top = {k: v for k, v in given.items() if k in ("model", "global_batch", "seq_len", "dtype") and v is not None}
    return stated.model_copy(update={**top, "axes": axes})


def missing(stated: Stated) -> str | None:
    """The first option the file and the command line left unstated, as its flag."""
    for key, flag in (("model", "MODEL"), ("global_batch", "--global-batch"), ("seq_len", "--seq-len")):
        if getattr(stated, key) is None and not (key == "global_batch" and stated.local_batch):
            return flag
    return None


def to_plan(stated: Stated, cluster, kinds: list[str]) -> Plan:
    """The Plan `stated` describes on `cluster`, for a model whose layer kinds are `kinds`
    (embedding, blocks..., head). Axes the file leaves out take their declared defaults;
    data parallelism fills the GPUs the other degrees leave."""
    axes = {axis.name: axis.default for axis in AXES if axis.name != "recompute"}
    axes.update(stated.axes)
    if "dp" not in stated.axes:
        others = axes["tp"] * axes["pp"] * axes["cp"]
        if cluster.n_gpus % others:
            raise FormatError("--hw", f"{cluster.spec()} has {cluster.n_gpus} GPUs, not a multiple of the "
                              f"{stated.format} file's tp*pp*cp = {others}", "name hardware the layout fills")
        axes["dp"] = cluster.n_gpus // others
    world = axes["dp"] * axes["tp"] * axes["pp"] * axes["cp"]
    if world != cluster.n_gpus:
        raise FormatError("--hw", f"the {stated.format} file's layout fills {world} GPUs (dp {axes['dp']} x tp "
                          f"{axes['tp']} x pp {axes['pp']} x cp {axes['cp']}), {cluster.spec()} has {cluster.n_gpus}",
                          f"name hardware of {world} GPUs")
    n_blocks = kinds.count("block")
    stages = _stages(stated, axes["pp"] * axes["vpp"], kinds, n_blocks)
    global_batch = stated.global_batch or stated.local_batch * axes["dp"]
    return Plan(model=stated.model, hardware=cluster.spec(), global_batch=global_batch,
                seq_len=stated.seq_len, dtype=stated.dtype or "bf16", stages=stages, **axes)


def _stages(stated: Stated, n_stages: int, kinds: list[str], n_blocks: int) -> list[StagePlan]:
    blocks = stated.stage_blocks or _even(n_blocks, n_stages)
    if len(blocks) != n_stages or sum(blocks) != n_blocks:
        raise FormatError("stages", f"the {stated.format} file puts {sum(blocks)} blocks in {len(blocks)} stages; "
                          f"the model has {n_blocks} blocks and the layout {n_stages} stages",
                          "state a partition of every block, or none")
    policies = _policies(stated.block_recompute, n_blocks)
    if len(policies) != n_blocks:
        raise FormatError("recompute", f"{len(policies)} block policies for {n_blocks} blocks",
                          "one policy per block")
    stages, block, layer = [], 0, 0
    for s, count in enumerate(blocks):
        end = layer + count + (s == 0) + (s == n_stages - 1)
        recompute = ["none"] * (s == 0) + policies[block:block + count] + ["none"] * (s == n_stages - 1)
        stages.append(StagePlan(start=layer, end=end, recompute=recompute))
        layer, block = end, block + count
    if layer != len(kinds):
        raise FormatError("model", f"the model's {len(kinds)} layers are not embedding, blocks and head",
                          "state the layout with flags (`parallax estimate --dp ...`)")
    return stages


def _policies(stated: list[str] | str, n_blocks: int) -> list[str]:
    """One policy per block: a list as given, one policy for all, or "every:k" (full on blocks k, 2k, ...)."""
    if isinstance(stated, list):
        return [check_policy(p, "recompute") for p in stated]
    if stated.startswith("every:"):
        k = int(stated.partition(":")[2])
        return ["full" if (i + 1) % k == 0 else "none" for i in range(n_blocks)]
    return [check_policy(stated, "recompute")] * n_blocks


def _even(n_blocks: int, n_stages: int) -> list[int]:
    from layout.plan import uniform_stages

    kinds = ["embedding"] + ["block"] * n_blocks + ["head"]
    if n_stages > n_blocks:
        raise FormatError("pp", f"{n_stages} stages exceed the {n_blocks} blocks", f"use pp*vpp <= {n_blocks}")
    return [(s.end - s.start) - (s.start == 0) - (s.end == len(kinds)) for s in uniform_stages(kinds, n_stages)]
