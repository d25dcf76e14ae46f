"""Tracing: HF families at reduced depth, FLOP/param checks, ONNX, TP split, errors."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from hardware.errors import ModelError
from planner.trace.models.catalog import hf_config, list_models, model_config, param_count
from planner.trace.models.reference_gpt import GPTConfig, ReferenceGPT
from planner.trace.module import trace_module
from planner.trace.workload_for import to_workload, workload_for

pytest.importorskip("transformers")

SEQ = 256


@pytest.fixture(scope="module")
def llama():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return workload_for("llama-3-8b", seq_len=SEQ)


def _blocks(workload):
    return [seg for seg in workload.segments if seg.layer.kind == "block"]


def test_catalog():
    assert {"gpt2", "llama-3-405b", "t5-large", "gpt-1t"} <= set(list_models())
    assert model_config("llama-3-405b")["num_hidden_layers"] == 126
    with pytest.raises(ModelError, match="llama-3-8b"):
        model_config("llama3-8b")
    assert abs(param_count(model_config("llama-3-8b")) - 8.03e9) / 8.03e9 < 0.01


@pytest.mark.parametrize("name", ["gpt2", "llama-3-8b", "mistral-7b", "bert-large", "t5-large"])
def test_hf_families_trace_to_real_depth(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        workload, graph = workload_for(name, seq_len=SEQ)
    cfg = hf_config(name)
    expected = cfg.num_hidden_layers + (getattr(cfg, "num_decoder_layers", 0) if cfg.is_encoder_decoder else 0)
    assert workload.n_blocks == expected
    assert all(len(g["members"]) == 2 for g in graph.meta["blocks"])  # traced at depth 2
    assert abs(workload.params - param_count(model_config(name))) / workload.params < 0.01


def test_llama_block_flops(llama):
    """Convention: matmul = 2·s·(2h² + 2·h·kv·d + 3hf); attention = 4·s²·h (full square, as torch counts)."""
    workload, _ = llama
    h, f, kv_dim, s = 4096, 14336, 8 * 128, SEQ
    block = _blocks(workload)[0].layer
    gemm = 2 * s * (2 * h * h + 2 * h * kv_dim + 3 * h * f)
    assert abs(block.matmul_flops - gemm) / gemm < 0.05
    assert abs(block.attention_flops - 4 * s * s * h) / (4 * s * s * h) < 0.05
    # the weights' smallest dimensions, FLOP-weighted (harmonic); the tokens' is the cost model's
    effective = (2 * h * h + 2 * h * kv_dim + 3 * h * f) / (4 * h + 3 * f)
    assert block.matmul_min_dim == pytest.approx(effective, abs=1)
    assert workload.flash_attention and workload.heads == 32 and workload.kv_heads == 8


def test_param_counts(llama):
    assert abs(llama[0].params - 8.03e9) / 8.03e9 < 0.01
    gpt2, _ = workload_for("gpt2", seq_len=128)
    assert abs(gpt2.params - 124.4e6) / 124.4e6 < 0.01
    # a mixture of experts counts every expert (Mixtral 8x7B: 46.7B, Jiang et al. 2024), as its trace does
    assert abs(param_count(model_config("mixtral-8x7b")) - 46.7e9) / 46.7e9 < 0.01
    tiny, _ = workload_for("hf-mixtral-tiny", seq_len=16)
    assert tiny.params == param_count(model_config("hf-mixtral-tiny"))


def test_tp_classification(llama):
    workload, graph = llama
    styles = graph.tp_styles
    for name in ("q_proj", "k_proj", "v_proj"):
        assert styles[f"model.layers.*.self_attn.{name}"] == "colwise"
    assert styles["model.layers.*.mlp.up_proj"] == styles["model.layers.*.mlp.gate_proj"] == "colwise"
    assert styles["model.layers.*.self_attn.o_proj"] == styles["model.layers.*.mlp.down_proj"] == "rowwise"
    block = _blocks(workload)[0].layer
    assert block.tp_allreduces_fwd == 2 and block.tp_shardable
    assert block.tp_comm_bytes == SEQ * 4096 * 2
    assert block.act_tp_sharded > 0 and block.act_replicated > 0 and block.act_input == SEQ * 4096 * 2


def test_reference_gpt():
    cfg = GPTConfig(n_layers=3, hidden=64, heads=4, vocab_size=128, max_seq_len=64)
    workload, graph = workload_for(ReferenceGPT(cfg), seq_len=64, dtype="fp32")
    assert workload.n_blocks == 3 and workload.hidden == 64 and workload.heads == 4
    assert workload.params == sum(p.numel() for p in ReferenceGPT(cfg).parameters())
    block = _blocks(workload)[0].layer
    assert block.matmul_flops == 2 * 64 * (4 * 64 * 64 + 2 * 64 * 256)
    assert block.tp_allreduces_fwd == 2 and graph.tp_styles["layers.*.attn.o_proj"] == "rowwise"
    assert graph.total("flops", "backward") > graph.total("flops")  # backward traced too


def test_onnx_path(tmp_path):
    cfg = GPTConfig(n_layers=2, hidden=64, heads=4, vocab_size=128, max_seq_len=32)
    model = ReferenceGPT(cfg).eval()
    path = tmp_path / "gpt.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(1, 32, dtype=torch.long),), str(path), dynamo=True, verbose=False)
    workload, graph = workload_for(str(path), seq_len=32)
    assert workload.n_blocks == 2
    block = _blocks(workload)[0].layer
    assert block.matmul_flops == 2 * 32 * (4 * 64 * 64 + 2 * 64 * 256)
    assert block.tp_allreduces_fwd == 2 and graph.tp_styles["layers.*.mlp.up_proj"] == "colwise"
    assert block.act_replicated + block.act_tp_sharded > 0
    # the exporter may merge identical initializers (equal LayerNorm weights): allow a small gap
    assert abs(graph.params - sum(p.numel() for p in model.parameters())) < 0.02 * graph.params


@torch.library.custom_op("parallax_test::fancy_matmul", mutates_args=())
def fancy_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


@fancy_matmul.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1])


def _fancy_backward(ctx, grad):
    a, b = ctx.saved_tensors
    return grad @ b.t(), a.t() @ grad


def _fancy_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


fancy_matmul.register_autograd(_fancy_backward, setup_context=_fancy_setup)


class _Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 8))

    def forward(self, x):
        return fancy_matmul(x, self.w)


def test_op_without_flop_formula_is_reported():
    with pytest.warns(UserWarning, match="no FLOP formula"):
        graph = trace_module(_Custom(), (torch.randn(4, 16),), dtype="fp32")
    assert len([w for w in graph.warnings if "fancy_matmul" in w]) == 1
    assert graph.total("flops") == 2 * 4 * 8 * 16  # estimated, not silently 0


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 8)

    def forward(self, x):
        y = self.gate(x)
        if y.sum() > 0:  # needs real values
            return y
        return -y


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _DataDependent()

    def forward(self, x):
        return self.inner(x)


def test_untraceable_module_gives_model_error():
    with pytest.raises(ModelError) as info:
        trace_module(_Outer(), (torch.randn(2, 8),))
    assert "inner" in str(info.value) and "Traceback" not in str(info.value)


def test_n_blocks_override(llama):
    _, graph = llama
    assert to_workload(graph, n_blocks=4).n_blocks == 4


def test_a_cached_workload_is_the_traced_one_and_keyed_by_its_config(tmp_path, monkeypatch):
    """The CLI reads a named model's workload from disk on later calls: the same Workload,
    and a different entry for another sequence length or config."""
    import planner.trace.cache as cache
    from planner.trace.workload_for import workload_for

    monkeypatch.setattr(cache, "CACHE_DIR", tmp_path)
    traced = workload_for("llama-160m", seq_len=256)[0]
    calls = []

    def trace():
        calls.append(1)
        return traced

    first = cache.cached_workload("llama-160m", 256, "bf16", trace)
    again = cache.cached_workload("llama-160m", 256, "bf16", lambda: pytest.fail("traced again"))
    assert first == again == traced and calls == [1]
    cache.cached_workload("llama-160m", 512, "bf16", trace)
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, '
                      '"num_attention_heads": 4, "vocab_size": 100}')
    cache.cached_workload(str(config), 256, "bf16", trace)
    assert calls == [1, 1, 1] and len(list(tmp_path.glob("*.json"))) == 4  # three entries and the config
    # the key covers the tracing code itself: a changed tracer never reads an old entry
    names = {path.name for path in cache.fingerprinted_files()}
    assert {"module.py", "hf.py", "to_workload.py", "blocks.py", "build.py", "executable.py", "workload.py"} <= names


class _PointwiseChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.b((self.a(x) * 2.0 + 1.0) * 3.0)


def test_a_fused_pointwise_chain_reads_its_input_once_and_writes_its_output_once():
    from planner.trace.fusion import fused_elementwise_bytes
    from planner.trace.to_workload import nbytes

    og = trace_module(_PointwiseChain(), (torch.randn(8, 64),), dtype="fp32")
    members = {n for n, _ in og.nodes()}
    chain = [d for _, d in og.nodes() if d["op"] in ("aten.mul.Tensor", "aten.add.Tensor")]
    loss = [d for _, d in og.nodes() if d["op"] == "aten.sum.default"]
    tensor = 8 * 64 * 4
    assert len(chain) == 3 and sum(d["bytes"] for d in chain) == 3 * 2 * tensor  # eager: three kernels
    # fused: the first GEMM's output read once, the product (the second GEMM's saved input) written once
    assert fused_elementwise_bytes(og, members, nbytes) == 2 * tensor + loss[0]["bytes"]


def test_compile_and_fused_stacks_price_fused_pointwise_traffic(llama):
    import hardware
    from costmodel.compute import Context, forward_parts

    workload, _ = llama
    cluster = hardware.load("8xh100-sxm")
    for layer in workload.layers:
        assert layer.elementwise_fused_bytes <= layer.elementwise_bytes
    block = _blocks(workload)[0].layer
    assert block.elementwise_fused_bytes < 0.8 * block.elementwise_bytes  # HF's unfused RMSNorm, RoPE, SwiGLU
    kw = dict(cluster=cluster, dtype="bf16", tp=1, sp=False, micro_batch=1, tp_group=None)
    eager = forward_parts(block, Context(**kw))
    # compile fuses the traced chains as they are; the fused stack's kernels also read and write 16 bits
    assert block.elementwise_kernel_bytes < block.elementwise_fused_bytes
    for stack, traffic in (("compile", block.elementwise_fused_bytes), ("fused", block.elementwise_kernel_bytes)):
        fused = forward_parts(block, Context(stack=stack, **kw))
        assert fused[:2] == eager[:2]
        assert fused[2] == pytest.approx(eager[2] * traffic / block.elementwise_bytes)


def test_dtensor_sp_keeps_each_gathered_linear_input_whole(llama):
    """Under SP a column-split linear saves its all-gathered input: q, k, v, gate and up each
    their own whole copy (the eager stack), where Megatron's SP (fused) saves the shards."""
    from costmodel.memory import activation_bytes

    workload, _ = llama
    block = _blocks(workload)[0].layer
    s, h = SEQ, 4096
    assert block.act_sp_whole >= 5 * s * h * 2  # five gathered bf16 inputs (and the causal mask)
    assert block.act_sp_dropped >= 2 * s * h * 2  # the two norm outputs they replace
    kw = dict(recompute="none", tp=4, sp=True, micro_batch=1)
    eager, fused = activation_bytes(block, stack="eager", **kw), activation_bytes(block, stack="fused", **kw)
    kept = (block.act_replicated + block.act_tp_sharded) / 4  # both stacks' SP shards, before the fused kernels
    # the fused stack's kernels also keep only the min-cut share of those (costmodel.memory.fused_saved_bytes)
    assert eager - fused == pytest.approx(block.act_sp_whole - block.act_sp_dropped / 4
                                          + (1 - block.act_compiled_share) * kept)
    assert activation_bytes(block, "none", tp=4, sp=False, micro_batch=1) > eager > fused


def test_the_loss_temporaries_are_the_fp32_logits_and_their_gradients(llama):
    """The head's worst moment as traced on one device: log-softmax's fp32 gradient in and out,
    beside the saved log-probabilities. Under TP each rank holds its vocabulary shard: of those
    on the fused stack (Megatron's vocabulary-parallel cross-entropy), of the three fp32 tensors
    torch's loss parallelism keeps in its backward under DTensor (`costmodel.loss`)."""
    from costmodel.memory import transient_bytes

    workload, _ = llama
    head = workload.layers[-1]
    logits_fp32 = SEQ * 128256 * 4
    assert head.act_transient == pytest.approx(2 * logits_fp32, rel=0.05)
    assert head.act_transient_tp == "S"
    kw = dict(tp=4, sp=True, micro_batch=2)
    assert transient_bytes(head, stack="fused", **kw) == pytest.approx(2 * head.act_transient / 4)
    assert transient_bytes(head, stack="eager", **kw) == pytest.approx(2 * 3 * logits_fp32 / 4)
    assert transient_bytes(head, stack="eager", **{**kw, "tp": 1}) == pytest.approx(2 * head.act_transient)


def test_the_autocast_trace_keeps_what_a_run_over_fp32_weights_under_autocast_saves():
    """A plan that casts its weights per use runs the model over fp32 weights under autocast:
    the embedding's output, the residual stream, norms and rotary stay fp32. The workload's
    `under_autocast` profiles keep what such a run saves for backward (weights and their cast
    copies aside, priced apart); the bf16 trace's keep about a sixth less."""
    from costmodel.memory import activation_bytes
    from executor.runtime.models import build_model
    from planner.trace.hf import masks_as_in_a_real_run
    from planner.trace.module import _default_loss
    from torch._subclasses.fake_tensor import FakeTensorMode

    seq = 512
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        model = build_model("llama-3.2-1b")
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    copies = 2 * sum(p.numel() for p in model.parameters() if p.dim() == 2)  # each GEMM's bf16 weight
    saved = {}

    def pack(t):
        if t.untyped_storage()._cdata not in params:
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with fake, masks_as_in_a_real_run(), torch.autocast("cpu", dtype=torch.bfloat16):
        tokens = torch.zeros(1, seq, dtype=torch.long)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _default_loss(model(tokens), tokens)
    measured = sum(saved.values()) - copies
    workload, _ = workload_for("llama-3.2-1b", seq_len=seq, dtype="bf16")
    kw = dict(tp=1, sp=False, micro_batch=1)
    autocast = sum(activation_bytes(s.layer.under_autocast, "none", **kw) * s.count for s in workload.segments)
    bf16 = sum(activation_bytes(s.layer, "none", **kw) * s.count for s in workload.segments)
    assert autocast == pytest.approx(measured, rel=0.03), (autocast / 2**20, measured / 2**20)
    assert bf16 < 0.9 * measured
