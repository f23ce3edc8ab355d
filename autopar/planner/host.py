"""How the devices' hosts behave: GPU streams beside the compute, or CPU processes sharing cores.

A GPU computes on its own SMs; its collectives run on a few of them (NCCL's channels) beside the
compute, and a transfer is a DMA that takes no compute. Local CPU processes (the ``cpu`` preset,
a loopback link) are the other case: every rank's compute, its gloo collectives and its
point-to-point copies run on the same cores, which the kernel shares among the processes. The
step composition (:mod:`autopar.planner.cost_model`) asks this module, not the link kind:

- :meth:`Host.pipeline_cores` - the cores the ranks of a pipeline share (0: a processor each),
  with how many copies of the pipeline run at once and the cores' throughput when
  oversubscribed; the schedule model and the simulator share them by processor sharing
  (:func:`autopar.cluster.processor_share`, ``runtime/simulator.py``);
- :attr:`Host.transfers_take_compute` - a transfer is a copy both ends' cores make: a stage
  spends the time of the transfers it sends and receives (measured, docs/cost-model.md);
- :attr:`Host.collective_interference` - the share of overlapped collective time that slows the
  compute it hides behind (NCCL's SMs over the device's; 1 for gloo on the compute's cores);
- :meth:`Host.collective_share` - the speed of a collective priced outside the stages' work
  (data parallelism's) while the node's processes share its cores;
- :meth:`Host.optimizer_share` - the speed of each rank's optimizer step while every rank of
  the node steps at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import Cluster, LinkKind

__all__ = ["Host"]


@dataclass(frozen=True, slots=True)
class Host:
    """The host behaviour of ``cluster`` (see the module docstring)."""

    cluster: Cluster

    @property
    def shares_cores(self) -> bool:
        """Local CPU processes: compute, collectives and copies on the same cores."""
        return self.cluster.intra_node.kind is LinkKind.LOOPBACK

    def pipeline_cores(self) -> tuple[float, float, float]:
        """(cores the ranks of every pipeline share, their throughput when oversubscribed
        relative to fair sharing, the seconds a compute gains when its rank resumes after
        waiting: :attr:`autopar.cluster.Cluster.resume_s` on a node holding more processes than
        cores, else 0); 0 cores: every rank has a processor of its own."""
        cl = self.cluster
        crowded = 0 < cl.cores_per_node < cl.devices_per_node
        return (float(cl.cores_per_node * cl.nodes), cl.oversubscription_efficiency,
                cl.resume_s if crowded else 0.0)

    @property
    def transfers_take_compute(self) -> bool:
        return self.shares_cores

    @property
    def collective_interference(self) -> float:
        if self.shares_cores:
            return 1.0  # gloo runs on the cores the compute uses
        d = self.cluster.device
        return d.collective_sms / d.sm_count if d.sm_count else 0.0

    def collective_share(self) -> float:
        """The speed share of a collective priced outside the stages' work (data parallelism's,
        the loss average): gloo's copies and sums on cores the node's processes share, all of
        them in the collective or computing (:func:`autopar.planner.comm.collective_time`'s
        ``core_share``); 1 with a core per process and on GPUs."""
        if not self.shares_cores:
            return 1.0
        return self.cluster.compute_share(self.cluster.devices_per_node)

    def optimizer_share(self) -> float:
        """Each rank's optimizer speed while all ranks of a node step at once."""
        return self.cluster.compute_share(self.cluster.devices_per_node)
