"""The compile stack's saved activations: torch.compile's min-cut partition, traced and measured.

The planner prices what a compiled block saves for its backward as the minimum cut of its
traced forward under torch's own recomputation rules (planner/trace/partition.py). Here a block
compiled with the partition inductor runs (AOTAutograd's min-cut over inductor's decompositions,
`aot_eager_decomp_partition`, without generating C++: the same saved tensors, 216,576 bytes a
block either way on this model, in 2 s rather than 26 s) is measured with autograd's saved-tensor
hooks, which see what the compiled function saves, beside its eager self."""
import torch

from executor.runtime.models import build_model
from planner.trace.workload_for import workload_for

SEQ = 64
PARTITION_ONLY = "aot_eager_decomp_partition"  # inductor's decompositions and partition, eager kernels


def _saved_per_block(model, blocks, tokens) -> float:
    """Bytes of the distinct storages the blocks save for backward (parameters left out), per block."""
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    def enter(module, *_):
        module._saving = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        module._saving.__enter__()

    def leave(module, *_):
        module._saving.__exit__(None, None, None)

    hooks = [h for b in blocks for h in (b.register_forward_pre_hook(enter), b.register_forward_hook(leave))]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    model(tokens)
    for hook in hooks:
        hook.remove()
    return sum(n for ptr, n in seen.items() if ptr not in params) / len(blocks)


def test_a_compiled_llama_block_saves_what_the_partition_prices():
    torch.manual_seed(0)
    model = build_model("hf-llama-tiny", seed=0, trust_module=True)
    blocks = list(model.model.model.layers)
    tokens = torch.randint(0, 100, (1, SEQ))
    eager = _saved_per_block(model, blocks, tokens)
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=PARTITION_ONLY)
    model(tokens).sum().backward()  # compiled once, outside the hooks
    compiled = _saved_per_block(model, blocks, tokens)
    workload, _ = workload_for("hf-llama-tiny", seq_len=SEQ, dtype="fp32")
    block = next(layer for layer in workload.layers if layer.kind == "block")
    measured_share = compiled / eager
    print(f"saved per block: eager {eager:.0f} B, compiled {compiled:.0f} B ({measured_share:.3f}); "
          f"priced share {block.act_compiled_share:.3f}")
    assert measured_share < 0.9  # the SwiGLU product, the rotary halves and the norms' outputs are rebuilt
    assert abs(block.act_compiled_share - measured_share) <= 0.03
