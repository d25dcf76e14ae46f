"""An event simulation of one serving replica under a request rate: what TTFT and TPOT a user
sees at p50, p90 and p99, where the closed formulas of `costmodel.inference` give only means.

Requests arrive as a Poisson process, with fixed lengths or lengths drawn from a given set. The
engine loop is the one vLLM, SGLang and TensorRT-LLM share:
- Continuous batching. Each iteration decodes one token for every running sequence whose prompt
  is done. It spends the rest of a token budget (`max_batched_tokens`) on prompt chunks:
  unfinished prefills first, then new requests in arrival order (chunked prefill).
- Paged KV admission. A request is admitted while its prompt's pages fit the KV cache, in pages
  of `block_size` tokens, and at most `max_sequences` run.
- Preemption by recomputation, as vLLM does. When the decoding sequences' next tokens need a
  page the cache has no room for, the most recently admitted sequence is evicted. It returns to
  the head of the queue and prefills its prompt and what it had generated again.

An iteration takes what the serving model prices for its decoding sequences and prompt tokens run
as one batch (`ServingModel.iteration`: each layer's weights read once), tabulated at every batch
and at `PROMPT_GRID` steps of the token budget, linear between them.
A request's TTFT runs from its arrival to the end of the iteration that finishes its prompt; its
TPOT is the mean gap between its later tokens.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from costmodel.inference import KV_BLOCK_TOKENS, ServingModel, batched_tokens

PERCENTILES = (50, 90, 99)
WARMUP_SHARE = 0.1  # the first requests meet an empty engine: left out of the statistics
# The engine fills for one request lifetime before it holds its steady batch: the statistics start
# a lifetime after the first arrival, and the run is lengthened until its arrivals span this many.
STEADY_LIFETIMES = 3
MAX_SIMULATED_REQUESTS = 20_000  # bounds a simulation's run time (a lifetime of many thousand requests in flight)
RERUN_MARGIN = 1.25  # a run made again, for falling short of the lifetimes it should span, is this much longer


class Percentiles(BaseModel):
    model_config = ConfigDict(extra="forbid")
    p50: float
    p90: float
    p99: float
    mean: float


class ServingSimulation(BaseModel):
    """A replica's figures at one request rate (times in ms)."""

    model_config = ConfigDict(extra="forbid")
    rate: float = Field(description="requests/s offered to this replica")
    requests: int = Field(description="requests simulated; those that arrived before the engine filled (a running "
                          "request's median lifetime after the first arrival) or in the first tenth are left out of the "
                          "statistics")
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    e2e_ms: Percentiles
    output_tokens_per_s: float = Field(description="output tokens/s the replica generated while the load was on (from "
                                       "the first measured arrival to the last request's first token)")
    goodput_rps: float | None = Field(None, description="requests/s that met both SLOs (None: no SLO given)")
    slo_met_share: float | None = None
    preemptions: int = 0
    mean_batch: float = Field(description="mean decoding sequences while the engine is busy")


PROMPT_GRID = 8  # steps of the token budget an iteration's cost is tabulated at (linear between: its roofline is)


@dataclass(frozen=True)
class Replica:
    """One replica as its engine's scheduler runs it: the settings, and the costs of an iteration
    (from a `ServingModel` at one layout)."""

    iteration_table: tuple[tuple[float, ...], ...]  # [decoding sequences][k]: seconds with k * prompt_step prompt tokens
    prompt_step: float
    kv_blocks: int
    block_size: int = KV_BLOCK_TOKENS
    max_sequences: int = 256
    max_batched_tokens: int = 8192

    @classmethod
    def of(cls, sm: ServingModel, tp: int, pp: int, max_batched_tokens: int | None = None) -> "Replica":
        """`sm`'s replica at (tp, pp), its KV pages the engine's (`ServingModel.kv_block_tokens`)."""
        tokens, block_size = sm.kv_token_capacity(tp, pp), sm.kv_block_tokens
        cap = max(1, sm.max_sequences(tp, pp))
        budget = max_batched_tokens or batched_tokens(sm.prompt_len, cap, sm.output_len)
        step = budget / PROMPT_GRID
        table = tuple(tuple(sm.iteration(tp, pp, b, k * step)[0] if b or k else 0.0 for k in range(PROMPT_GRID + 1))
                      for b in range(cap + 1))
        return cls(iteration_table=table, prompt_step=step, kv_blocks=int(tokens // block_size),
                   block_size=block_size, max_sequences=cap, max_batched_tokens=budget)

    @property
    def decode_s(self) -> tuple[float, ...]:
        """Seconds of an iteration with no prompt tokens, by decoding sequences."""
        return tuple(row[0] for row in self.iteration_table)

    def iteration_s(self, decoding: int, prompt_tokens: int) -> float:
        row = self.iteration_table[min(decoding, len(self.iteration_table) - 1)]
        x = prompt_tokens / self.prompt_step
        k = min(int(x), len(row) - 2)
        return row[k] + (row[k + 1] - row[k]) * (x - k)


@dataclass
class _Request:
    arrival: float
    prompt: int
    output: int
    generated: int = 0
    first_token: float | None = None
    finished: float | None = None
    blocks: int = 0
    to_prefill: int = 0  # context tokens still to prefill: the prompt, or after a preemption all it had

    def context(self) -> int:
        return self.prompt + self.generated


def poisson_requests(rate: float, n: int, lengths: list[tuple[int, int]], seed: int = 0) -> list[_Request]:
    """`n` requests at Poisson arrivals of `rate`/s, each (prompt, output) drawn from `lengths`. The
    gaps are rescaled to average exactly 1/`rate`: a few hundred draws miss the offered rate by
    several percent, which the replica's throughput would repeat."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=n)
    arrivals = np.cumsum(gaps * (n / rate) / gaps.sum())
    picks = rng.integers(0, len(lengths), size=n)
    out = []
    for t, k in zip(arrivals, picks):
        prompt, output = lengths[int(k)]
        out.append(_Request(float(t), int(prompt), int(output), to_prefill=int(prompt)))
    return out


def run_engine(replica: Replica, requests: list[_Request]) -> tuple[list[_Request], int, float]:
    """Play the requests through the engine; returns them finished, the preemptions and the mean
    batch (decoding sequences, averaged over the time the engine is busy)."""
    pending = deque(requests)  # not yet arrived
    waiting: deque[_Request] = deque()
    running: list[_Request] = []  # admission order
    free_blocks, clock, preemptions, batch_time, busy = replica.kv_blocks, 0.0, 0, 0.0, 0.0
    while pending or waiting or running:
        while pending and pending[0].arrival <= clock:
            waiting.append(pending.popleft())
        if not waiting and not running:
            clock = pending[0].arrival
            continue
        decoding = [r for r in running if r.to_prefill == 0]
        while _pages_wanted(decoding, replica.block_size) > free_blocks and running:  # evict the newest
            victim = running.pop()
            free_blocks += victim.blocks
            preemptions += 1
            if victim in decoding:
                decoding.remove(victim)
            victim.blocks, victim.to_prefill = 0, victim.context()
            waiting.appendleft(victim)
        budget = replica.max_batched_tokens - len(decoding)
        chunks: list[tuple[_Request, int]] = []
        for r in running:
            if r.to_prefill and budget > 0:
                take = min(r.to_prefill, budget)
                chunks.append((r, take))
                budget -= take
        while waiting and budget > 0 and len(running) < replica.max_sequences:
            r = waiting[0]
            blocks = math.ceil((r.to_prefill + 1) / replica.block_size)
            if blocks > free_blocks:
                break
            waiting.popleft()
            r.blocks, free_blocks = blocks, free_blocks - blocks
            running.append(r)
            take = min(r.to_prefill, budget)
            chunks.append((r, take))
            budget -= take
        step = replica.iteration_s(len(decoding), sum(t for _, t in chunks))
        clock += step
        busy += step
        batch_time += len(decoding) * step
        for r in decoding:  # each gains a token, and a page when its pages are full
            r.generated += 1
            if r.prompt + r.generated > r.blocks * replica.block_size:
                r.blocks += 1
                free_blocks -= 1
        for r, take in chunks:
            r.to_prefill -= take
            if r.to_prefill == 0 and r.first_token is None:
                r.first_token = clock  # the prompt's last chunk yields the first token
                r.generated = max(r.generated, 1)
        for r in [r for r in running if r.generated >= r.output and r.to_prefill == 0]:
            r.finished = clock
            free_blocks += r.blocks
            running.remove(r)
    return requests, preemptions, batch_time / busy if busy else 0.0


def _pages_wanted(decoding: list[_Request], block_size: int) -> int:
    """New pages the decoding sequences' next tokens need: one for each whose pages are full."""
    return sum(1 for r in decoding if r.prompt + r.generated >= r.blocks * block_size)


def _percentiles(values: np.ndarray) -> Percentiles:
    p = np.percentile(values, PERCENTILES)
    return Percentiles(p50=float(p[0]), p90=float(p[1]), p99=float(p[2]), mean=float(values.mean()))


def simulate_rate(replica: Replica, rate: float, lengths: list[tuple[int, int]], requests: int = 600, seed: int = 0,
                  slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> ServingSimulation:
    """A replica's TTFT, TPOT and end-to-end percentiles at `rate` requests/s, over the requests
    that arrive once the engine holds its steady batch (`steady_requests`)."""
    done, preemptions, mean_batch, measured = steady_requests(replica, rate, lengths, requests, seed)
    ttft = np.array([(r.first_token - r.arrival) * 1e3 for r in measured])
    tpot = np.array([(r.finished - r.first_token) * 1e3 / max(r.output - 1, 1) for r in measured])
    e2e = np.array([(r.finished - r.arrival) * 1e3 for r in measured])
    # while the load is on: from the first measured request's arrival until the last request's first
    # token (the last arrival below capacity, the queue's end above it); after it the engine drains,
    # emptier and faster, which counts in neither throughput nor goodput
    start, end = min(r.arrival for r in measured), max(r.first_token for r in done)
    span = max(end - start, 1e-9)
    goodput = share = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        ok = np.ones(len(measured), dtype=bool)
        if slo_ttft_ms is not None:
            ok &= ttft <= slo_ttft_ms
        if slo_tpot_ms is not None:
            ok &= tpot <= slo_tpot_ms
        share = float(ok.mean())
        goodput = float(ok.sum()) / span
    return ServingSimulation(rate=rate, requests=len(done), ttft_ms=_percentiles(ttft), tpot_ms=_percentiles(tpot),
                             e2e_ms=_percentiles(e2e), output_tokens_per_s=_tokens_between(done, start, end) / span,
                             goodput_rps=goodput,
                             slo_met_share=share, preemptions=preemptions, mean_batch=mean_batch)


def steady_requests(replica: Replica, rate: float, lengths: list[tuple[int, int]], requests: int, seed: int):
    """(every request, preemptions, mean batch, the measured requests) of a run of at least
    `requests` whose arrivals span `STEADY_LIFETIMES` lifetimes of a running request (its median
    first to last token: the time a sequence holds its place in the batch, whatever it queued
    before; at most `MAX_SIMULATED_REQUESTS`). The measured ones arrive once a lifetime has passed
    since the first arrival, when the engine holds its steady batch, and after the first tenth."""
    mean_output = sum(o for _, o in lengths) / len(lengths)
    guess = _decode_lifetime(replica, rate, mean_output)
    requests = max(requests, min(MAX_SIMULATED_REQUESTS, math.ceil(RERUN_MARGIN * _spanning(rate, guess))))
    while True:
        done, preemptions, mean_batch = run_engine(replica, poisson_requests(rate, requests, lengths, seed))
        lifetime = float(np.median([r.finished - r.first_token for r in done]))
        needed = _spanning(rate, lifetime)
        if needed <= requests or requests >= MAX_SIMULATED_REQUESTS:
            break
        requests = min(MAX_SIMULATED_REQUESTS, math.ceil(RERUN_MARGIN * needed))
    start = max(done[0].arrival + lifetime, done[int(len(done) * WARMUP_SHARE)].arrival)
    measured = [r for r in done if r.arrival >= start] or done[-1:]
    return done, preemptions, mean_batch, measured


def _spanning(rate: float, lifetime: float) -> int:
    """Requests whose arrivals at `rate` span `STEADY_LIFETIMES` lifetimes (at most the bound)."""
    return min(MAX_SIMULATED_REQUESTS, math.ceil(STEADY_LIFETIMES * rate * lifetime))


def _decode_lifetime(replica: Replica, rate: float, mean_output: float) -> float:
    """A running request's lifetime as the decode table gives it, before the run: `mean_output`
    iterations at the batch Little's law keeps running (rate x lifetime, at most the cap), by
    fixed-point iteration; prompts left out, so a run is seldom made twice."""
    batch, lifetime = 1, 0.0
    for _ in range(20):
        lifetime = mean_output * replica.decode_s[batch]
        batch = max(1, min(replica.max_sequences, round(rate * lifetime)))
    return lifetime


def _tokens_between(done: list[_Request], start: float, end: float) -> float:
    """Output tokens the requests generated between `start` and `end`: each request's first token
    at its TTFT, the rest spread evenly up to its last."""
    tokens = 0.0
    for r in done:
        if start <= r.first_token <= end:
            tokens += 1
        lo, hi = max(r.first_token, start), min(r.finished, end)
        if r.output > 1 and hi > lo:
            tokens += (r.output - 1) * (hi - lo) / (r.finished - r.first_token)
    return tokens


def highest_rate(replica: Replica, lengths: list[tuple[int, int]], slo_ttft_ms: float | None, slo_tpot_ms: float | None,
                 requests: int = 600, seed: int = 0, tolerance: float = 0.02) -> tuple[float, ServingSimulation | None]:
    """The highest rate (requests/s, to `tolerance`) whose p99 TTFT and p99 TPOT meet the SLOs;
    (0, None) when even a trickle misses them. Bisection: p99s grow with the rate."""
    def meets(sim: ServingSimulation) -> bool:
        return ((slo_ttft_ms is None or sim.ttft_ms.p99 <= slo_ttft_ms)
                and (slo_tpot_ms is None or sim.tpot_ms.p99 <= slo_tpot_ms))

    mean_output = sum(o for _, o in lengths) / len(lengths)
    ceiling = replica.max_sequences / (replica.decode_s[-1] * mean_output)  # a full batch every iteration
    lo, hi = ceiling * 0.01, ceiling
    best = simulate_rate(replica, lo, lengths, requests, seed, slo_ttft_ms, slo_tpot_ms)
    if not meets(best):
        return 0.0, None
    while hi - lo > tolerance * hi:
        mid = (lo + hi) / 2
        sim = simulate_rate(replica, mid, lengths, requests, seed, slo_ttft_ms, slo_tpot_ms)
        lo, hi, best = (mid, hi, sim) if meets(sim) else (lo, mid, best)
    return lo, best
