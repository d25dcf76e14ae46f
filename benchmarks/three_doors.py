"""One architecture written three ways, priced on one cluster with the same pins.

    .venv/bin/python benchmarks/three_doors.py [--hw 8xa100-80g] [--seq-len 1024]

The catalog entry `llama-160m`, an HF `LlamaConfig` of its shapes, and the hand-written
module `examples/llama_module.py` (plain PyTorch). Prints per-block FLOPs, parameters and
saved activations, each door's attention kernel, and the step of the pinned layout.
`tests/test_three_doors.py` holds them within 1% (per block) and 5% (step).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import hardware
import planner
from planner.resolve import resolve_workload

PINS = {"dp": 8, "tp": 1, "pp": 1, "zero": 1, "micro_batch": 4, "recompute": "none"}


def llama_config():
    import transformers

    return transformers.LlamaConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                    num_attention_heads=12, num_key_value_heads=12, vocab_size=32000,
                                    max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                    architectures=["LlamaForCausalLM"])


def doors(seq_len: int) -> dict:
    """name -> (model, example inputs): the three ways of writing llama-160m."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ sits beside the packages
    from examples.llama_module import build

    with torch.device("meta"):
        module = build()
    return {"catalog llama-160m": ("llama-160m", None), "HF LlamaConfig": (llama_config(), None),
            "nn.Module (examples/llama_module.py)": (module, (torch.zeros(1, seq_len, dtype=torch.long),))}


def priced(hw: str, seq_len: int, global_batch: int = 64) -> list[dict]:
    cluster = hardware.load(hw)
    rows = []
    for name, (model, inputs) in doors(seq_len).items():
        workload = resolve_workload(model, seq_len=seq_len, dtype="bf16", example_inputs=inputs, cluster=cluster)
        block = next(layer for layer in workload.layers if layer.kind == "block")
        plan = planner.plan(model, cluster, global_batch=global_batch, seq_len=seq_len, example_inputs=inputs,
                            fixed=PINS, time_limit_s=2.0)
        rows.append({"door": name, "params": workload.params, "block_params": block.params,
                     "block_gflops": (block.matmul_flops + block.attention_flops) / 1e9,
                     "block_saved_mb": (block.act_replicated + block.act_tp_sharded + block.act_attention_scores) / 1e6,
                     "backend": workload.attention_backend, "step_s": plan.estimate.step_time_s,
                     "layout": plan.layout_tag})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hw", default="8xa100-80g")
    parser.add_argument("--seq-len", type=int, default=1024)
    args = parser.parse_args()
    rows = priced(args.hw, args.seq_len)
    print(f"llama-160m's shapes on {args.hw}, seq {args.seq_len}, pinned {PINS}")
    print("| door | params | block params | block GFLOP/seq | block saved MB/seq | attention | step s |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['door']} | {r['params']:,} | {r['block_params']:,} | {r['block_gflops']:.2f} | "
              f"{r['block_saved_mb']:.2f} | {r['backend']} | {r['step_s']:.4f} |")


if __name__ == "__main__":
    main()
