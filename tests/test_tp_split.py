"""The model described once: one function derives the TP split (`planner.trace.tp_styles.analyse_tp`).
The tracer runs it on its fake forward and prices the graph by it (`planner.trace.blocks.split_tp`);
the executor runs it on the live module and applies it. Here the styles the priced graph ends with
equal those the executor applies, for every catalog model the executor builds and for a user's own
module (`examples/llama_module.py`): a pricing pass that dropped, renamed or overrode a module's
style would fail it."""
from __future__ import annotations

import re

import pytest
import torch

from planner.trace.tp_styles import analyse_tp
from hardware.errors import ModelError
from planner.trace.blocks import split_tp
from planner.trace.models.build import build_module
from planner.trace.models.catalog import list_models
from planner.trace.module import trace_module

SEQ = 16


def _split(model: torch.nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """(executed, priced): module -> colwise/rowwise, the blocks' numbers as the tracer's `*`."""
    executed = analyse_tp(model, torch.randint(0, 8, (1, SEQ), device="meta")).styles
    graph = trace_module(model, (torch.zeros(1, SEQ, dtype=torch.long),), seq_len=SEQ, dtype="bf16")
    split_tp(graph)
    executed = {re.sub(r"\.\d+\.", ".*.", name): style for name, style in executed.items() if style != "replicate"}
    return executed, {name: style for name, style in graph.tp_styles.items() if style != "replicate"}


def _on_meta(build) -> torch.nn.Module:
    with torch.device("meta"):
        return build().to(torch.bfloat16)  # grouped expert GEMMs take bf16 only


@pytest.mark.parametrize("name", list_models())
def test_the_priced_split_is_the_executed_split(name):
    try:
        model = _on_meta(lambda: build_module(name, depth=2))
    except ModelError:
        pytest.skip(f"{name} is priced but not run (not a causal LM)")
    executed, priced = _split(model)
    assert executed and executed == priced


def test_a_users_own_module_is_split_as_priced():
    from examples.llama_module import build

    executed, priced = _split(_on_meta(build))
    assert executed and executed == priced
