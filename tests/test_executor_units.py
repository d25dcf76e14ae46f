"""Executor pieces that need no process group: validation, style derivation, layer mapping."""
from __future__ import annotations

import pytest
import torch

from costmodel.plan import Plan
from executor.layers import layer_map
from executor.models import build_model
from executor.pipeline import cut
from executor.tp_styles import analyse_tp
from executor.validate import validate
from hardware.errors import PlanError

from test_executor import make_plan


@pytest.mark.parametrize("change, field", [
    (dict(tp=3), "tp"),                       # 4 heads
    (dict(pp=7, n_layers=7), "pp"),           # more stages than the 6 layers
    (dict(n_layers=5), "stages"),             # last stage ends before the head
    (dict(dp=2, tp=2, sp=True, pp=2), "sp"),
    (dict(dp=2, tp=2, zero=1), "zero"),
])
def test_validate_refuses_plans_that_do_not_fit(change, field):
    with pytest.raises(PlanError) as info:
        validate(make_plan("reference-tiny", **change), build_model("reference-tiny"))
    assert info.value.field == field


def test_validate_refuses_world_size_mismatch_and_accepts_a_good_plan():
    model = build_model("reference-tiny")
    validate(make_plan("reference-tiny", dp=2), model, world_size=2)
    with pytest.raises(PlanError) as info:
        validate(make_plan("reference-tiny", dp=2), model, world_size=3)
    assert info.value.field == "dp*tp*pp"


def test_run_refuses_before_launching():
    from executor.launch import run

    with pytest.raises(PlanError):
        run(make_plan("reference-tiny", tp=3), steps=1)


@pytest.mark.parametrize("name, prefix", [("reference-tiny", "layers.0."), ("hf-llama-tiny", "model.model.layers.0.")])
def test_tp_styles_follow_the_data_flow(name, prefix):
    model = build_model(name)
    analysis = analyse_tp(model, torch.randint(0, 100, (2, 8)))
    styles = {k[len(prefix):]: v for k, v in analysis.styles.items() if k.startswith(prefix)}
    assert all(styles[f"{a}.{p}_proj"] == "colwise" for a in ("attn", "self_attn") if f"{a}.q_proj" in styles
               for p in "qkv")
    assert [v for k, v in styles.items() if k.endswith(("o_proj", "down_proj"))] == ["rowwise", "rowwise"]
    assert any(k.endswith("lm_head") for k in analysis.gather_output)


def test_layer_map_and_pipeline_cut_keep_names():
    model = build_model("hf-gpt2-tiny")
    lmap = layer_map(model)
    assert lmap.n_layers == 6 and lmap.pre == ("model.transformer.wte", "model.transformer.wpe")
    names = {n for n, _ in model.named_parameters()}
    middle = cut(model, lmap, 2, 4)
    kept = {n for n, _ in middle.named_parameters()}
    assert kept and kept < names
    assert all(n.startswith(("model.transformer.h.1.", "model.transformer.h.2.")) for n in kept)
    hidden = torch.randn(2, 8, 64)
    assert middle(hidden).shape == hidden.shape
