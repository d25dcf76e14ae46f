"""Is a step bound by the host that issues its kernels? A probe for the op policy's GPU time.

    python benchmarks/host_bound_probe.py                 # on the GPU: llama-3.2-1b, 2 x 2 x 2048 tokens
    python benchmarks/host_bound_probe.py --device cpu    # the same loop on llama-160m at 128 tokens

On an H200 the op recompute policy measured 435 ms a step where no recomputation
measured 214 and full recomputation 288 (benchmarks/data/h200_gpu_runs.csv). Its
recompute runs fewer kernels than full, so the extra time is not the device's. This
probe tells host from device: for each policy it times the host's issue of a step
(until the last backward returns) apart from the synchronised step, and counts the
aten ops the step dispatches. A step whose issue time reaches its step time is
host-bound. It also times one small op issued eagerly, under an empty dispatch mode and
under the op policy's checkpoint, which is the per-op host cost a price would need.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.distributed._composable import checkpoint  # noqa: E402
from torch.utils.checkpoint import checkpoint as checkpoint_call  # noqa: E402

from executor.apply.layers import layer_map  # noqa: E402
from executor.apply.recompute import _save_products, keep_products  # noqa: E402
from executor.measure.microbench import CountOps, _sync  # noqa: E402
from executor.runtime.models import build_model  # noqa: E402

SETTINGS = {"cuda": ("llama-3.2-1b", 2048, 2, torch.bfloat16), "cpu": ("llama-160m", 128, 1, None)}


def _model(name: str, policy: str, device: str):
    model = build_model(name).to(device)
    lmap = layer_map(model)
    for block in lmap.block_names:
        sub = model.get_submodule(block)
        if policy == "full":
            checkpoint(sub, use_reentrant=False)
        elif policy == "op":
            keep_products(sub)
    return model


def _step(model, tokens, micro_batches: int, dtype, device: str) -> float:
    """One step's forward and backward; returns the host's issue time (s)."""
    started = time.perf_counter()
    for xs in tokens.chunk(micro_batches):
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            logits = model(xs)
            logits = logits.logits if hasattr(logits, "logits") else logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), xs.flatten())
        loss.backward()
    return time.perf_counter() - started


def policy_row(name: str, policy: str, device: str, seq_len: int, micro: int, dtype, steps: int) -> str:
    model = _model(name, policy, device)
    vocab = model.get_input_embeddings().num_embeddings if hasattr(model, "get_input_embeddings") else 32000
    tokens = torch.randint(0, vocab, (2 * micro, seq_len), device=device)
    for _ in range(2):
        _step(model, tokens, 2, dtype, device)
    _sync(device)
    counter = CountOps()
    with counter:
        _step(model, tokens, 2, dtype, device)
    _sync(device)
    issue, total = [], []
    for _ in range(steps):
        started = time.perf_counter()
        issue.append(_step(model, tokens, 2, dtype, device))
        _sync(device)
        total.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    issue_ms, step_ms = 1e3 * min(issue), 1e3 * min(total)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return (f"{policy:10} {counter.ops:8,} {issue_ms:10.1f} {step_ms:10.1f} {issue_ms / step_ms:8.0%} "
            f"{1e3 * issue_ms / counter.ops:8.1f}  steps: {', '.join(f'{1e3 * t:.1f}' for t in total)}")


def per_op_host_us(device: str, n: int = 4000) -> dict[str, float]:
    """Host microseconds to issue one small op: eager, under an empty dispatch mode, and inside
    the op policy's checkpoint (its caching dispatch mode and policy call)."""
    x = torch.ones(256, device=device, requires_grad=True)

    def chain(t):
        for _ in range(n):
            t = t * 1.0001
        return t

    def timed(fn) -> float:
        fn()
        _sync(device)
        started = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - started
        _sync(device)
        return 1e6 * elapsed / n

    def under_mode():
        with CountOps():  # a dispatch mode that only counts
            chain(x)

    return {"eager": timed(lambda: chain(x)), "dispatch mode": timed(under_mode),
            "op policy": timed(lambda: checkpoint_call(chain, x, use_reentrant=False, context_fn=_save_products))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=sorted(SETTINGS), default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--policies", default="none,op,full")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name, seq_len, micro, dtype = SETTINGS[device]
    print(f"{device}: {name}, 2 micro-batches of {micro} x {seq_len}, autocast {dtype}")
    print("per-op host issue (us): " + ", ".join(f"{k} {v:.1f}" for k, v in per_op_host_us(device).items()))
    print(f"{'policy':10} {'aten ops':>8} {'issue ms':>10} {'step ms':>10} {'issue %':>8} {'us/op':>8}")
    for policy in args.policies.split(","):
        print(policy_row(name, policy, device, seq_len, micro, dtype, args.steps), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
