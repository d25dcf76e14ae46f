"""CP-SAT model of the stage partition and per-layer checkpointing for one layout.

The outer layout (DP, TP, PP, SP, ZeRO, micro-batch, schedule) is fixed by
planner/search/branch_and_bound.py; this model chooses how the B identical blocks are spread
over the S = pp * vpp virtual stages and which checkpointing policy each
block uses. Identical blocks are priced once, so the model is over counts.

Variables (on a mixed cluster's pipeline split every coefficient is the rank's own group's)
    n[s][k]   integer, blocks of virtual stage s that use policy k
              (k in none / selective / full)
    full[r]   boolean, pipeline rank r has at least one fully recomputed block
    R[r]      per-micro-batch time of pipeline rank r (sum of its stages)
    Rmax      max_r R[r]
    opt       max_r optimizer time of rank r (its parameters / dp under ZeRO)
    E         exposed data-parallel gradient reduction

Constraints (one function each below)
    partition:   sum_s sum_k n[s][k] = B, every stage holds >= 1 block;
                 the embedding and other leading layers sit on stage 0, the
                 head and other trailing layers on stage S-1 (not free).
    time:        R[r] = sum_{s = r mod pp} (sum_k n[s][k] * t_k + fixed_s + p2p)
    memory:      states(params[r]) + inflight[r] * act[r] + full[r] * rebuild[r]
                 + zero3 buffers + temporaries[r] <= capacity   for every rank r
                 (rebuild[r] = max(0, a_none - temporaries[r]): a rebuilt block and the
                 largest temporaries exist at different moments, the larger counts)
    dp overlap:  E >= dp(P[r]) - window[r] - slack[r] for every r, E >= 0,
                 where window is rank r's backward (+ recompute) and slack the
                 backward of the ranks before it (they finish after it).

Objective (time, in nanoseconds, multiplied by v to stay integral)
    minimise (m*v - 1) * Rmax + sum_r R[r] + v * (E + opt)  (+1 ns per checkpointed block, a tie-break)
i.e. m * Rmax + (sum_r R[r] - Rmax)/v + E + optimizer, the estimator's
pipeline composition. All coefficients come from planner/search/coefficients.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model

from costmodel.terms import bubble_fill
from layout.axes import REBUILT, stage_rank
from planner.search.coefficients import POLICIES, StageModelData

NS = 1e9  # seconds -> integer nanoseconds
KIB = 1 / 1024  # bytes -> integer KiB


@dataclass(frozen=True)
class StageSolution:
    counts: list[dict[str, int]] | None  # per virtual stage: blocks per policy; None: none under the cap
    # (`StageModel.cap`), and `bound_s` what the solver proved of the layout
    objective_s: float
    bound_s: float
    optimal: bool


def _i(x: float, scale: float) -> int:
    return int(round(x * scale))


class StageModel:
    def __init__(self, data: StageModelData | list[StageModelData], pp: int, vpp: int, m: int) -> None:
        """`data`: the layout's coefficients, or one set per pipeline rank where the ranks sit on
        different GPUs (a mixed cluster's pipeline split: each rank's block time, memory and
        capacity are its own group's)."""
        self.ranks = list(data) if isinstance(data, list) else [data] * pp
        self.d, self.pp, self.vpp, self.m = self.ranks[0], pp, vpp, m
        self.S = pp * vpp
        self.rank_of = [stage_rank(self.d.schedule, pp, s) for s in range(self.S)]  # the schedule's placement
        self.ub = self._time_upper_bound()
        self.model = cp_model.CpModel()
        B = self.d.n_blocks
        self.n = [{k: self.model.NewIntVar(0, B, f"n_{s}_{k}") for k in POLICIES} for s in range(self.S)]
        self.add_partition()
        self.R = self.add_time()
        self.add_memory()
        self.E = self.add_dp_overlap()
        self.add_objective()
        self.cap_s: float | None = None

    def _time_upper_bound(self) -> int:
        """Nanoseconds no rank time, exposed reduction or optimizer step can exceed
        (tight domains keep the objective clear of int64 overflow)."""
        def seconds(d: StageModelData) -> float:
            fixed = d.prefix + d.suffix
            params = d.n_blocks * d.block.params + sum(l.params for l in fixed)
            return (d.n_blocks * max(d.block.time.values()) + sum(max(l.time.values()) for l in fixed) + d.p2p * self.S
                    + sum(d.stage_fill(s, self.S) for s in range(self.S))
                    + params * d.dp_seconds_per_param + d.dp_latency + d.after_backward_seconds(params, d.n_blocks * d.block.expert_params))

        return _i(max(seconds(d) for d in self.ranks), NS) + 1

    def _stages_of(self, r: int) -> list[int]:
        return [s for s in range(self.S) if self.rank_of[s] == r]

    def _fixed(self, s: int, attr: str, policy: str = "none") -> float:
        """Contribution of the embedding/head layers that sit on stage s (and, for time, the
        stage's unhidden sharded collectives)."""
        d = self.ranks[self.rank_of[s]]
        value = d.stage_fill(s, self.S) if attr == "time" else 0.0
        for layer in self._fixed_layers(s):
            field = getattr(layer, attr)
            value += field[policy] if isinstance(field, dict) else field
        return value

    def _blocks(self, r: int):
        return sum(self.n[s][k] for s in self._stages_of(r) for k in POLICIES)

    def _fixed_layers(self, s: int) -> list:
        """The embedding/head layers that sit on stage s."""
        return self.ranks[self.rank_of[s]].end_layers(s, self.S)

    def _fixed_params(self, r: int) -> float:
        return sum(self._fixed(s, "params") for s in self._stages_of(r))

    def add_partition(self) -> None:
        self.model.Add(sum(v for stage in self.n for v in stage.values()) == self.d.n_blocks)
        for stage in self.n:
            self.model.Add(sum(stage.values()) >= 1)

    def add_time(self):
        R = []
        for r in range(self.pp):
            d = self.ranks[r]
            terms = [self.n[s][k] * _i(d.block.time[k], NS) for s in self._stages_of(r) for k in POLICIES]
            fixed = sum(self._fixed(s, "time") + d.p2p * d.sends(s, self.pp, self.S) for s in self._stages_of(r))
            fixed += d.crossing[r] if d.crossing else 0.0  # a mixed split's sends to another GPU group
            rt = self.model.NewIntVar(0, self.ub, f"R_{r}")
            self.model.Add(rt == sum(terms) + _i(fixed, NS))
            R.append(rt)
        return R

    def add_memory(self) -> None:
        for r in range(self.pp):
            d = self.ranks[r]
            full_here = self.model.NewBoolVar(f"full_{r}")  # some block of the rank is rebuilt in its backward
            for s in self._stages_of(r):
                for k in REBUILT:
                    self.model.Add(self.n[s][k] <= d.n_blocks * full_here)
            states = self._blocks(r) * _i(d.block.states, KIB)
            fixed_states = sum(self._fixed(s, "states") for s in self._stages_of(r))
            for held, ends in d.holding_terms(r, self.S):  # each moment the rank can peak at
                act = [self.n[s][k] * _i(d.block.activation[k] * held[s], KIB) for s in self._stages_of(r)
                       for k in POLICIES]
                self.model.Add(sum(act) + states + full_here * _i(d.rebuild_bytes(r), KIB)
                               + _i(ends + fixed_states + d.extra_bytes(r), KIB) <= _i(d.capacity, KIB))
            # the optimizer step's moment: every state and AdamW's temporaries, no activations
            fixed_step = sum(self._fixed(s, "step_states") for s in self._stages_of(r))
            self.model.Add(self._blocks(r) * _i(d.block.step_states, KIB) + _i(d.step_bytes(r, fixed_step), KIB)
                           <= _i(d.capacity, KIB))
            if d.closes_above_states(r):  # a backward's end: autocast's pile, or ZeRO-3's root unit
                fixed = [layer for s in self._stages_of(r) for layer in self._fixed_layers(s)]
                self.model.Add(self._blocks(r) * _i(d.block.end_states + d.block.pile, KIB)
                               + _i(d.closing_fixed(fixed, r), KIB) <= _i(d.capacity, KIB))

    def add_dp_overlap(self):
        E = self.model.NewIntVar(0, self.ub, "E")
        slack = 0
        for r in range(self.pp):
            d = self.ranks[r]
            window = sum(self.n[s][k] * _i(d.block.backward[k], NS) for s in self._stages_of(r) for k in POLICIES)
            dp = self._blocks(r) * _i((d.block.params - d.block.expert_params) * d.dp_seconds_per_param, NS)
            dp_fixed = self._fixed_params(r) * d.dp_seconds_per_param + d.dp_latency
            self.model.Add(E >= dp + _i(dp_fixed, NS) - window - slack)
            slack = slack + window
        return E

    def add_objective(self) -> None:
        Rmax = self.model.NewIntVar(0, self.ub, "Rmax")
        self.model.AddMaxEquality(Rmax, self.R)
        opt_per_rank = []
        for r in range(self.pp):
            d = self.ranks[r]
            o = self.model.NewIntVar(0, self.ub, f"opt_{r}")
            per_block = _i(d.after_backward_seconds(d.block.params, d.block.expert_params) - d.expert_latency, NS)
            self.model.Add(o == self._blocks(r) * per_block + _i(d.after_backward_seconds(self._fixed_params(r), 0.0)
                                                                 + d.expert_latency, NS))
            opt_per_rank.append(o)
        opt = self.model.NewIntVar(0, self.ub, "opt")
        self.model.AddMaxEquality(opt, opt_per_rank)
        v = self.vpp
        # 1 ns per checkpointed block breaks ties (flash attention makes
        # selective cost the same as none) in favour of simpler plans.
        checkpointed = sum(stage[k] for stage in self.n for k in POLICIES if k != "none")
        self.objective = (self.m * v - 1) * Rmax + sum(self.R) - self._fill() + v * (self.E + opt) + checkpointed
        self.model.Minimize(self.objective)

    def _fill(self):
        """A zero-bubble schedule's ramp fill (`costmodel.terms.bubble_fill`), linear in each rank's
        blocks (on a mixed split their weight gradients differ by GPU)."""
        fill = []
        for r in range(self.pp):
            d = self.ranks[r]
            per_block = bubble_fill(d.schedule, d.block.weight_grad, self.pp)
            fixed = sum(bubble_fill(d.schedule, self._fixed(s, "weight_grad"), self.pp) for s in self._stages_of(r))
            fill.append(self._blocks(r) * _i(per_block, NS) + _i(fixed, NS))
        return sum(fill)

    def allow_only(self, policies: tuple[str, ...]) -> None:
        """Honour a pinned checkpointing policy, or the ones a layout runs (`layout.rules.allowed_recompute`)."""
        for stage in self.n:
            for k in POLICIES:
                if k not in policies:
                    self.model.Add(stage[k] == 0)

    def cap(self, seconds: float) -> None:
        """Ask only for partitions faster than `seconds` (the search's best plan): the solver then
        prunes everything slower, and a model with none left proves the layout's bound."""
        self.model.Add(self.objective <= _i(seconds, NS * self.vpp))
        self.cap_s = seconds

    def hint(self, counts: list[dict[str, int]]) -> None:
        """Start the search from a known-feasible assignment."""
        for stage, given in zip(self.n, counts):
            for k in POLICIES:
                self.model.AddHint(stage[k], given[k])

    def solve(self, time_limit_s: float) -> StageSolution | None:
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = time_limit_s
        solver.parameters.num_workers = 1  # deterministic, and the machine has two cores
        solver.parameters.random_seed = 0
        solver.parameters.catch_sigint_signal = False  # Ctrl-C interrupts the command, not just this solve
        status = solver.Solve(self.model)
        scale = NS * self.vpp
        if status == cp_model.INFEASIBLE and self.cap_s is not None:
            return StageSolution(counts=None, objective_s=float("inf"), bound_s=self.cap_s, optimal=True)
        if status == cp_model.UNKNOWN and self.cap_s is not None:
            return StageSolution(counts=None, objective_s=float("inf"), bound_s=solver.BestObjectiveBound() / scale,
                                 optimal=False)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        counts = [{k: solver.Value(self.n[s][k]) for k in POLICIES} for s in range(self.S)]
        return StageSolution(
            counts=counts,
            objective_s=solver.ObjectiveValue() / scale,
            bound_s=solver.BestObjectiveBound() / scale,
            optimal=status == cp_model.OPTIMAL,
        )

