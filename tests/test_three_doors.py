"""One model, one price, however it is written: the catalog entry, an HF config and a
hand-written nn.Module of llama-160m's shapes agree per block within 1% and per step within
5% (`benchmarks/three_doors.py` prints the table)."""
from __future__ import annotations

import pytest

from benchmarks.three_doors import priced


@pytest.fixture(scope="module")
def rows():
    return priced("8xa100-80g", 1024)


@pytest.mark.parametrize("key, tolerance", [("params", 0.01), ("block_params", 0.01), ("block_gflops", 0.01),
                                             ("block_saved_mb", 0.01), ("step_s", 0.05)])
def test_three_doors_agree(rows, key, tolerance):
    values = [r[key] for r in rows]
    assert max(values) <= min(values) * (1 + tolerance), {r["door"]: r[key] for r in rows}


def test_each_door_prices_a_fused_attention_kernel(rows):
    """The module calls SDPA with is_causal; HF does too for unpadded sequences (its trace
    builds no mask, as its real run): a fused kernel, no score matrix kept."""
    assert all(r["backend"] in ("flash", "efficient", "cudnn") for r in rows)
    assert len({r["layout"] for r in rows}) == 1


def test_a_model_given_by_its_dimensions_is_priced_as_the_same_model_named():
    """`planner.plan(TransformerDims(...))` traces the architecture the dimensions describe
    (planner/trace/dims.py): llama-3-8b by its dimensions costs what the catalog entry costs, on
    every stack."""
    import planner
    from costmodel.transformer import TransformerDims

    dims = TransformerDims(n_layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, gated_mlp=True,
                           vocab=128256, seq_len=4096, biases=False, learned_positions=False, name="my-8b")
    for stack in ("eager", "compile", "fused"):
        kw = dict(global_batch=16, seq_len=4096, time_limit_s=2,
                  fixed={"dp": 8, "tp": 1, "pp": 1, "zero": 3, "micro_batch": 2, "recompute": "full", "stack": stack})
        by_dims, by_name = planner.plan(dims, "8xh100-sxm", **kw), planner.plan("llama-3-8b", "8xh100-sxm", **kw)
        assert by_dims.model == "my-8b"
        assert by_dims.estimate.step_time_s == pytest.approx(by_name.estimate.step_time_s, rel=0.02), stack
        assert by_dims.estimate.peak_memory_bytes == pytest.approx(by_name.estimate.peak_memory_bytes, rel=0.02), stack
