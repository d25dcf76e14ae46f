"""Collectives priced as the library runs them: rings over all ranks, trees for all-reduce.

A group is described by its size and how many of its members share a node
(`per_node`). NCCL's all-gather and reduce-scatter are one flat ring through
every rank of the group, not a hierarchy: its latency is the sum of its steps,
each priced at the intra-node or the network step latency of the protocol,
plus the protocol's launch cost; its bandwidth is the slowest hop's, the node
fabric or the NICs of the group's members in a node. All-reduce is the cheaper
of that ring (twice the steps and the traffic) and the double binary tree
(latency in log2 of the nodes), as NCCL chooses per message. Each protocol
(LL, LL128, Simple) trades launch and step latency against bandwidth and the
cheapest is taken per message, which is what makes bus bandwidth rise with
message size. The figures are the cluster's `collectives` profile; a profile
without one (a calibrated gloo machine) has one protocol of its link latencies.
Across nodes the NICs reach `nic_scaling(nodes)` of their two-node rate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from hardware.schema import Cluster, Protocol


@dataclass(frozen=True)
class Group:
    size: int
    per_node: int  # members of the group that sit in the same node

    @property
    def nodes(self) -> int:
        return max(1, self.size // self.per_node)


def group_of(size: int, stride: int, cluster: Cluster) -> Group:
    """A group of `size` ranks spaced `stride` apart in rank order."""
    per_node = max(1, min(size, cluster.gpus_per_node // stride)) if stride <= cluster.gpus_per_node else 1
    return Group(size=size, per_node=per_node)


def ring_protocols(cluster: Cluster) -> tuple[Protocol, ...]:
    if cluster.collectives is not None:
        return tuple(cluster.collectives.ring)
    return (_link_protocol(cluster),)


def tree_protocols(cluster: Cluster) -> tuple[Protocol, ...]:
    return tuple(cluster.collectives.tree) if cluster.collectives is not None else ()


def _link_protocol(cluster: Cluster) -> Protocol:
    """Plain alpha-beta: a step costs the profile's link latency, no launch cost."""
    return Protocol.model_construct(name="link", launch_us=0.0, intra_step_us=cluster.node.link_latency_us,
                                    inter_step_us=cluster.nic_latency_us, bandwidth_fraction=1.0, sources={})


def nic_scaling(cluster: Cluster, nodes: int) -> float:
    """Measured bus bandwidth across `nodes` nodes over its two-node value (1 with no data)."""
    points = cluster.collectives.nic_scaling if cluster.collectives is not None else []
    if not points or nodes <= points[0][0]:
        return points[0][1] if points else 1.0
    if nodes >= points[-1][0]:
        return points[-1][1]
    x = math.log2(nodes)
    for (n0, f0), (n1, f1) in zip(points, points[1:]):
        if nodes <= n1:
            t = (x - math.log2(n0)) / (math.log2(n1) - math.log2(n0))
            return f0 + t * (f1 - f0)
    return points[-1][1]


def intra_bw(cluster: Cluster, members: int) -> float:
    """Bytes/s one GPU can push to its ring neighbour inside a node."""
    node = cluster.node
    bw = node.link_gbps * 1e9 * cluster.gpu.efficiency.intra_node_bw
    if node.fabric == "mesh" and node.gpus_per_node > 1:
        # Point-to-point mesh: a group of n uses n-1 of the gpus_per_node-1 links.
        bw *= (members - 1) / (node.gpus_per_node - 1)
    return bw


def nic_bw(cluster: Cluster, nodes: int) -> float:
    """Bytes/s one GPU's NIC delivers in a collective spanning `nodes` nodes."""
    return cluster.nic_bytes_per_s * cluster.gpu.efficiency.inter_node_bw * nic_scaling(cluster, nodes)


def bus_bw(group: Group, cluster: Cluster) -> float:
    """The group's ring bus bandwidth: the node fabric, or across nodes the NICs of the
    group's members in a node (one ring channel per NIC), whichever is slower."""
    if group.nodes == 1:
        return intra_bw(cluster, group.size)
    inside = intra_bw(cluster, group.per_node) if group.per_node > 1 else math.inf
    return min(inside, group.per_node * nic_bw(cluster, group.nodes))


def _ring(nbytes: float, group: Group, cluster: Cluster, passes: float) -> float:
    """`passes` = 2 for all-reduce (reduce-scatter then all-gather), 1 for either alone."""
    n, nodes = group.size, group.nodes
    steps = passes * (n - 1)
    inter = passes * (nodes - 1) if nodes > 1 else 0.0
    traffic = passes * (n - 1) / n * nbytes / bus_bw(group, cluster)
    return min(p.launch_us * 1e-6 + ((steps - inter) * p.intra_step_us + inter * p.inter_step_us) * 1e-6
               + traffic / p.bandwidth_fraction for p in ring_protocols(cluster))


def _tree_all_reduce(nbytes: float, group: Group, cluster: Cluster) -> float:
    """Double binary tree across nodes, a chain inside each: up, then down."""
    protocols = tree_protocols(cluster)
    if group.nodes == 1 or not protocols:
        return math.inf
    hops = (group.per_node - 1, math.ceil(math.log2(group.nodes)))
    traffic = 2 * nbytes / bus_bw(group, cluster)
    return min(p.launch_us * 1e-6 + 2 * (hops[0] * p.intra_step_us + hops[1] * p.inter_step_us) * 1e-6
               + traffic / p.bandwidth_fraction for p in protocols)


RING_PASSES = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0}


def ring_passes(kind: str, cluster: Cluster) -> float:
    """Passes over the data a collective makes: the ring's, unless the profile measured the
    library doing otherwise (gloo's all-gather and reduce-scatter cost about as much as, and
    more than, its all-reduce: `parallax calibrate` measures them)."""
    measured = cluster.collectives.passes if cluster.collectives is not None else {}
    return measured.get(kind, RING_PASSES[kind])


def all_reduce(nbytes: float, group: Group, cluster: Cluster) -> float:
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    return min(_ring(nbytes, group, cluster, ring_passes("all_reduce", cluster)),
               _tree_all_reduce(nbytes, group, cluster))


def all_gather(nbytes: float, group: Group, cluster: Cluster) -> float:
    """`nbytes` is the size of the gathered (full) tensor."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    return _ring(nbytes, group, cluster, ring_passes("all_gather", cluster))


def reduce_scatter(nbytes: float, group: Group, cluster: Cluster) -> float:
    """`nbytes` is the size of the full (unreduced) tensor on each rank."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    return _ring(nbytes, group, cluster, ring_passes("reduce_scatter", cluster))


def bus_bandwidth(kind: str, nbytes: float, group: Group, cluster: Cluster) -> float:
    """nccl-tests' busbw (bytes/s) of one collective: what the tests print, for pinning the model."""
    time = {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter}[kind](
        nbytes, group, cluster)
    factor = (2 if kind == "all_reduce" else 1) * (group.size - 1) / group.size
    return nbytes / time * factor


def _fastest_send(nbytes: float, cluster: Cluster, bw: float, inter_node: bool) -> float:
    """One point-to-point message: the protocol's launch, one step, the bytes."""
    return min(p.launch_us * 1e-6 + (p.inter_step_us if inter_node else p.intra_step_us) * 1e-6
               + nbytes / (bw * p.bandwidth_fraction) for p in ring_protocols(cluster))


def all_to_all(nbytes: float, group: Group, cluster: Cluster) -> float:
    """Each rank sends `nbytes` in total, split evenly over the group: the share for
    other nodes leaves through the rank's own NIC while the rest crosses the node fabric."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    n, k = group.size, group.per_node
    local = (k - 1) / n * nbytes / intra_bw(cluster, max(k, 2)) if k > 1 else 0.0
    remote = (n - k) / n * nbytes / nic_bw(cluster, group.nodes) if group.nodes > 1 else 0.0
    latency = (n - 1) * min(p.intra_step_us if group.nodes == 1 else p.inter_step_us
                            for p in ring_protocols(cluster)) * 1e-6
    return max(local, remote) + latency


def point_to_point(nbytes: float, cluster: Cluster, *, inter_node: bool) -> float:
    if nbytes <= 0:
        return 0.0
    bw = nic_bw(cluster, 2) if inter_node else intra_bw(cluster, 2)
    return _fastest_send(nbytes, cluster, bw, inter_node)
