"""Scaled-dot-product attention priced as the device runs it (costmodel.attention,
planner.trace.attention): torch's kernel choice restated, and a plain PyTorch module's
attention fused on GPUs where the CPU trace alone would price the math path."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import hardware
import planner
from costmodel.attention import for_device, sdpa_backend
from costmodel.workload import AttentionCall
from planner.resolve import resolve_workload
from planner.trace.graph import numel

SEQ = 2048


def _call(**changes) -> AttentionCall:
    base = dict(heads=16, kv_heads=16, head_dim=64, value_dim=64, q_len=SEQ, kv_len=SEQ, dtype="bfloat16",
                mask="causal", dropout=False, gqa=False, layout="bshd")
    return AttentionCall(**{**base, **changes})


@pytest.mark.parametrize("hw, changes, backend", [
    ("a100-80g", {}, "flash"),
    ("a100-80g", {"dropout": True}, "flash"),  # flash runs dropout inside the kernel
    ("a100-80g", {"mask": "float"}, "efficient"),  # an explicit mask rules flash out
    ("a100-80g", {"mask": "bool", "gqa": True, "kv_heads": 4}, "math"),  # efficient has no grouped-query heads
    ("a100-80g", {"head_dim": 320, "value_dim": 320}, "efficient"),  # flash stops at 256
    ("a100-80g", {"dtype": "float32"}, "efficient"),  # flash is for 16-bit types only
    ("h100-sxm", {}, "cudnn"),  # torch prefers cuDNN on sm90
    ("h100-sxm", {"layout": "other"}, "flash"),  # cuDNN wants [b, s, h, d] strides
    ("v100-32g", {}, "math"),  # no bf16 kernel before sm80
    ("v100-32g", {"dtype": "float16"}, "efficient"),
    ("mi300x", {}, "flash"),  # AOTriton on gfx942
    ("cpu", {}, "cpu-flash"),
    ("cpu", {"dropout": True}, "math"),  # the CPU's flash loop has no dropout
])
def test_backend_follows_torchs_eligibility_rules(hw, changes, backend):
    assert sdpa_backend(_call(**changes), hardware.load(f"1x{hw}").gpu) == backend


class PlainTransformer(nn.Module):
    """nn.TransformerEncoderLayer blocks (dropout 0.1, nn.MultiheadAttention inside)."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(32000, 1024)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(1024, 32000)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.fixture(scope="module")
def plain():
    with torch.device("meta"):
        return PlainTransformer()


def test_a_plain_module_is_priced_with_flash_on_a100(plain):
    """The CPU trace alone ran MHA's SDPA on the math path (dropout): 20 passes over a
    16 x 2048 x 2048 score matrix per block. On an A100, torch runs flash."""
    inputs = (torch.zeros(1, SEQ, dtype=torch.long),)
    plan = planner.plan(plain, "8xa100-80g", global_batch=64, seq_len=SEQ, example_inputs=inputs, time_limit_s=1.0)
    assert any("attention priced as flash" in note for note in plan.notes)
    workload = resolve_workload(plain, seq_len=SEQ, dtype="bf16", example_inputs=inputs,
                                cluster=hardware.load("8xa100-80g"))
    block = next(l for l in workload.layers if l.kind == "block")
    scores = 16 * SEQ * SEQ * 2  # one bf16 score matrix per sequence
    assert block.attention_path == "fused" and block.act_attention_scores == 0
    math = block.other_path
    assert math.attention_path == "math" and math.act_attention_scores >= scores
    assert math.elementwise_bytes - block.elementwise_bytes > 15 * scores  # the passes over the scores, gone
    from planner.trace.workload_for import workload_for

    _, graph = workload_for(plain, seq_len=SEQ, example_inputs=inputs)
    largest = max(numel(d["shape"]) for _, d in graph.nodes() if d.get("layer", "").startswith("layers"))
    assert largest < 16 * SEQ * SEQ  # no op of the fused trace makes a score-sized tensor


def test_the_same_module_runs_the_math_path_where_torch_would(plain):
    inputs = (torch.zeros(1, SEQ, dtype=torch.long),)
    neutral = resolve_workload(plain, seq_len=SEQ, dtype="bf16", example_inputs=inputs)
    v100 = for_device(neutral, hardware.load("8xv100-32g").gpu)  # bf16 has no fused kernel before sm80
    cpu = for_device(neutral, hardware.load("cpu").gpu)  # dropout: the CPU's math path
    for workload in (v100, cpu):
        block = next(l for l in workload.layers if l.kind == "block")
        assert workload.attention_backend == "math" and block.attention_path == "math"
    back = for_device(v100, hardware.load("8xa100-80g").gpu)  # the choice is made again, either way
    assert next(l for l in back.layers if l.kind == "block") == next(l for l in neutral.layers if l.kind == "block")
    fast = planner.estimate(neutral, planner.plan(neutral, "8xa100-80g", global_batch=64, seq_len=SEQ,
                                                  time_limit_s=1.0))
    assert fast.mfu > 0.25
