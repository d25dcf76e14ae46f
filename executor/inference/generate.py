"""Greedy generation under the planner's tensor-parallel layout, with a KV cache.

`run_generation` starts `tp` gloo ranks (torch.multiprocessing.spawn, file://
rendezvous), shards the reference GPT with the same applier training uses
(`apply_tensor_parallel`: column-split Q/K/V and MLP-up, row-split O and
MLP-down, vocabulary-split embeddings and LM head, the last position's logits
gathered for the sampler), runs prefill and
then one decode step per new token with each rank caching its own K/V heads,
and returns the tokens, the per-step times and the single-process reference
(same weights, same cached forward, and the plain full-recompute forward),
so callers can check the tokens are equal. `predicted_decode_step` prices
the same layout with the serving cost model on a `cpu` hardware profile.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from layout.plan import Plan, StagePlan

__all__ = ["generate_cached", "generate_plain", "run_generation", "GenerationResult", "predicted_decode_step"]


def _serving_plan(model_name: str, tp: int, n_layers: int, prompt_len: int) -> Plan:
    """A one-stage plan carrying the TP degree (the applier's input)."""
    stage = StagePlan(start=0, end=n_layers + 2, recompute=["none"] * (n_layers + 2))
    return Plan(model=model_name, hardware=f"{tp}xcpu", global_batch=1, seq_len=prompt_len, dtype="fp32", dp=1, tp=tp,
                pp=1, micro_batch=1, stages=[stage])


def _forward_cached(model: nn.Module, tokens: torch.Tensor, cache: list, start: int) -> torch.Tensor:
    """Logits of the last position; appends this call's K/V (local heads under TP) to `cache`."""
    cfg = model.cfg
    b, s = tokens.shape
    head_dim = cfg.hidden // cfg.heads
    x = model.tok_emb(tokens) + model.pos_emb(torch.arange(start, start + s))
    for i, layer in enumerate(model.layers.values()):
        h = layer.ln_1(x)
        attn = layer.attn
        q, k, v = (p(h).view(b, s, -1, head_dim).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        if cache[i] is not None:
            k = torch.cat([cache[i][0], k], dim=2)
            v = torch.cat([cache[i][1], v], dim=2)
        cache[i] = (k, v)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        x = x + layer.mlp(layer.ln_2(x))
    logits = model.lm_head(model.ln_f(x[:, -1:, :]))[:, -1, :]
    # TP leaves the head's logits split over the vocabulary (training's loss reads them so); the
    # sampler needs them whole, as a serving engine gathers them
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


@torch.no_grad()
def generate_cached(model: nn.Module, prompt: torch.Tensor, new_tokens: int, *, sync=None) -> tuple[torch.Tensor, list[float], float]:
    """(generated ids [b, new_tokens], decode step seconds, prefill seconds), greedy."""
    cache: list = [None] * len(model.layers)
    t0 = time.perf_counter()
    logits = _forward_cached(model, prompt, cache, 0)
    prefill = time.perf_counter() - t0
    nxt = logits.argmax(-1, keepdim=True)
    out, steps = [nxt], []
    position = prompt.shape[1]
    for _ in range(new_tokens - 1):
        if sync:
            sync()
        t0 = time.perf_counter()
        logits = _forward_cached(model, nxt, cache, position)
        nxt = logits.argmax(-1, keepdim=True)
        steps.append(time.perf_counter() - t0)
        out.append(nxt)
        position += 1
    return torch.cat(out, dim=1), steps, prefill


@torch.no_grad()
def generate_plain(model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy generation recomputing the whole sequence each step (no cache): the ground truth."""
    seq = prompt
    for _ in range(new_tokens):
        nxt = model(seq)[:, -1, :].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq[:, prompt.shape[1]:]


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # from the TP ranks (rank 0; every rank's are checked equal)
    reference_cached: torch.Tensor  # one process, same cached forward
    reference_plain: torch.Tensor  # one process, full recompute
    ranks_agree: bool
    decode_step_s: float  # median over steps, slowest rank
    decode_step_s_single: float  # the same on one process
    prefill_s: float
    all_reduce_s: float  # median measured decode-sized all-reduce on these ranks
    tp_replicated: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return self.ranks_agree and torch.equal(self.tokens, self.reference_cached) and torch.equal(self.tokens, self.reference_plain)


def _worker(rank: int, world: int, init_file: str, model_name: str, prompt: torch.Tensor, new_tokens: int, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from executor.runtime.mesh import build_mesh, init_distributed
    from executor.runtime.models import build_model
    from executor.apply.tensor_parallel import apply_tensor_parallel
    from planner.trace.tp_styles import analyse_tp

    init_distributed(timeout_s=120, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = build_model(model_name, seed=0).eval()
        plan = _serving_plan(model_name, world, model.cfg.n_layers, prompt.shape[1])
        # A small odd-shaped example: analyse_tp matches tensors by shape, and batch*seq == hidden would confuse it.
        analysis = analyse_tp(model, torch.zeros(1, 3, dtype=torch.long))
        mesh = build_mesh(plan)
        model = apply_tensor_parallel(model, mesh, plan, analysis)
        generate_cached(model, prompt, 2)  # warm-up
        tokens, steps, prefill = generate_cached(model, prompt, new_tokens, sync=dist.barrier)
        probe = torch.zeros(prompt.shape[0], model.cfg.hidden)
        latencies = []
        for _ in range(30):  # what one decode-sized all-reduce costs here (the profile's alpha is an estimate)
            t0 = time.perf_counter()
            dist.all_reduce(probe)
            latencies.append(time.perf_counter() - t0)
        torch.save({"tokens": tokens, "steps": steps, "prefill": prefill, "all_reduce_s": statistics.median(latencies),
                    "replicated": getattr(model, "tp_replicated", [])}, os.path.join(out_dir, f"rank{rank}.pt"))
    except Exception as error:  # recorded so the caller can show it
        with open(os.path.join(out_dir, f"rank{rank}.error"), "w") as fh:
            fh.write(f"{type(error).__name__}: {error}")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_generation(model_name: str = "reference-tiny", *, tp: int = 2, prompt_len: int = 8, new_tokens: int = 16,
                   batch: int = 2, seed: int = 1) -> GenerationResult:
    """Generate with `tp` gloo ranks and with one process; return both and the step times."""
    import torch.multiprocessing as mp

    from executor.runtime.models import build_model, vocab_size

    reference = build_model(model_name, seed=0).eval()
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size(reference), (batch, prompt_len), generator=gen)
    out_dir = tempfile.mkdtemp(prefix="parallax-gen-")
    init_file = os.path.join(out_dir, "init")
    mp.spawn(_worker, args=(tp, init_file, model_name, prompt, new_tokens, out_dir), nprocs=tp, join=True)
    errors = [open(os.path.join(out_dir, f)).read() for f in sorted(os.listdir(out_dir)) if f.endswith(".error")]
    if errors:
        raise RuntimeError("generation failed: " + " | ".join(errors))
    results = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(tp)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generate_cached(reference, prompt, 2)
        ref_cached, ref_steps, _ = generate_cached(reference, prompt, new_tokens)
        ref_plain = generate_plain(reference, prompt, new_tokens)
    finally:
        torch.set_num_threads(threads)
    slowest = [max(r["steps"][i] for r in results) for i in range(new_tokens - 1)]
    return GenerationResult(
        tokens=results[0]["tokens"], reference_cached=ref_cached, reference_plain=ref_plain,
        ranks_agree=all(torch.equal(r["tokens"], results[0]["tokens"]) for r in results),
        decode_step_s=statistics.median(slowest), decode_step_s_single=statistics.median(ref_steps),
        prefill_s=max(r["prefill"] for r in results), all_reduce_s=max(r["all_reduce_s"] for r in results),
        tp_replicated=list(results[0]["replicated"]))


def predicted_decode_step(model_name: str, *, tp: int, prompt_len: int, new_tokens: int, batch: int,
                          hw: str | None = None, **overrides) -> float:
    """The serving cost model's decode step for the same layout on the `cpu` profile (fp32)."""
    import hardware
    from costmodel.inference import ServingModel
    from executor.runtime.models import build_model
    from planner.trace.workload_for import workload_for

    model = build_model(model_name, seed=0)
    workload, _ = workload_for(model, seq_len=prompt_len, dtype="fp32")
    cluster = hardware.load(hw or f"{max(tp, 1)}xcpu", **overrides)
    sm = ServingModel(workload, cluster, prompt_len=prompt_len, output_len=new_tokens, dtype="fp32")
    return sm.decode_iteration(tp, 1, batch)[0]
