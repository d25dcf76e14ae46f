"""Discrete-event core: run each rank's op list against data dependencies and links.

Each pipeline rank has a compute stream that runs its ops strictly in
schedule order, and two links (intra-node, inter-node). On a link, each
communicator (pipeline sends, data-parallel buckets) is a FIFO queue of its
own: NCCL runs communicators on separate channels, so a 6 MB activation send
does not wait behind a 400 MB gradient bucket (a strict per-link FIFO made
every rank's last gradient send wait for its whole bucket train, 9% on GPT-3
175B); the bandwidth they then share is not modelled. An op starts when its inputs
have arrived and the compute stream is free. A min-heap orders the only
asynchronous happenings, sends and bucket reductions, by the time they are
issued; because requests reach a stream in time order, FIFO is exact.
ZeRO-3 gathers are laid out inside their op (see `ops`) and do not
join that queue: ops are started ahead of the clock, so letting them reserve
the link would make an earlier send wait for a later op's traffic.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import NamedTuple

from .ops import Bucket, OpTemplate
from .schedule import Op


class Event(NamedTuple):
    rank: int
    stream: str  # "compute", "intra", "inter"
    name: str
    start: float
    duration: float
    kind: str  # forward, backward, tp, pp, dp, zero_gather, zero_scatter, optimizer


@dataclass
class EngineInput:
    n_stages: int
    orders: list[list[Op]]
    templates: dict[tuple[int, str], OpTemplate]
    p2p_fwd: list[float]  # stage s -> s+1, one micro-batch
    p2p_bwd: list[float]  # stage s -> s-1
    activation: list[tuple[float, float]]  # (kept, transient) per stage
    buckets: dict[int, list[Bucket]]  # per stage
    bucket_time: callable  # (bytes, virtual stage) -> (seconds, verb)
    pp_stream: str
    dp_stream: str


@dataclass
class EngineOutput:
    events: list[Event] = field(default_factory=list)
    compute_end: list[float] = field(default_factory=list)
    comm_free: dict[tuple[int, str, str], float] = field(default_factory=dict)
    dp_end: list[float] = field(default_factory=list)
    memory_deltas: list[list[tuple[float, float]]] = field(default_factory=list)
    ops: list[list[tuple[Op, float, float]]] = field(default_factory=list)


class Engine:
    def __init__(self, spec: EngineInput):
        self.s = spec
        pp = len(spec.orders)
        self.idx = [0] * pp
        self.free = [0.0] * pp
        self.avail: dict[tuple[str, int, int], float] = {}
        self.waiting: dict[tuple[str, int, int], int] = {}
        self.heap: list = []
        self.seq = 0
        self.out = EngineOutput(dp_end=[0.0] * pp, memory_deltas=[[] for _ in range(pp)], ops=[[] for _ in range(pp)])
        self.last_backward = [self._last_backward(order) for order in spec.orders]
        # a zero-bubble schedule's input gradients (B) keep the chunk's graph for its weight
        # gradients (W: torch's stage_backward_input retains it): its activations free at W
        self.split_backward = any(op.phase == "W" for order in spec.orders for op in order)

    @staticmethod
    def _last_backward(order: list[Op]) -> set[int]:
        """Positions of each stage's final backward: its gradients are complete there."""
        last: dict[int, int] = {}
        for pos, op in enumerate(order):
            if op.phase in ("B", "W"):  # a zero-bubble schedule's weight gradients (W) follow their B
                last[op.stage] = pos
        return set(last.values())

    def run(self) -> EngineOutput:
        for r in range(len(self.s.orders)):
            self._advance(r)
        while self.heap:
            t, _, kind, payload = heapq.heappop(self.heap)
            if kind == "send":
                self._send(t, *payload)
            else:
                self._reduce(t, *payload)
        stuck = [r for r, order in enumerate(self.s.orders) if self.idx[r] < len(order)]
        if stuck:
            r = stuck[0]
            raise RuntimeError(f"schedule deadlock: rank {r} waits forever at {self.s.orders[r][self.idx[r]]}")
        self.out.compute_end = list(self.free)
        return self.out

    def _push(self, t: float, kind: str, payload: tuple) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, payload))

    def _ready(self, op: Op) -> float | None:
        """When op's input is on this rank, or None while it is still unknown."""
        if op.phase == "F" and op.stage == 0:
            return 0.0
        return self.avail.get((op.phase, op.micro_batch, op.stage))

    def _advance(self, r: int) -> None:
        """Start as many of rank r's next ops as have known inputs (start times may lie ahead)."""
        order = self.s.orders[r]
        while self.idx[r] < len(order):
            op = order[self.idx[r]]
            ready = self._ready(op)
            if ready is None:
                self.waiting[(op.phase, op.micro_batch, op.stage)] = r
                return
            self._start(r, op, max(self.free[r], ready), self.idx[r] in self.last_backward[r])
            self.idx[r] += 1

    def _start(self, r: int, op: Op, start: float, last_backward: bool) -> None:
        tpl = self.s.templates[(op.stage, op.phase)]
        end = start + tpl.duration
        self.free[r] = end
        out, ev = self.out, self.out.events
        out.ops[r].append((op, start, end))
        name = f"{op.phase}{op.micro_batch} s{op.stage}"
        ev.append(Event(r, "compute", name, start, tpl.duration, "forward" if op.phase == "F" else "backward"))
        for seg in tpl.segments:
            ev.append(Event(r, seg.stream, seg.name, start + seg.offset, seg.duration, seg.kind))
        if tpl.comm_tail:  # ZeRO-3 traffic is priced inside the op; it does not queue with sends
            out.dp_end[r] = max(out.dp_end[r], start + tpl.comm_tail)
        kept, transient = self.s.activation[op.stage]
        if op.phase == "W":  # weight gradients: ready once their input gradients are (`_ready`)
            out.memory_deltas[r].append((end, -kept))
            self._buckets(r, op, start, last_backward)
        elif op.phase == "F":
            out.memory_deltas[r].append((start, kept))
            if op.stage < self.s.n_stages - 1:
                self._push(end, "send", (r, "F", op.micro_batch, op.stage + 1, self.s.p2p_fwd[op.stage]))
            else:
                self._arrive(("B", op.micro_batch, op.stage), end)
        else:
            out.memory_deltas[r].append((start, transient))
            out.memory_deltas[r].append((end, -transient if self.split_backward else -kept - transient))
            if op.stage > 0:
                self._push(end, "send", (r, "B", op.micro_batch, op.stage - 1, self.s.p2p_bwd[op.stage]))
            self.avail[("W", op.micro_batch, op.stage)] = end
            self._buckets(r, op, start, last_backward)

    def _buckets(self, r: int, op: Op, start: float, last_backward: bool) -> None:
        """The stage's gradient buckets, once its last backward op makes them final."""
        if last_backward:
            for n, bucket in enumerate(self.s.buckets.get(op.stage, ())):
                self._push(start + bucket.ready_offset, "bucket", (r, n, bucket))

    def _arrive(self, key: tuple[str, int, int], t: float) -> None:
        self.avail[key] = t
        r = self.waiting.pop(key, None)
        if r is not None:
            self._advance(r)

    def _send(self, t: float, r: int, phase: str, j: int, dst: int, seconds: float) -> None:
        if seconds == 0.0:  # handed over in place (a V's turn: both stages on one rank), past the link's queue
            self._arrive((phase, j, dst), t)
            return
        key = (r, self.s.pp_stream, "pp")
        start = max(self.out.comm_free.get(key, 0.0), t)
        end = start + seconds
        if seconds > 0:
            self.out.comm_free[key] = end
            what = "send act" if phase == "F" else "send grad"
            self.out.events.append(Event(r, self.s.pp_stream, f"{what} {j} s{dst}", start, seconds, "pp"))
        self._arrive((phase, j, dst), end)

    def _reduce(self, t: float, r: int, n: int, bucket: Bucket) -> None:
        key = (r, self.s.dp_stream, "dp")
        start = max(self.out.comm_free.get(key, 0.0), t)
        seconds, verb = self.s.bucket_time(bucket.grad_bytes, bucket.stage)
        self.out.comm_free[key] = start + seconds
        self.out.dp_end[r] = max(self.out.dp_end[r], start + seconds)
        self.out.events.append(Event(r, self.s.dp_stream, f"{verb} bucket {n} s{bucket.stage}", start, seconds, "dp"))
