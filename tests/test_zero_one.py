"""ZeRO-1 holds the share of AdamW state the cost model prices, on every rank, and names it
so that DCP can reshard it (executor/apply/zero_one.py).

Each case runs in a fresh process under torch's fake process group (DTensor keeps the
sub-meshes of an earlier world), as the rank it names."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from executor.apply.zero_one import row_span

SCRIPT = r"""
import json, sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from executor.apply.zero_one import ZeroOneAdamW

rank, dp, tp = (int(a) for a in sys.argv[1:4])
dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dp * tp)
mesh = init_device_mesh("cpu", (1, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
torch.manual_seed(0)
# an embedding larger than every other weight together, as a language model's is
weights = [nn.Parameter(torch.randn(1000, 8)), nn.Parameter(torch.randn(30, 8)), nn.Parameter(torch.randn(7))]
if tp > 1:  # the first split by rows over tp, as a colwise linear is
    weights[1] = nn.Parameter(distribute_tensor(weights[1].data, mesh["tp"], [Shard(0)]))
optimizer = ZeroOneAdamW(weights, mesh["dp"], mesh, lr=1e-3)
for w in weights:
    w.grad = torch.ones_like(w)
optimizer.step()
state = {i: [v.numel() for k, v in s.items() if k != "step"] for i, s in enumerate(optimizer.inner.state.values())}
named = optimizer.state_dict()["state"]
optimizer.step()  # naming the state left the live state plain tensors
boxes = []
for i, entry in named.items():
    moment = entry["exp_avg"]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(moment.shape, moment.device_mesh, moment.placements)
    boxes.append([list(moment.shape), list(shape), list(offset), isinstance(moment, DTensor)])
whole = torch.arange(30 * 8, dtype=torch.float32).reshape(30, 8)
rows = optimizer.shards[1].to_rows(whole)
print(json.dumps({"state": [sum(v) for v in state.values()], "boxes": boxes, "rows": rows[:, 0].tolist()}))
"""


def _as_rank(rank: int, dp: int, tp: int = 1) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(rank), str(dp), str(tp)], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_row_spans_are_torch_chunks_split():
    assert [row_span(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [row_span(3, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]


@pytest.mark.parametrize("rank", [0, 3])
def test_every_rank_holds_a_dp_share_of_every_weight_the_embedding_too(rank):
    """Two moments of each weight's rows: 1000x8 splits 250 rows a rank, 30x8 into 8,8,8,6, the
    7-vector into 2,2,2,1. A rank owning whole weights would hold the embedding's 8,000."""
    got = _as_rank(rank, dp=4)
    rows = [250, 8 if rank < 3 else 6, 2 if rank < 3 else 1]
    assert got["state"] == [2 * r * width for r, width in zip(rows, (8, 8, 1))]
    firsts = [250 * rank, 8 * rank, 2 * rank]
    assert got["boxes"] == [[full, [r, *full[1:]], [f, *([0] * (len(full) - 1))], True]
                            for full, r, f in zip(([1000, 8], [30, 8], [7]), rows, firsts)]


@pytest.mark.parametrize("rank,first_row", [(0, 0), (1, 15), (2, 8), (3, 23)])
def test_a_tensor_parallel_weights_rows_are_split_again_and_named_where_they_lie(rank, first_row):
    """tp2 splits the 30 rows 15/15, dp2 each half 8/7: rank (dp d, tp t) holds rows
    15t + 8d onward, and its moments say so (DCP reads that box)."""
    got = _as_rank(rank, dp=2, tp=2)
    dp_rank = rank // 2
    count = 8 if dp_rank == 0 else 7
    assert got["boxes"][1] == [[30, 8], [count, 8], [first_row, 0], True]
    assert got["rows"] == [8.0 * (first_row + i) for i in range(count)]


REDUCTION = r"""
import json, sys, torch, torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore
from executor.apply.gradient_reduce import DataParallelGradients

rows = sys.argv[1] == "rows"
dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
calls = []
for name in ("all_reduce", "reduce_scatter_tensor", "reduce"):
    def spy(*args, _name=name, _real=getattr(dist, name), **kwargs):
        calls.append(_name)
        return _real(*args, **kwargs)
    setattr(dist, name, spy)
module = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 6, bias=False))  # 8 rows split 2 a rank, 6 rows 2,2,2,0
reducer = DataParallelGradients(module, dist.group.WORLD, 4, rows)
for p in module.parameters():
    p.grad = torch.full_like(p, 4.0)
reducer.sync()
mine = [p.grad.flatten().tolist() for p in module.parameters()]
print(json.dumps({"calls": calls, "grads": mine}))
"""


@pytest.mark.parametrize("mode", ["rows", "whole"])
def test_zero_one_reduce_scatters_the_rows_each_rank_steps_and_zero_zero_all_reduces(mode):
    """ZeRO-1's gradients: a reduce-scatter where the rows divide evenly, a reduce to each row's
    owner where they do not; this rank's rows averaged (the fake group returns the input, so
    4.0 / 4 ranks), the rest left as they are. ZeRO-0 all-reduces and averages everything."""
    out = subprocess.run([sys.executable, "-c", REDUCTION, mode], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if mode == "whole":
        assert got["calls"] == ["all_reduce"] * 3
        assert all(v == 1.0 for grad in got["grads"] for v in grad)
        return
    # weight 8x8 and bias 8: reduce-scatter; weight 6x8: a reduce per non-empty span (3)
    assert got["calls"] == ["reduce_scatter_tensor", "reduce_scatter_tensor", "reduce", "reduce", "reduce"]
    weight, bias, second = got["grads"]
    assert weight[16:32] == [1.0] * 16 and weight[:16] == [4.0] * 16  # rank 1 of 4: rows 2-3
    assert bias[2:4] == [1.0, 1.0] and bias[:2] == [4.0, 4.0]
    assert second[16:32] == [1.0] * 16 and second[32:] == [4.0] * 16
