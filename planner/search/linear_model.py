"""The linear stage model's step and memory from block counts per policy on each pipeline rank
(`linear_step`), and the cheapest recompute mix that fits a rank's memory: the
uniform and greedy plans the search starts from and bounds with, priced by the solver's
coefficients (`planner.search.coefficients`).
"""
from __future__ import annotations


from costmodel.terms import bubble_fill, pipeline_seconds
from layout.axes import REBUILT, stage_rank

from planner.search.coefficients import POLICIES, StageModelData, fixed_per_rank


def linear_step(data: StageModelData, counts: list[dict[str, int]], pp: int, vpp: int, m: int) -> tuple[float, float]:
    """(step seconds, worst memory headroom in bytes) of `counts[s][policy]`
    blocks per virtual stage: the CP-SAT model's objective and memory
    constraint evaluated directly, to rank layouts without building plans."""
    block, S = data.block, len(counts)
    per_rank = [dict.fromkeys(POLICIES, 0) for _ in range(pp)]
    kept: list[dict[int, float]] = [{} for _ in range(pp)]  # per rank: its blocks' bytes per micro-batch, by stage
    for s, stage in enumerate(counts):
        r = stage_rank(data.schedule, pp, s)
        for k, n in stage.items():
            per_rank[r][k] += n
        kept[r][s] = sum(n * block.activation[k] for k, n in stage.items())
    fixed = fixed_per_rank(data, pp, vpp)
    rank_time, weight_grads = [], 0.0
    exposed, slack, headroom, optimizer = 0.0, 0.0, float("inf"), 0.0
    for r, (f, mine) in enumerate(zip(fixed, per_rank)):
        blocks = sum(mine.get(k, 0) for k in POLICIES)
        rank_time.append(f.time + sum(mine.get(k, 0) * block.time[k] for k in POLICIES))
        weight_grads += f.weight_grad + blocks * block.weight_grad
        window = sum(mine.get(k, 0) * block.backward[k] for k in POLICIES)
        params = blocks * block.params + f.params
        experts = blocks * block.expert_params
        exposed = max(exposed, (params - experts) * data.dp_seconds_per_param + data.dp_latency - window - slack)
        slack += window
        optimizer = max(optimizer, data.after_backward_seconds(params, experts))
        rebuilt = any(mine.get(k, 0) for k in REBUILT)
        used = (blocks * block.states + f.states + data.saved_bytes(r, S, kept[r])
                + (data.rebuild_bytes(r) if rebuilt else 0.0) + data.extra_bytes(r))
        stepping = data.step_bytes(r, blocks * block.step_states + f.step_states)
        closing = blocks * (block.end_states + block.pile) + f.closing  # a backward's end (`closing_fixed`)
        headroom = min(headroom, data.capacity - max(used, stepping, closing))
    pipeline = pipeline_seconds(max(rank_time), sum(rank_time), m, vpp, bubble_fill(data.schedule, weight_grads, pp))
    return pipeline + max(0.0, exposed) + optimizer, headroom


def cheapest_mix(data: StageModelData, n: float, room: float, in_flight: float) -> float:
    """Least time of `n` blocks whose activations must fit in `room` bytes.

    The linear relaxation of choosing a checkpointing policy per block: with
    one memory constraint its optimum mixes at most two policies, so every
    single policy and every pair is tried. Returns inf when even full
    recomputation does not fit.
    """
    block = data.block
    cost = {k: block.time[k] for k in POLICIES}
    size = {k: block.activation[k] * in_flight for k in POLICIES}
    best = float("inf")
    for k in POLICIES:
        if n * size[k] <= room:
            best = min(best, n * cost[k])
    for fast in POLICIES:
        for lean in POLICIES:
            if size[fast] > size[lean] and cost[fast] < cost[lean]:
                lean_count = (n * size[fast] - room) / (size[fast] - size[lean])
                if 0 <= lean_count <= n:
                    best = min(best, (n - lean_count) * cost[fast] + lean_count * cost[lean])
    return best


def least_recompute_counts(data: StageModelData, blocks: list[int], pp: int, allowed: tuple[str, ...]) -> list[dict[str, int]] | None:
    """Greedy start for the CP-SAT model: keep the given partition and, rank by
    rank, checkpoint the fewest blocks that make its memory fit (the leanest
    allowed policy for those, on the stages whose micro-batches it holds most of,
    the fastest for the rest). None if a rank cannot fit."""
    S, block = len(blocks), data.block
    fast = min(allowed, key=lambda k: (block.time[k], block.activation[k]))
    lean = min(allowed, key=lambda k: (block.activation[k], block.time[k]))
    counts = [{k: 0 for k in POLICIES} for _ in range(S)]
    for r in range(pp):
        stages = data.stages_of(r, pp, S)
        terms = data.holding_terms(r, S)
        held_most = {s: max(held[s] for held, _ in terms) for s in stages}
        stages.sort(key=lambda s: -held_most[s])
        fixed = [l for s in stages for l in data.end_layers(s, S)]
        b = sum(blocks[s] for s in stages)
        base = b * block.states + sum(l.states for l in fixed) + data.extra_bytes(r)

        def leaner(f: int) -> dict[int, int]:  # the lean blocks per stage, `f` of them
            out = {}
            for s in stages:
                out[s] = min(f, blocks[s])
                f -= out[s]
            return out

        def used(f: int) -> float:
            rebuilt = (lean in REBUILT and f) or (fast in REBUILT and b - f)
            transient = data.rebuild_bytes(r) if rebuilt else 0.0
            kept = {s: n * block.activation[lean] + (blocks[s] - n) * block.activation[fast]
                    for s, n in leaner(f).items()}
            return base + data.saved_bytes(r, S, kept, terms) + transient

        f = next((f for f in range(b + 1) if used(f) <= data.capacity), None)
        if f is None or data.step_bytes(r, b * block.step_states + sum(l.step_states for l in fixed)) > data.capacity:
            return None
        if b * (block.end_states + block.pile) + data.closing_fixed(fixed, r) > data.capacity:
            return None
        for s, n in leaner(f).items():
            counts[s][lean] += n
            counts[s][fast] += blocks[s] - n
    return counts
