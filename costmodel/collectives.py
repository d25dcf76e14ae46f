"""Alpha-beta cost of collectives on a cluster's intra- and inter-node links.

A group is described by its size and how many of its members share a node
(`per_node`). A group inside one node runs on the node fabric; a group that
spans nodes runs hierarchically: reduce-scatter inside the node, the
inter-node step on each GPU's own NIC carrying 1/per_node of the data, then
all-gather inside the node. Ring and tree (double binary tree) algorithms are
both priced and the cheaper is taken, as NCCL does by message size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from hardware.schema import Cluster


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


def _intra_bw(cluster: Cluster, members: int) -> float:
    """Bytes/s one GPU can push to its ring neighbour inside a node."""
    node = cluster.node
    bw = node.link_gbps * 1e9 * cluster.gpu.efficiency.intra_node_bw
    if node.fabric == "mesh" and node.gpus_per_node > 1:
        # Point-to-point mesh: a group of n uses n-1 of the gpus_per_node-1 links.
        bw *= (members - 1) / (node.gpus_per_node - 1)
    return bw


def _inter_bw(cluster: Cluster) -> float:
    return cluster.nic_bytes_per_s * cluster.gpu.efficiency.inter_node_bw


def _ring(n: int, nbytes: float, bw: float, alpha: float, passes: int) -> float:
    """`passes` = 2 for all-reduce, 1 for all-gather / reduce-scatter."""
    if n <= 1:
        return 0.0
    return passes * ((n - 1) / n * nbytes / bw + (n - 1) * alpha)


def _tree_all_reduce(n: int, nbytes: float, bw: float, alpha: float) -> float:
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * alpha + 2 * nbytes / bw


def _flat(n: int, nbytes: float, bw: float, alpha: float, passes: int) -> float:
    ring = _ring(n, nbytes, bw, alpha, passes)
    if passes == 2:
        return min(ring, _tree_all_reduce(n, nbytes, bw, alpha))
    return ring


def _collective(nbytes: float, group: Group, cluster: Cluster, passes: int) -> float:
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    a_intra = cluster.node.link_latency_us * 1e-6
    a_inter = cluster.nic_latency_us * 1e-6
    if group.nodes == 1:
        return _flat(group.size, nbytes, _intra_bw(cluster, group.size), a_intra, passes)
    k = group.per_node
    intra = _ring(k, nbytes, _intra_bw(cluster, k), a_intra, 1) if k > 1 else 0.0
    inter = _flat(group.nodes, nbytes / k, _inter_bw(cluster), a_inter, passes)
    # all-reduce: reduce-scatter + all-gather inside the node around the inter step;
    # all-gather or reduce-scatter alone: one intra pass.
    return inter + intra * (2 if passes == 2 else 1)


def all_reduce(nbytes: float, group: Group, cluster: Cluster) -> float:
    return _collective(nbytes, group, cluster, passes=2)


def all_gather(nbytes: float, group: Group, cluster: Cluster) -> float:
    """`nbytes` is the size of the gathered (full) tensor."""
    return _collective(nbytes, group, cluster, passes=1)


def reduce_scatter(nbytes: float, group: Group, cluster: Cluster) -> float:
    """`nbytes` is the size of the full (unreduced) tensor on each rank."""
    return _collective(nbytes, group, cluster, passes=1)


def all_to_all(nbytes: float, group: Group, cluster: Cluster) -> float:
    """Each rank sends `nbytes` in total, split evenly over the group."""
    if group.size <= 1:
        return 0.0
    if group.nodes == 1:
        bw, alpha = _intra_bw(cluster, group.size), cluster.node.link_latency_us * 1e-6
    else:
        bw, alpha = _inter_bw(cluster), cluster.nic_latency_us * 1e-6
    return (group.size - 1) / group.size * nbytes / bw + (group.size - 1) * alpha


def point_to_point(nbytes: float, cluster: Cluster, *, inter_node: bool) -> float:
    if nbytes <= 0:
        return 0.0
    if inter_node:
        return nbytes / _inter_bw(cluster) + cluster.nic_latency_us * 1e-6
    return nbytes / _intra_bw(cluster, 2) + cluster.node.link_latency_us * 1e-6
