"""Serving cost model: memory, prefill, decode and $ of one replica layout.

Everything comes from the same `Workload` the training cost model prices
(traced at `seq_len = prompt_len`) and from the hardware profile:

* Weights per GPU: the heaviest pipeline stage's parameters, TP-split where
  the layer is shardable (as in training), in the workload's dtype.
* KV cache per token: 2 (K and V) * blocks * kv_heads * head_dim * bytes,
  grouped-query aware. TP splits the KV heads; once tp exceeds kv_heads each
  rank keeps one (replicated) KV head, as Megatron/vLLM do.
* Prefill of one prompt: the per-layer forward of `costmodel.compute`
  (GEMMs at the calibrated GEMM efficiency, attention core, memory-bound
  ops) against reading the weights once, plus TP all-reduces of the prompt's
  activations; only the last position goes through the LM head.
* Decode step of b sequences at mean context L, per layer: a roofline per
  kernel, as they run one after another: the GEMMs' max(compute, weight
  read), the attention's max(its compute, the KV cache read), the fused
  activations' traffic, plus the layer's TP all-reduces of
  b * hidden bytes (`costmodel.collectives`, alpha-beta: at small b the
  latency term dominates) and PP point-to-point hops.
* Pipeline decode keeps k = min(pp, B) micro-batches in flight; one decode
  iteration (every sequence gains a token) takes
  max(k * slowest stage, sum of stages + pp hops).
* Continuous batching: a sequence lives `output_len` iterations, so
  B / output_len prompts join each iteration on average; TPOT is the mean
  iteration (`mean_iteration`) and TTFT = prefill latency + half a decode
  iteration (the wait to join), plus, where the prompt shares its iteration
  with the other sequences' decodes, what they add to it. An engine that
  batches prompts with the decodes (TensorRT-LLM, vLLM's V1 engine) runs an
  iteration carrying a prompt as one pass: each layer reads its weights once
  and takes the longer of the memory traffic and the decode's and the
  prompt's compute together. One that prefills in passes of its own (vLLM V0,
  SGLang by default, LMDeploy's TurboMind) pays the prompt's pass beside the
  decode's (hardware/engines.py, `mixes_prefill`).

* Engines fuse their pointwise chains: the activations' traffic is the fused
  stack's (`compute.elementwise_traffic`).
* The KV cache's dtype is a dimension (`kv_dtype`: 16-bit, or fp8 at 1 byte).
* A closed loop of more requests than the KV cache holds queues the rest
  (planner.serving_points.queued): the batch is what fits, the wait is in TTFT.

* An engine family (hardware/engines.py), where named, sets the HBM efficiency a
  decode streams at, adds its fitted overhead to each iteration and caps the running
  sequences at its default.

* The KV cache is held in pages of the engine's block size (KV_BLOCK_TOKENS where a family
  states none): a sequence's last page is held whole.

* A mixture-of-experts layer reads only the experts its tokens are routed to: a decode step of
  b sequences the share 1 - (1 - k/E)^b of its expert weights (`costmodel.experts`, even
  routing), a prefill nearly all of them. TP splits each expert, as the engines' fused MoE
  kernels do, in its weights and in its GEMMs.

* Quantization (hardware/engines.py's WeightQuantization) is priced in bytes: its packed bits
  and each group's scale and zero point are what the weights take and what a decode streams.
  Weight-only methods (int8, int4) run their GEMMs at the activations' 16-bit rate, W8A8
  (w8a8) the blocks' at the GPU's INT8 rate.

Not modelled here: speculative decoding, queueing
beyond Little's law (simulate/serving.py plays requests one by one for
percentiles); the engines' own all-reduce kernels are
priced as the collective library's, plus whatever a family's fitted overhead holds.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

from pydantic import BaseModel, ConfigDict, Field

from hardware.engines import ServingEngine, WeightQuantization
from hardware.schema import Cluster

from . import collectives as coll
from .compute import (Context, attention_efficiency, elementwise_traffic, forward_parts, memory_bandwidth,
                      tp_collective_time)
from .experts import ExpertLoad, expert_load, weights_read
from .terms import GIB
from .serving_memory import (kv_bytes_per_token, kv_bytes_per_token_per_gpu, kv_per_token_per_block_rank,
                             params_on_tp_rank, served_weight_bytes, stage_runs_of, weight_bytes_per_gpu)
from .workload import LayerProfile, Workload

# The share of each GPU a serving engine leaves out of its weights and KV cache: vLLM's
# `gpu_memory_utilization` defaults to 0.9 (vLLM engine arguments), the setting the plan exports
# (formats/serving.py: memory_fraction).
SERVING_MEMORY_RESERVE = 0.10

__all__ = ["ServingEstimate", "ServingLayout", "serving_model", "ServingModel"]


# The engines page the KV cache in blocks of tokens: vLLM's --block-size defaults to 16 on CUDA (its
# engine arguments, choices 8, 16 and 32). A family states its own where sourced (hardware/engines.py's
# kv_block_tokens: TensorRT-LLM 32, LMDeploy 64); the roofline and the others are priced at vLLM's.
KV_BLOCK_TOKENS = 16


class ServingEstimate(BaseModel):
    """Predicted figures of one replica layout at one operating point (batch per replica)."""

    model_config = ConfigDict(extra="forbid")

    tp: int
    pp: int
    batch: float = Field(description="concurrent sequences per replica (mean; fractional under a request rate)")
    context_len: float = Field(description="mean context length a decode step attends over")
    weights_bytes_per_gpu: float
    kv_bytes_per_token: float = Field(description="whole model, all ranks: 2*blocks*kv_heads*head_dim*bytes")
    kv_bytes_per_token_per_gpu: float
    kv_cache_bytes_per_gpu: float = Field(description="KV of `batch` full-length sequences on the heaviest stage")
    workspace_bytes_per_gpu: float
    memory_capacity_bytes: float
    max_concurrent_sequences: int = Field(description="per replica, at prompt_len + output_len tokens each")
    queued_sequences: float = Field(0.0, ge=0, description="requests of a closed loop waiting beyond those the KV "
                                    "cache holds (their wait is in ttft_s)")
    prefill_s: float = Field(description="latency of one prompt's prefill")
    decode_step_s: float = Field(description="one decode iteration (every sequence gains a token), no prefill")
    tpot_s: float = Field(description="time per output token incl. amortised prefills (mean = p50 with chunked prefill)")
    ttft_s: float
    tokens_per_s_replica: float
    tokens_per_s_per_gpu: float
    decode_breakdown_s: dict[str, float] = Field(description="one decode iteration on the slowest stage, by part")
    usd_per_million_output_tokens: float | None = None
    price_note: str = ""

    @property
    def fits(self) -> bool:
        return self.batch <= self.max_concurrent_sequences and self.max_concurrent_sequences >= 1


@dataclass(frozen=True)
class ServingLayout:
    tp: int
    pp: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp


def batched_tokens(prompt_len: int, max_sequences: int, output_len: int) -> int:
    """Tokens one engine step may take (vLLM's --max-num-batched-tokens, SGLang's chunked-prefill
    size, TensorRT-LLM's max_num_tokens): every running sequence's next token beside the prompts
    that join a full batch's iteration, at least one whole prompt. A sequence lives `output_len`
    iterations, so max_sequences / output_len prompts join each, as `ServingModel.mean_iteration`
    prices them; a smaller budget would queue the prompts that price assumes."""
    joining = max(1, math.ceil(max_sequences / output_len))
    return joining * prompt_len + max_sequences


# --- time -----------------------------------------------------------------------

class ServingModel:
    """Prices (tp, pp, batch) layouts of one workload on one cluster."""

    def __init__(self, workload: Workload, cluster: Cluster, *, prompt_len: int, output_len: int,
                 dtype: str = "bf16", memory_reserve: float = SERVING_MEMORY_RESERVE,
                 kv_dtype: str | None = None, engine: ServingEngine | None = None,
                 quantization: WeightQuantization | None = None, expert_parallel: bool = False) -> None:
        self.w, self.cluster, self.dtype, self.kv_dtype = workload, cluster, dtype, kv_dtype
        self.quantization = quantization  # fewer bytes streamed; W8A8 runs the blocks' GEMMs in int8
        self.block_gemms = quantization.gemm_dtype if quantization is not None else None
        self.expert_parallel = expert_parallel  # each TP rank holds whole experts (`costmodel.experts`)
        engine = engine or ServingEngine()  # an engine family on this GPU (hardware/engines.py), or the roofline
        fit, self.sequence_cap, self.engine_name = engine.fit, engine.max_sequences, engine.name
        self.kv_block_tokens = engine.kv_block_tokens or KV_BLOCK_TOKENS
        self.mixes_prefill = engine.mixes_prefill  # prompt chunks batched with the decodes, or passes of their own
        self.prompt_len, self.output_len = prompt_len, output_len
        self.s = workload.seq_len  # the trace length all per-sequence figures refer to
        self.reserve = memory_reserve
        gpu = cluster.gpu
        self.attention_peak = gpu.peak_flops("bf16" if dtype == "fp8" else dtype)
        self.weight_bytes = served_weight_bytes(workload, dtype, quantization)
        self.hbm = memory_bandwidth(gpu, fit.hbm_efficiency if fit is not None else None)
        self.step_overhead = engine.step_overhead_ms / 1e3
        self.capacity = gpu.hbm_gb * GIB * (1 - memory_reserve)
        # TensorRT-LLM's fraction is of what loading left free: the CUDA context is not free
        self.kv_of_free = engine.kv_memory_of == "free"
        self.loaded_runtime = gpu.runtime_memory.cuda_context_mib * 2**20 if gpu.runtime_memory else 0.0
        self._stage_cache: dict[int, list] = {}
        self._prefill_cache: dict[tuple[int, int], list[float]] = {}
        self._prompt_cache: dict[tuple[int, int], tuple[float, float]] = {}
        self._gemm_cache: dict[tuple[int, int, float], float] = {}

    def with_expert_parallel(self, on: bool) -> "ServingModel":
        """This model with each TP rank holding whole experts (on) or a slice of every expert."""
        if on == self.expert_parallel:
            return self
        twin = copy.copy(self)
        twin.expert_parallel, twin._prefill_cache, twin._prompt_cache, twin._gemm_cache = on, {}, {}, {}
        return twin

    def stages(self, pp: int):
        if pp not in self._stage_cache:
            self._stage_cache[pp] = stage_runs_of(self.w, pp)
        return self._stage_cache[pp]

    def ctx(self, tp: int, batch: float = 1) -> Context:
        """Engines run their pointwise chains as fused kernels (vLLM's and SGLang's custom ops,
        TensorRT-LLM's plugins), as the fused training stack does."""
        return Context(cluster=self.cluster, dtype=self.dtype, tp=tp, sp=False, micro_batch=batch,
                       tp_group=coll.group_of(tp, 1, self.cluster), stack="fused", block_gemms=self.block_gemms)

    def pp_inter_node(self, tp: int) -> bool:
        return tp >= self.cluster.gpus_per_node

    def hop(self, tp: int, tokens: float) -> float:
        """One pipeline hop of `tokens` hidden vectors, scattered over the TP ranks."""
        nbytes = tokens * (self.w.hidden or 0) * self.w.dtype_bytes / tp
        return coll.point_to_point(nbytes, self.cluster, inter_node=self.pp_inter_node(tp))

    # memory
    def workspace(self, tp: int, pp: int) -> float:
        """Transient activations of one prompt's prefill through the largest layer (nothing is kept)."""
        biggest = 0.0
        for runs in self.stages(pp):
            for layer, _ in runs:
                if layer.kind == "head":  # only the last position's logits (fp32)
                    live = 4.0 * (self.w.vocab or 0) / (tp if layer.tp_shardable else 1)
                else:
                    live = layer.act_replicated + layer.act_tp_sharded / (tp if layer.tp_shardable else 1)
                biggest = max(biggest, live * self.prompt_len / self.s)
        return biggest

    def weights_per_gpu(self, tp: int, pp: int) -> float:
        """Bytes of served weights on each GPU of the heaviest stage."""
        return weight_bytes_per_gpu(self.w, tp, pp, self.dtype, self.quantization)

    def kv_budget(self, tp: int, pp: int) -> float:
        """Bytes the KV cache takes on each GPU of the replica, beside the weights and a prefill's
        workspace: the engine's share of the whole GPU less those (vLLM, SGLang), or its share of
        what they and the CUDA context leave free (TensorRT-LLM)."""
        held = self.weights_per_gpu(tp, pp) + self.workspace(tp, pp)
        if self.kv_of_free:
            return (1 - self.reserve) * (self.cluster.gpu.hbm_gb * GIB - self.loaded_runtime - held)
        return self.capacity - held

    def kv_token_capacity(self, tp: int, pp: int) -> float:
        """Tokens the KV cache holds on each GPU of the replica (`kv_budget`)."""
        free = self.kv_budget(tp, pp)
        per_token = kv_bytes_per_token_per_gpu(self.w, tp, pp, self.kv_dtype)
        return max(0.0, free / per_token) if per_token > 0 else 0.0

    def max_sequences(self, tp: int, pp: int) -> int:
        """Sequences the KV cache holds, each in whole pages (a partly filled last page is held whole),
        at most the engine's cap."""
        pages = -(-(self.prompt_len + self.output_len) // self.kv_block_tokens)
        room = int(self.kv_token_capacity(tp, pp) // (pages * self.kv_block_tokens))
        return min(room, self.sequence_cap) if self.sequence_cap is not None else room

    def _gemm_seconds(self, layer: LayerProfile, tp: int, tokens: float) -> float:
        """Seconds `layer`'s GEMMs take for the `tokens` tokens of one pass (GEMMs `tokens` rows
        tall, a mixture of experts' at the tokens each expert gets), priced as a prefill's are
        (`compute.forward_parts`): each in its dtype (an FP8 plan's head in bf16, a W8A8 method's
        blocks in int8) at that dtype's efficiency for the GEMM's size."""
        if tokens <= 0:
            return 0.0
        key = (id(layer), tp, tokens)  # the simulator tabulates each batch at several prompt sizes
        if key not in self._gemm_cache:
            load = self._load(layer, tp, tokens)
            ctx = replace(self.ctx(tp, tokens / self.s), seq_len=self.s, expert_share=load.work,
                          expert_slices=load.slices)
            self._gemm_cache[key] = forward_parts(layer, ctx)[0]
        return self._gemm_cache[key]

    def _load(self, layer: LayerProfile, tp: int, tokens: float) -> ExpertLoad:
        """The busiest TP rank's share of `layer`'s experts for `tokens` routed tokens."""
        return expert_load(layer, self.w.n_experts, self.s, tokens, tp if layer.tp_shardable else 1,
                           self.expert_parallel)

    def _read(self, layer: LayerProfile, tp: int, tokens: float) -> float:
        """Parameters the busiest TP rank reads for `tokens` tokens through `layer` (a mixture of
        experts: the experts they are routed to, `costmodel.experts`)."""
        t = tp if layer.tp_shardable else 1
        return weights_read(layer, params_on_tp_rank(layer, tp), t, self._load(layer, tp, tokens))

    # one engine iteration: the running sequences' next tokens and prompt chunks, the weights read once
    def _prompt_token(self, layer: LayerProfile, tp: int) -> tuple[float, float, float]:
        """(GEMMs, attention and pointwise, TP comm) seconds one prompt token costs `layer` beside
        the weight read: its GEMMs at the prompt's size; its share of the prompt's attention (a
        chunk attends over the prompt before it, so a token's mean share is half the prompt's) and
        the fused pointwise traffic; the head runs a prompt's last position only."""
        key = (id(layer), tp)
        if key not in self._prompt_cache:
            load = self._load(layer, tp, self.prompt_len)
            ctx = replace(self.ctx(tp), expert_share=load.work, expert_slices=load.slices)
            gemm, attention, memory = forward_parts(layer, ctx)
            scale = self.prompt_len / self.s  # trace length = prompt length in the planner; exact either way for GEMMs
            gemm, attention, memory = gemm * scale, attention * scale * scale, memory * scale
            if layer.kind == "head":
                gemm, memory = gemm / self.prompt_len, memory / self.prompt_len
            comm = tp_collective_time(layer, ctx) * scale if tp > 1 else 0.0
            self._prompt_cache[key] = (gemm / self.prompt_len, (attention + memory) / self.prompt_len,
                                       comm / self.prompt_len)
        return self._prompt_cache[key]

    def iteration_stage(self, runs, tp: int, b: float, context: float, prompt_tokens: float = 0.0) -> dict[str, float]:
        """One pass of one stage, by part: `b` sequences decode a token at mean `context` while
        `prompt_tokens` of prompts are prefilled beside them, as one batch (TensorRT-LLM's
        in-flight batching, vLLM V1's chunked prefill): each layer reads its weights once, for all
        the pass's tokens; its GEMMs take the longer of that read and their compute, its attention
        the longer of the cache read and its own (a roofline per kernel)."""
        ctx = self.ctx(tp, b)
        kv_layer = kv_per_token_per_block_rank(self.w, tp, self.kv_dtype)
        tokens = b + prompt_tokens
        out = {"weights": 0.0, "kv_cache": 0.0, "compute_excess": 0.0, "tp_comm": 0.0}
        for layer, n in runs:
            t = tp if layer.tp_shardable else 1
            if layer.kind == "embedding":
                weight_bytes = tokens * (self.w.hidden or 0) * self.weight_bytes / t  # gathers its tokens' rows only
            else:
                weight_bytes = self._read(layer, tp, tokens) * self.weight_bytes
            kv_bytes = b * context * kv_layer if layer.kind == "block" else 0.0
            act_bytes = b * elementwise_traffic(layer, ctx) / self.s / t
            attention = b * (layer.attention_flops / self.s ** 2 * context) / t / (
                self.attention_peak * attention_efficiency(layer, self.cluster.gpu))
            prompt_gemm, prompt_rest, prompt_comm = (x * prompt_tokens for x in self._prompt_token(layer, tp)) \
                if prompt_tokens else (0.0, 0.0, 0.0)
            gemm = self._gemm_seconds(layer, tp, b) + prompt_gemm
            mem_w, mem_kv, mem_act = weight_bytes / self.hbm, kv_bytes / self.hbm, act_bytes / self.hbm
            out["weights"] += n * (mem_w + mem_act)
            out["kv_cache"] += n * mem_kv
            # each kernel its own roofline: the GEMMs' weight read hides their compute or the reverse,
            # and so the attention's cache read its scores'; one never hides under the other's
            out["compute_excess"] += n * (max(0.0, gemm - mem_w) + max(0.0, attention + prompt_rest - mem_kv))
            out["tp_comm"] += n * prompt_comm
            if t > 1 and layer.tp_allreduces_fwd and b:
                one = coll.all_reduce(layer.tp_comm_bytes / self.s * b, ctx.tp_group, self.cluster)
                out["tp_comm"] += n * layer.tp_allreduces_fwd * one
        return out

    def prefill_stage_times(self, tp: int, pp: int) -> list[float]:
        """Each stage's seconds for one prompt prefilled alone."""
        key = (tp, pp)
        if key not in self._prefill_cache:
            self._prefill_cache[key] = [sum(self.iteration_stage(runs, tp, 0.0, 0.0, self.prompt_len).values())
                                        for runs in self.stages(pp)]
        return self._prefill_cache[key]

    def prefill_latency(self, tp: int, pp: int) -> float:
        return sum(self.prefill_stage_times(tp, pp)) + (pp - 1) * self.hop(tp, self.prompt_len)

    def prefill_occupancy(self, tp: int, pp: int) -> float:
        """Replica time a prompt's own pass takes from decoding: its slowest stage (a pipeline's
        stages overlap one prompt with the next)."""
        return max(self.prefill_stage_times(tp, pp)) + (self.hop(tp, self.prompt_len) if pp > 1 else 0.0)

    def iteration(self, tp: int, pp: int, batch: float, prompt_tokens: float = 0.0) -> tuple[float, dict[str, float]]:
        """(seconds for every one of `batch` sequences to gain a token while `prompt_tokens` of
        prompts are prefilled, the slowest stage's parts). An engine that batches prompt chunks
        with the decodes runs them as one pass; one that does not runs the prompts in a pass of
        their own (`ServingEngine.mixes_prefill`)."""
        if prompt_tokens and batch and not self.mixes_prefill:  # the prompts' pass, then the decodes'
            decode, parts = self._pass(tp, pp, batch, 0.0)
            prompts, prompt_parts = self._pass(tp, pp, 0.0, prompt_tokens)
            parts = {key: value + prompt_parts[key] for key, value in parts.items()}
        else:
            decode, parts = self._pass(tp, pp, batch, prompt_tokens)
            prompts = 0.0
        parts["engine_overhead"] = self.step_overhead
        return decode + prompts + self.step_overhead, parts

    def _pass(self, tp: int, pp: int, batch: float, prompt_tokens: float) -> tuple[float, dict[str, float]]:
        """One forward pass of `batch` decoding sequences and `prompt_tokens` of prompts through the
        stages. A pipeline keeps k = min(pp, sequences and prompts) micro-batches in flight, the
        prompt tokens spread over them."""
        context = self.prompt_len + self.output_len / 2
        k = max(1.0, min(float(pp), batch + prompt_tokens / self.prompt_len))
        b, p = batch / k, prompt_tokens / k
        stage_parts = [self.iteration_stage(runs, tp, b, context, p) for runs in self.stages(pp)]
        stage_times = [sum(parts.values()) for parts in stage_parts]
        hop = self.hop(tp, b + p) if pp > 1 else 0.0
        seconds = max(k * max(stage_times), sum(stage_times) + pp * hop)
        slow = stage_parts[stage_times.index(max(stage_times))]
        parts = {key: k * v for key, v in slow.items()}
        parts["pp_comm"] = pp * hop
        parts["pipeline_wait"] = max(0.0, seconds - sum(parts.values()))
        return seconds, parts

    def decode_iteration(self, tp: int, pp: int, batch: float) -> tuple[float, dict[str, float]]:
        """An iteration of `batch` decoding sequences and no prompt."""
        return self.iteration(tp, pp, batch)

    def mean_iteration(self, tp: int, pp: int, batch: float, decode: float) -> float:
        """The mean iteration of `batch` sequences under continuous batching (their TPOT), `decode`
        their iteration without a prompt: a sequence lives `output_len` iterations, so
        `batch / output_len` prompts join each one. An engine that batches prompts with the decodes
        takes a whole prompt into one iteration (the engine's token budget holds the prompts
        that join, `batched_tokens`), so that share of iterations carries one; past one an iteration, every
        iteration carries the prompts' tokens. One that prefills apart adds a prompt's own pass per
        joining prompt, its slowest stage where a pipeline overlaps prompts (`prefill_occupancy`)."""
        joining = batch / self.output_len
        if not self.mixes_prefill:
            return decode + joining * self.prefill_occupancy(tp, pp)
        if joining >= 1:
            return self.iteration(tp, pp, batch, joining * self.prompt_len)[0]
        return joining * self.iteration(tp, pp, batch, self.prompt_len)[0] + (1 - joining) * decode

    def time_to_first_token(self, tp: int, pp: int, batch: float, decode: float) -> float:
        """A new prompt's wait to join (half of `decode`, the batch's iteration without a prompt)
        and its prefill. An engine that batches prompts with the decodes runs it in an iteration
        beside the other `batch - 1` sequences' next tokens, which that iteration pays too; one that
        prefills apart runs it alone (vLLM V0 schedules prefills first)."""
        alone = self.prefill_latency(tp, pp)
        if not self.mixes_prefill or batch <= 1:
            return alone + 0.5 * decode
        beside = self.iteration(tp, pp, batch - 1, self.prompt_len)[0] - self.iteration(tp, pp, 0, self.prompt_len)[0]
        return alone + beside + 0.5 * decode

    # the whole picture
    def estimate(self, tp: int, pp: int, batch: float) -> ServingEstimate:
        iteration, parts = self.decode_iteration(tp, pp, batch)
        prefill = self.prefill_latency(tp, pp)
        tpot = self.mean_iteration(tp, pp, batch, iteration)
        ttft = self.time_to_first_token(tp, pp, batch, iteration)
        per_replica = batch / tpot
        gpus = tp * pp
        price = self.cluster.price_per_gpu_hour
        usd = price * gpus / 3600 / per_replica * 1e6 if price is not None else None
        note = "" if price is not None else f"no price is known for {self.cluster.gpu.name}; pass a price to get $"
        kv_gpu = kv_bytes_per_token_per_gpu(self.w, tp, pp, self.kv_dtype)
        return ServingEstimate(
            tp=tp, pp=pp, batch=batch, context_len=self.prompt_len + self.output_len / 2,
            weights_bytes_per_gpu=self.weights_per_gpu(tp, pp),
            kv_bytes_per_token=kv_bytes_per_token(self.w, self.kv_dtype), kv_bytes_per_token_per_gpu=kv_gpu,
            kv_cache_bytes_per_gpu=kv_gpu * batch * (self.prompt_len + self.output_len),
            workspace_bytes_per_gpu=self.workspace(tp, pp), memory_capacity_bytes=self.capacity,
            max_concurrent_sequences=self.max_sequences(tp, pp),
            prefill_s=prefill, decode_step_s=iteration, tpot_s=tpot, ttft_s=ttft,
            tokens_per_s_replica=per_replica, tokens_per_s_per_gpu=per_replica / gpus,
            decode_breakdown_s=parts, usd_per_million_output_tokens=usd, price_note=note,
        )


def serving_model(workload: Workload, cluster: Cluster, **kwargs) -> ServingModel:
    return ServingModel(workload, cluster, **kwargs)
