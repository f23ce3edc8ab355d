"""What the data-parallel (and ZeRO) communication of one pipeline rank adds to a step.

Gradients are reduced over every replica (dp x cp ranks) in 25 MB buckets (PyTorch DDP's default
``bucket_cap_mb``) overlapped with the backward of the last micro-batch: the last bucket and what
the backward cannot hide are exposed (Li et al. 2020, "PyTorch Distributed": gradient bucketing).
ZeRO-1/2 all-gather the updated weights after the step (exposed); ZeRO-2 reduce-scatters after
every micro-batch's backward; ZeRO-3 (FSDP) gathers each layer's weights before its forward and
backward and reduce-scatters its gradients after the backward, prefetched one layer ahead, so
only the excess over the compute it overlaps is exposed (Rajbhandari et al. 2020; Zhao et al.
2023, "PyTorch FSDP"). While a collective overlaps compute it slows that compute by
``interference`` of the overlapped time (:attr:`autopar.planner.host.Host.collective_interference`).
Without ``Cluster.overlap_grad_reduce`` every bucket waits for the end of the backward.
"""

from __future__ import annotations

from typing import Callable

from autopar.cluster import Cluster, GroupSpan
from autopar.planner.candidates import Candidate, RankSums
from autopar.planner.comm import Collective, collective_time

__all__ = ["DDP_BUCKET_BYTES", "CollectiveTimes", "exposed_data_parallel_time"]

#: PyTorch DDP's default gradient bucket (bucket_cap_mb=25).
DDP_BUCKET_BYTES = 25 * 2**20


class CollectiveTimes:
    """Seconds of collectives over one group of ranks, memoized by (op, bytes): the search asks
    for the same few sizes for every candidate of a mesh."""

    def __init__(self, cluster: Cluster, span: GroupSpan,
                 cache: dict[tuple[Collective, float], float], core_share: float = 1.0) -> None:
        self.cluster, self.span, self.cache = cluster, span, cache
        self.core_share = core_share  # see collective_time: 1 unless processes share cores

    def one(self, op: Collective, nbytes: float) -> float:
        t = self.cache.get((op, nbytes))
        if t is None:
            t = self.cache[(op, nbytes)] = collective_time(
                self.cluster, op, nbytes, self.span, core_share=self.core_share).seconds
        return t

    def __call__(self, op: Collective, nbytes: float, unit: float) -> float:
        """``nbytes`` moved as collectives of ``unit`` bytes (buckets, layers)."""
        if nbytes <= 0:
            return 0.0
        whole, rest = divmod(nbytes, unit)
        return whole * self.one(op, unit) + self.one(op, rest)


def exposed_data_parallel_time(cluster: Cluster, c: Candidate, rs: RankSums, m: int,
                               coll: Callable[[Collective, float, float], float],
                               weight_bytes: float, grad_bytes: float,
                               interference: float) -> float:
    """Seconds of rank ``rs``'s data-parallel communication not hidden behind its compute over
    a step of ``m`` micro-batches (before the pipeline's drain slack is taken off):
    ``coll(op, nbytes, unit)`` prices ``nbytes`` over the replica group in pieces of ``unit``."""
    # frozen parameters are gathered (ZeRO-3) but have no gradient to reduce
    grads, weights = rs.trainable_params * grad_bytes, rs.params * weight_bytes
    window = rs.backward
    reduce_op = Collective.ALL_REDUCE if c.zero == 0 else Collective.REDUCE_SCATTER
    bucket = DDP_BUCKET_BYTES
    last_bucket = coll(reduce_op, min(grads, bucket), bucket)
    if not cluster.overlap_grad_reduce:  # after the whole backward, every bucket
        t = coll(reduce_op, grads, bucket)
        exposed = t if c.zero <= 1 else m * t
        overlapped = 0.0
        if c.zero == 3:
            exposed += m * 2 * coll(Collective.ALL_GATHER, weights,
                                    max(rs.params / max(rs.layers, 1), 1.0) * weight_bytes)
    elif c.zero <= 1:  # the last bucket waits for the end of the backward; the rest overlaps
        t = coll(reduce_op, grads, bucket)
        exposed = max(last_bucket, t - window)
        overlapped = t - exposed
    elif c.zero == 2:  # a reduce-scatter after every micro-batch's backward
        t = coll(Collective.REDUCE_SCATTER, grads, bucket)
        tail = max(last_bucket, t - window)
        exposed = (m - 1) * max(0.0, t - window) + tail
        overlapped = (m - 1) * min(t, window) + t - tail
    else:  # ZeRO-3: per layer, gather for forward and backward, reduce-scatter after backward
        unit = max(rs.params / max(rs.layers, 1), 1.0)
        ag = coll(Collective.ALL_GATHER, weights, unit * weight_bytes)
        rs_t = coll(Collective.REDUCE_SCATTER, grads,
                    max(rs.trainable_params / max(rs.layers, 1), 1.0) * grad_bytes)
        # kept gathered from forward to backward: the backward gathers nothing
        ag_b = ag if c.reshard_after_forward else 0.0
        first = rs.largest_layer_params * weight_bytes  # the first gather has nothing to hide behind
        exposed = (m * (max(0.0, ag - rs.forward) + max(0.0, ag_b + rs_t - window))
                   + coll(Collective.ALL_GATHER, first, first))
        overlapped = m * (min(ag, rs.forward) + min(ag_b + rs_t, window))
        if c.schedule.spec.splits_backward:
            # the weight-gradient action gathers once more (the input-gradient action's end
            # freed the parameters), behind work of a forward's size
            exposed += m * max(0.0, ag - rs.forward)
            overlapped += m * min(ag, rs.forward)
    # overlapped communication takes SMs from the compute it hides behind
    return exposed + overlapped * interference
