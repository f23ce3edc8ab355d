"""Communication costs: collectives by algorithm, point-to-point, and where groups sit.

Every collective is priced the way NCCL's own tuning model prices it (``src/graph/tuning.cc``):
a fixed base latency, a per-step hop latency (intra-node or inter-node), and a bandwidth term
over the *bus bandwidth* the group reaches. For ``n`` ranks, ``k`` nodes, ``g`` ranks per node,
message ``S`` bytes (for all-gather / reduce-scatter, ``S`` is the gathered size):

ring all-reduce      t = a0 + 2(n-k) a_in + 2(k-1) a_x + 2 (n-1)/n * S / B
ring all-gather/RS   t = a0 + (n-k) a_in + (k-1) a_x + (n-1)/n * S / B
all-to-all           t = a0 + (n-k) a_in + (k-1) a_x + (n-1)/n * (S/n) / B   (pairwise: each
                     rank sends all but its own n-th of its S/n bytes)
tree all-reduce      t = a0 + 2 ((g-1) a_in + ceil(log2 k) a_x) + 2 S / (0.92 B)
hierarchical AR      RS over g (intra) + AR over k of S/g (inter, one NIC share each)
                     + AG over g (intra), each priced as a ring

with ``B = min(B_in, B_x)``: ``B_in`` the intra-node bus bandwidth of one device, ``B_x`` the
group's share of its nodes' NICs (``g`` members use ``g * nics / devices_per_node`` NICs, since
the other groups of the mesh communicate at the same time, rail-optimized). The tree's 0.92 and
its halved algorithm bandwidth are NCCL's. The cheapest algorithm is used, as NCCL does.

Inside a node, a collective the cluster describes on its own (``Cluster.collectives``, measured
by ``autopar calibrate`` on the local backend) takes its hop latency and bus bandwidth from
there: gloo's reduce-scatter is no ring (two processes took as long for it as for an all-reduce).
On a CPU host whose processes outnumber its cores, a collective priced on its own runs its
bandwidth term at their share of the cores (``collective_time(..., core_share=)``).

Groups follow the mesh layout of ``runtime/mesh.py``: rank = (dp_i * pp + pp_i) * tp + tp_i,
tensor parallel innermost, ranks filling node 0 first.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from functools import lru_cache

from autopar.cluster import Cluster, GroupSpan

__all__ = ["Collective", "Algorithm", "CollectiveCost", "collective_time", "p2p_time",
           "p2p_link", "mesh_span", "TREE_BANDWIDTH_FACTOR"]

#: NCCL tuning model: tree all-reduce reaches 92% of the ring's bus bandwidth.
TREE_BANDWIDTH_FACTOR = 0.92


class Collective(str, enum.Enum):
    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"


class Algorithm(str, enum.Enum):
    RING = "ring"
    TREE = "tree"
    HIERARCHICAL = "hierarchical"


@dataclass(frozen=True, slots=True)
class CollectiveCost:
    seconds: float
    algorithm: Algorithm
    bus_bandwidth: float


def _intra_bw(cluster: Cluster) -> float:
    return cluster.intra_node.effective_bandwidth


def _nic_share(cluster: Cluster) -> float:
    """Inter-node bandwidth one device can use (its share of its node's NICs)."""
    link = cluster.inter_node
    return link.effective_bandwidth * link.count / cluster.devices_per_node


def _bus(cluster: Cluster, span: GroupSpan) -> float:
    """Bus bandwidth of a ring over the group: its slowest hop."""
    if span.nodes == 1:
        return _intra_bw(cluster)
    bus = _nic_share(cluster) * span.per_node
    return min(bus, _intra_bw(cluster)) if span.per_node > 1 else bus


def _ring(cluster: Cluster, op: Collective, nbytes: float, span: GroupSpan,
          core_share: float = 1.0) -> CollectiveCost:
    n, k = span.size, span.nodes
    bus = _bus(cluster, span)
    hop = cluster.intra_node.latency_s
    measured = cluster.collectives.get(op.value) if k == 1 else None
    if measured is not None:  # inside a node, this backend's own figures for this collective
        bus, hop = measured.bus_bandwidth, measured.latency_s
    bus *= core_share
    factor = 2 if op is Collective.ALL_REDUCE else 1
    inter_steps = factor * (k - 1)
    intra_steps = factor * (n - 1) - inter_steps
    latency = (cluster.collective_latency_s + intra_steps * hop
               + inter_steps * cluster.inter_node.latency_s)
    volume = nbytes / n if op is Collective.ALL_TO_ALL else factor * nbytes
    return CollectiveCost(latency + (n - 1) / n * volume / bus, Algorithm.RING, bus)


def _tree(cluster: Cluster, nbytes: float, span: GroupSpan,
          core_share: float = 1.0) -> CollectiveCost:
    k, g = span.nodes, span.per_node
    bus = _bus(cluster, span) * core_share
    latency = (cluster.collective_latency_s
               + 2 * ((g - 1) * cluster.intra_node.latency_s
                      + math.ceil(math.log2(k)) * cluster.inter_node.latency_s))
    bus *= TREE_BANDWIDTH_FACTOR
    return CollectiveCost(latency + 2 * nbytes / bus, Algorithm.TREE, bus)


def _hierarchical(cluster: Cluster, op: Collective, nbytes: float, span: GroupSpan,
                  core_share: float = 1.0) -> CollectiveCost:
    k, g = span.nodes, span.per_node
    intra = GroupSpan(g, 1, g)
    inter = GroupSpan(k, k, 1)
    if op is Collective.ALL_REDUCE:
        t = (_ring(cluster, Collective.REDUCE_SCATTER, nbytes, intra, core_share).seconds
             + _ring(cluster, Collective.ALL_REDUCE, nbytes / g, inter, core_share).seconds
             + _ring(cluster, Collective.ALL_GATHER, nbytes, intra, core_share).seconds)
        factor = 2
    else:  # all-gather: across nodes on 1/g of the data, then inside; reduce-scatter mirrored
        t = (_ring(cluster, op, nbytes / g, inter, core_share).seconds
             + _ring(cluster, op, nbytes, intra, core_share).seconds)
        factor = 1
    n = span.size
    bus = factor * (n - 1) / n * nbytes / t if t > 0 else float("inf")
    return CollectiveCost(t, Algorithm.HIERARCHICAL, bus)


def collective_time(cluster: Cluster, op: Collective, nbytes: float, span: GroupSpan,
                    algorithm: Algorithm | None = None, *,
                    core_share: float = 1.0) -> CollectiveCost:
    """Seconds for one collective of ``nbytes`` over a group placed as ``span``; the cheapest
    algorithm unless one is named.

    ``core_share``: the share of its cores' speed the collective's bandwidth term runs at (not
    its latencies). On a CPU host whose processes outnumber its cores, gloo's copies and sums
    run on the cores the processes share: four processes on two cores took 2-3x as long as two
    for the same collective after compute, where the ring's (n-1)/n gives 1.5x
    (``benchmarks/host_collectives.py``). A collective priced on its own (data parallelism's,
    the loss average) takes :meth:`autopar.planner.host.Host.collective_share`; one inside a
    stage's work (tensor, context and expert parallelism's) takes 1, since the schedule model
    and the simulator stretch that work with the compute by processor sharing."""
    if span.size <= 1 or nbytes <= 0:
        return CollectiveCost(0.0, algorithm or Algorithm.RING, float("inf"))
    options: list[CollectiveCost] = []
    if algorithm in (None, Algorithm.RING):
        options.append(_ring(cluster, op, nbytes, span, core_share))
    if algorithm in (None, Algorithm.TREE) and op is Collective.ALL_REDUCE:
        options.append(_tree(cluster, nbytes, span, core_share))
    if algorithm in (None, Algorithm.HIERARCHICAL) and span.nodes > 1 and span.per_node > 1 \
            and op is not Collective.ALL_TO_ALL:
        options.append(_hierarchical(cluster, op, nbytes, span, core_share))
    if not options:
        raise ValueError(f"{algorithm} does not apply to {op.value} over {span}")
    return min(options, key=lambda c: c.seconds)


def p2p_link(cluster: Cluster, *, inter_node: bool) -> tuple[float, float]:
    """(latency, bandwidth) of a point-to-point transfer between two devices."""
    if inter_node:
        return cluster.inter_node.latency_s, _nic_share(cluster)
    return cluster.intra_node.latency_s, _intra_bw(cluster)


def p2p_time(cluster: Cluster, nbytes: float, *, inter_node: bool) -> float:
    """One point-to-point transfer (pipeline activations or gradients)."""
    if nbytes <= 0:
        return 0.0
    latency, bandwidth = p2p_link(cluster, inter_node=inter_node)
    return latency + nbytes / bandwidth


@lru_cache(maxsize=4096)
def _spans(devices_per_node: int, dp: int, pp: int, tp: int, cp: int = 1,
           cp_innermost: bool = False, ep: int = 1) -> dict[str, GroupSpan]:
    from autopar.runtime.mesh import rank_grid

    def span(ranks: list[int]) -> GroupSpan:
        per: dict[int, int] = {}
        for r in ranks:
            per[r // devices_per_node] = per.get(r // devices_per_node, 0) + 1
        return GroupSpan(len(ranks), len(per), max(per.values()))

    # ranks as the runtime lays them out (runtime/mesh.py: one function decides)
    g = rank_grid(dp, cp, pp, tp, cp_innermost).tolist()  # [d][c][p][t]
    D, C, P, T = range(dp), range(cp), range(pp), range(tp)
    groups = {
        "tp": [[g[d][c][p][t] for t in T] for d in D for c in C for p in P],
        "pp": [[g[d][c][p][t] for p in P] for d in D for c in C for t in T],
        "dp": [[g[d][c][p][t] for d in D] for c in C for p in P for t in T],
        "cp": [[g[d][c][p][t] for c in C] for d in D for p in P for t in T],
        "replica": [[g[d][c][p][t] for d in D for c in C] for p in P for t in T],
        # expert parallelism: ep consecutive data-parallel ranks (runtime/mesh.py)
        "ep": [[g[d][c][p][t] for d in range(e0, e0 + ep)] for e0 in range(0, dp, ep)
               for c in C for p in P for t in T],
    }
    worst: dict[str, GroupSpan] = {}
    # every group of an axis, keep the worst placed (most nodes, then fewest per node)
    for axis, lists in groups.items():
        seen: set[tuple[int, int, int]] = set()
        for ranks in lists:
            s = span(ranks)
            seen.add((s.size, s.nodes, s.per_node))
        size, nodes, per_node = max(seen, key=lambda x: (x[1], -x[2]))
        worst[axis] = GroupSpan(size, nodes, per_node)
    return worst


def mesh_span(cluster: Cluster, dp: int, pp: int, tp: int, axis: str, cp: int = 1,
              cp_innermost: bool = False, ep: int = 1) -> GroupSpan:
    """Placement of the ``axis`` groups ("dp", "pp", "tp", "cp", "replica": dp x cp, or "ep":
    ``ep`` consecutive data-parallel ranks) of a dp x pp x cp x tp mesh on ``cluster`` (the
    worst-placed group of the axis)."""
    return _spans(cluster.devices_per_node, dp, pp, tp, cp, cp_innermost, ep)[axis]
