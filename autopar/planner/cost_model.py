"""The cost model: what one training step of a plan costs on a cluster.

Written as math first; every factor below comes from the :class:`~autopar.cluster.Cluster`
(datasheet numbers times documented efficiencies) or from the captured graph, never fitted to
end-to-end throughput. docs/cost-model.md has the same formulas with their sources.

Per layer: :mod:`autopar.planner.layer_costs` (templates of the graph's nodes priced under a
tensor-parallel layout), per kernel: :mod:`autopar.planner.kernels`, per stage and pipeline rank:
:mod:`autopar.planner.stage_sums`, a rank's data-parallel exposure:
:mod:`autopar.planner.data_parallel_time`, its memory: :mod:`autopar.planner.memory`. This module
composes them into a step.

**Recompute**: full re-runs each block's forward (with its TP communication) in backward and
keeps only the block's input; selective re-runs the attention core (the nodes whose saved tensors
grow as ``s^2``) and drops those tensors (Korthikanti et al. 2022).

**Stages and schedule**: :meth:`CostModel.evaluate` is the search's first pass: the min-max
contiguous split (:func:`autopar.planner.stage_partition.min_max_split`) and the closed-form
pipeline time (:func:`autopar.planner.schedule_model.closed_form_pipeline_time`).
:meth:`CostModel.refine` prices a finalist for real: the stage ILP
(:func:`autopar.planner.stage_partition.partition_stages`, with this model's per-layer times,
parameters, activations, transfers and the memory left by the ZeRO stage) cuts the stages, and
the runtime's simulator runs the executor's action lists
(:func:`autopar.planner.schedule_model.simulated_pipeline_time`); activation memory follows the
in-flight micro-batches of those lists.

**Step** = pipeline time + exposed data-parallel communication + optimizer step. Data-parallel
gradients are reduced in 25 MB buckets (PyTorch DDP's default) overlapped with the backward of
the last micro-batch; the last bucket and anything beyond the overlap window are exposed, and
while a collective overlaps compute it holds ``collective_sms`` of the ``sm_count`` SMs (one per
NCCL channel), slowing that compute by the same fraction of the overlapped time. ZeRO-1/2 add an
all-gather of the updated weights after the step (exposed); ZeRO-2 reduce-scatters every
micro-batch; ZeRO-3 gathers weights before each forward and backward and reduce-scatters
gradients every micro-batch, prefetched so only the excess over the compute it overlaps is
exposed. The optimizer step is memory-bound: 28 bytes moved per parameter of the local optimizer
shard (Adam reads weights, gradients, two moments and writes three, plus the low-precision copy),
or the device's measured time per parameter where that is longer (``optimizer_s_per_param``: a
CPU core's for-loop AdamW makes ~10 passes), plus its measured fixed cost per parameter tensor
(``optimizer_s_per_tensor``, 0 for a GPU's multi-tensor kernels). The batch loss is then averaged
over the world (one all-reduce of 8 bytes, exposed: ``loss_comm_s``).

**Reported**: MFU = model FLOPs / (step x devices x peak), model FLOPs = 3 x forward GEMM FLOPs
of the graph (6 P per token + attention, as Megatron-LM counts); the hardware FLOP rate also
counts recomputation (what Narayanan et al. 2021 report as "achieved teraFLOP/s").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from autopar.cluster import Cluster, GroupSpan
from autopar.errors import AutoparError
from autopar.plan_types import Plan, Prediction, RecomputeKind, StagePlan
from autopar.planner.comm import Collective, collective_time, mesh_span, p2p_link
from autopar.planner.data_parallel_time import (DDP_BUCKET_BYTES, CollectiveTimes,
                                                exposed_data_parallel_time)
from autopar.planner.kernels import (OPTIMIZER_BYTES_PER_PARAM, gemm_time,
                                     memory_time, offloaded_optimizer_time, optimizer_time,
                                     wave_efficiency)
from autopar.planner.layer_costs import BIAS_OP, LayerCosts, price_layer
from autopar.planner.candidates import (Candidate, Evaluation, Staging, StageCost,
                                        TrainingSetup)
from autopar.planner.host import Host
from autopar.planner.memory import (BUCKET_ELEMENTS, STATE_BYTES, RankMemory, optimizer_step_bytes,
                                    peak_rank_memory, rank_memory, sharded_state_bytes)
from autopar.planner.model_costs import ModelCosts
from autopar.planner.stage_sums import StageSums
from autopar.planner.schedule_model import (PipelineTime, PipelineWork, backward_whole_at_input,
                                            first_backward_in_weight,
                                            closed_form_pipeline_time, in_flight_micro_batches,
                                            simulate_pipeline, simulated_pipeline_time)
from autopar.planner.tp_layout import TPLayout, tp_cost_spec
from autopar.units import fmt_bytes

__all__ = ["Candidate", "ModelCosts", "LayerCosts", "CostModel", "Evaluation", "StageCost",
           "TrainingSetup", "price_layer", "lower_bound_step", "COMPONENTS",
           "gemm_time", "wave_efficiency", "DDP_BUCKET_BYTES", "OPTIMIZER_BYTES_PER_PARAM",
           "optimizer_time", "memory_time", "BIAS_OP"]

#: What the plan search uses (reported in the plan document).
COMPONENTS = {
    "sharding": "sharding ILP (passes/shard.py via tensor_parallelize), per (tp, sp, "
                "micro-batch)",
    "stage_partition": "stage ILP (planner/stage_partition.py) for the finalists; "
                       "min-max contiguous split as the first pass",
    "schedule": "runtime/simulator.py over runtime/schedules.py action lists for the "
                "finalists; closed form as the first pass",
}




class CostModel:
    """Prices candidates of one model on one cluster at one global batch."""

    #: CBC's time limit for one stage ILP (a finalist's; GPT-3 175B's solve in 0.1-2.5 s). When
    #: it is hit the status says so and the LP bound still certifies the gap.
    ilp_time_limit_s: float = 5.0

    def __init__(self, model: ModelCosts, cluster: Cluster, setup: TrainingSetup) -> None:
        self.model = model
        self.cluster = cluster
        #: GPU streams or CPU processes sharing cores (planner/host.py)
        self.host = Host(cluster)
        self.setup = setup
        #: What the sharding search prices with; it is solved at each candidate's micro-batch
        #: (:meth:`tp_sizes`).
        self.tp_cost = tp_cost_spec(cluster, setup.dtype)
        self._layer_cache: dict[tuple, list[LayerCosts]] = {}
        self._in_flight_cache: dict[tuple, list[float]] = {}
        self._ahead_cache: dict[tuple, tuple[int, ...]] = {}
        self._fewest_cache: dict[tuple, float] = {}
        self._mesh_layer_cache: dict[tuple, list[LayerCosts]] = {}
        self._check_cache: dict[tuple, str | None] = {}
        self._cp_kind: dict[tuple, str] = {}  # the cheaper K/V exchange of each cp mesh
        # weights read by several layers (a tied embedding and LM head, DeBERTa's relative
        # embeddings read by every block): fqn -> (layers, numel); a repeated block's own
        # weights are its own in each repeat (Template.param_key), so they are left out
        readers: dict[str, list[int]] = {}
        for i in range(model.num_layers):
            tmpl = model.template(i)
            for fqn in tmpl.params:
                if tmpl.param_key(i, fqn) == fqn:
                    readers.setdefault(fqn, []).append(i)
        # (a frozen one has no gradient to sum)
        self._tied_weights = {fqn: (tuple(layers), model.template(layers[0]).params[fqn])
                              for fqn, layers in readers.items() if len(layers) > 1
                              and fqn not in model.template(layers[0]).frozen}
        self._coll_cache: dict[Any, dict[tuple, float]] = {}
        self._loss_cache: dict[int, float] = {}  # the loss all-reduce by world size
        self._tp_problems: dict[tuple[int, bool], str | None] = {}
        self._refined: dict[tuple, Evaluation] = {}
        self.device_peak = cluster.peak_flops(setup.dtype)
        t = [model.template(i) for i in range(model.num_layers)]
        self.model_flops_per_sequence = 3 * sum(
            tt.values(1, setup.seq)[tt.gemm_flops] for tt in t)
        #: per-layer costs summed over a candidate's stages and ranks (planner/stage_sums.py)
        self.sums = StageSums(model, cluster, self.host, self._costs,
                              lambda c: self.layout(c.tp, c.sequence_parallel,
                                                    c.micro_batch_size),
                              self.cp_attention)

    # -- tensor parallelism -------------------------------------------------------------------
    def tp_sizes(self, micro_batch_size: int) -> dict[str, int]:
        """The sizes the sharding search solves a candidate's layout at: its micro-batch and the
        training sequence. The micro-batch matters: a collective's latency is fixed while a
        GEMM's time grows with the tokens, so a layout that replicates small GEMMs to save
        collectives at one micro-batch can lose at sixteen (docs/cost-model.md)."""
        return {"b": micro_batch_size, "s": self.setup.seq}

    def layout(self, tp: int, sequence_parallel: bool, micro_batch_size: int
               ) -> TPLayout | None:
        """The sharding search's layout at this micro-batch (None at tp=1)."""
        return self.model.layout(tp, sequence_parallel, cost=self.tp_cost,
                                 sizes=self.tp_sizes(micro_batch_size))

    def prepare_layouts(self, tp: int, sequence_parallel: bool,
                        micro_batch_sizes: Sequence[int]) -> None:
        """Solve the layouts of these micro-batches with as few sharding ILPs as stay exact
        (:meth:`ModelCosts.prepare_layouts`)."""
        self.model.prepare_layouts(tp, sequence_parallel, cost=self.tp_cost,
                                   sizes=[self.tp_sizes(b) for b in micro_batch_sizes])

    # -- per-layer ---------------------------------------------------------------------------
    def layer_costs(self, tp: int, sp: bool, mbs: int, dp: int = 1, pp: int = 1, cp: int = 1,
                    cp_innermost: bool = False, ep: int = 1) -> list[LayerCosts]:
        mesh = (tp, sp, mbs, dp, pp, cp, cp_innermost, ep)  # asked per candidate: 70,000 times
        hit = self._mesh_layer_cache.get(mesh)  # for GPT-3 175B on 1024 GPUs
        if hit is not None:
            return hit
        span = mesh_span(self.cluster, dp, pp, tp, "tp", cp, cp_innermost)
        cp_span = mesh_span(self.cluster, dp, pp, tp, "cp", cp, cp_innermost) if cp > 1 else None
        ep_span = mesh_span(self.cluster, dp, pp, tp, "ep", cp, cp_innermost, ep) \
            if ep > 1 else None
        key = (tp, sp, mbs, span, cp, cp_span, ep, ep_span)
        out = self._layer_cache.get(key)
        if out is None:
            layout = self.layout(tp, sp, mbs)
            priced: dict[int, LayerCosts] = {}
            between: dict[int, LayerCosts] = {}
            out = []
            n = self.model.num_layers
            for i in range(n):
                tmpl = self.model.template(i)
                lc = priced.get(id(tmpl))
                if lc is None:
                    lc = priced[id(tmpl)] = price_layer(
                        tmpl, self.model.split(tmpl, layout, tp), self.cluster, self.setup.dtype,
                        tp, mbs, self.setup.seq, self.model.graph_float_bytes, span, cp, cp_span,
                        ep, ep_span, self.setup.moe_imbalance)
                if i + 1 < n and self.model.template(i + 1) is tmpl:
                    # a cut between two layers of one template sends what the next reads too
                    if id(tmpl) not in between:
                        between[id(tmpl)] = dataclasses.replace(
                            lc, boundary_bytes=lc.inner_boundary_bytes)
                    lc = between[id(tmpl)]
                out.append(lc)
            self._layer_cache[key] = out
        self._mesh_layer_cache[mesh] = out
        return out

    def _costs(self, c: Candidate) -> list[LayerCosts]:
        """Per-layer costs of a candidate's mesh (cached by :meth:`layer_costs`)."""
        return self.layer_costs(c.tp, c.sequence_parallel, c.micro_batch_size, c.dp, c.pp, c.cp,
                                c.cp_innermost, c.ep)

    def cp_attention(self, c: Candidate) -> str:
        """The K/V exchange a cp candidate uses: the one whose exposed time is smaller."""
        if c.cp == 1:
            return "ring"
        if c.cp_attention is not None:
            return c.cp_attention
        key = (c.tp, c.sequence_parallel, c.micro_batch_size, c.dp, c.pp, c.cp, c.cp_innermost)
        kind = self._cp_kind.get(key)
        if kind is None:
            costs = self._costs(c)
            total = {k: sum(sum(lc.cp_comm[k]) for lc in costs if lc.cp_comm)
                     for k in ("ring", "allgather")}
            kind = self._cp_kind[key] = min(total, key=lambda k: (total[k], k != "ring"))
        return kind

    # -- a candidate ---------------------------------------------------------------------------
    def well_formed_but_for_layout(self, c: Candidate) -> bool:
        """:meth:`check` without the sharding search: whether ``c`` is well formed if tp
        splits the model (which layouts to solve)."""
        if not self.setup.optimizer.elementwise and c.tp > 1:
            return False  # check refuses it: no layout to solve
        key = (*self._check_key(c), "without layout")
        if key not in self._check_cache:
            self._check_cache[key] = self._check(c, layout=False)
        return self._check_cache[key] is None

    def check(self, c: Candidate) -> str | None:
        """Structural problems (no pricing needed); None if the candidate is well formed.
        (Cached: recompute and ZeRO play no part, and the search asks for each of their
        combinations.)"""
        if c.offload != "none":
            problem = self.offload_problem(c.offload)
            if problem is not None:
                return problem
        if not self.setup.optimizer.elementwise and (c.tp > 1 or c.zero >= 1):
            return ("the optimizer updates whole tensors (not element-wise: Adafactor's row and "
                    "column statistics), which neither tensor-parallel nor ZeRO shards hold: "
                    "tp=1, zero=0")
        key = self._check_key(c)
        if key not in self._check_cache:
            self._check_cache[key] = self._check(c)
        return self._check_cache[key]

    def offload_problem(self, offload: str) -> str | None:
        """Why this cluster cannot keep the optimizer state at ``offload`` (None: it can)."""
        if offload == "disk" and self.cluster.disk_bandwidth <= 0:
            return "offload=disk needs a disk (the cluster's disk_bandwidth is 0)"
        return None

    @staticmethod
    def _check_key(c: Candidate) -> tuple:
        """What :meth:`check` depends on: every field but recompute and ZeRO."""
        return (c.dp, c.tp, c.pp, c.virtual_stages, c.micro_batch_size, c.schedule,
                c.sequence_parallel, c.cp, c.cp_innermost, c.ep)

    def _check(self, c: Candidate, layout: bool = True) -> str | None:
        """``layout=False`` leaves out whether the sharding search can split the model at
        ``c.tp`` (it solves a layout)."""
        n = self.cluster.num_devices
        if c.dp * c.tp * c.pp * c.cp != n:
            return f"dp x cp x tp x pp = {c.dp * c.cp * c.tp * c.pp}, not the {n} devices"
        if (c.cp > 1 or c.sequence_parallel) and not self.model.has_sequence:
            what = f"cp={c.cp}" if c.cp > 1 else "sequence parallelism"
            return (f"{what} splits the sequence, and the model's inputs hold no sequence dim "
                    f"(images and flat features do not)")
        if c.cp > 1:
            if self.setup.seq % (2 * c.cp):
                return (f"cp={c.cp} needs a sequence length divisible by 2 x cp = {2 * c.cp} "
                        f"(seq={self.setup.seq})")
            problem = self.model.cp_problem()
            if problem:
                return problem
        if c.ep > 1:
            experts = self.model.num_experts
            if c.dp % c.ep or not experts or experts % c.ep or c.cp > 1:
                return (f"ep={c.ep} needs a mixture-of-experts model whose experts ({experts}) "
                        f"and dp={c.dp} it divides, and cp=1")
        if self.setup.global_batch % (c.dp * c.micro_batch_size):
            return (f"global batch {self.setup.global_batch} is not divisible by dp x "
                    f"micro-batch = {c.dp * c.micro_batch_size}")
        m = self.setup.global_batch // (c.dp * c.micro_batch_size)
        if c.tp > self.cluster.devices_per_node or self.cluster.devices_per_node % c.tp:
            return (f"tp={c.tp} does not fit inside a node of "
                    f"{self.cluster.devices_per_node} devices")
        if c.sequence_parallel and (c.tp == 1 or self.setup.seq % c.tp):
            return f"sequence parallel needs tp > 1 dividing seq={self.setup.seq}"
        if c.tp > 1 and layout:
            key = (c.tp, c.sequence_parallel)
            if key not in self._tp_problems:
                self._tp_problems[key] = self.model.tp_problem(  # divisibility: any micro-batch
                    c.tp, c.sequence_parallel, cost=self.tp_cost, sizes=self.tp_sizes(1))
            if self._tp_problems[key]:
                return self._tp_problems[key]
        if c.pp * c.virtual_stages > self.model.num_layers:
            return (f"{c.pp * c.virtual_stages} stages but only {self.model.num_layers} "
                    f"layers to place")
        spec = c.schedule.spec
        if spec.min_virtual_stages > 1 and c.pp < 2:
            return f"{c.schedule.value} needs pp >= 2"
        problem = spec.shape_problem(c.pp, c.virtual_stages, m)
        return problem[0] if problem is not None else None

    def evaluate(self, c: Candidate, *, memory_first: bool = False) -> Evaluation:
        """The first pass: min-max stage split and closed-form pipeline time (fast).

        ``memory_first``: a candidate over the device's memory is returned with the reason,
        its busiest rank's memory (``ranks``: that one rank) and, in ``extra``, the peak and
        the least any rank would need without its optimizer state (what offloading could
        bring down to), without pricing its time: the search's screen, over a space most of
        which does not fit."""
        problem = self.check(c)
        if problem:
            return Evaluation(c, problem)
        m = self.setup.global_batch // (c.dp * c.micro_batch_size)
        st = self.sums.staging(c)
        if memory_first:
            peak, least = peak_rank_memory(c, st.ranks, self._rank_activations(c, m, st),
                                           self.setup.dtype,
                                           self.cluster.host_link_bandwidth > 0,
                                           self._receives_ahead(c, m), self.setup.optimizer)
            reason = self._out_of_memory((peak,))
            if reason is not None:
                return Evaluation(c, reason, ranks=(peak,), stages=st.stages,
                                  extra={"memory_limit_bytes":
                                         self.cluster.device.usable_memory_bytes,
                                         "peak_memory_bytes": peak.total,
                                         "least_without_optimizer_bytes": least})
        return self._finish(c, m, st, closed_form_pipeline_time(self._work(c, m, st)))

    def lower_bound(self, c: Candidate) -> float:
        """A step time the first pass cannot price ``c`` below. With T the whole per-micro-batch
        work (compute, recompute, tensor- and context-parallel communication) and W the busiest
        rank's share (W >= T / p), the first pass prices m W of busy time plus, for a schedule
        that does not split the backward, a bubble of (T - W) / v (``ScheduleSpec.fill_drain``);
        m W + (T - W) / v grows with W, so it is at least T (m + (p - 1) / v) / p. A split
        backward's bubble is only bounded by 0. The loss all-reduce is paid by every plan as
        priced; transfers, data-parallel communication and the optimizer step only add. ``c``
        must be well formed (:meth:`check`)."""
        prefix = self.sums.table(c).prefix
        m = self.setup.global_batch // (c.dp * c.micro_batch_size)
        total = prefix[0][-1] + prefix[1][-1] + prefix[2][-1]
        fill = 0.0 if c.schedule.spec.splits_backward else (c.pp - 1) / c.virtual_stages
        return total * (m + fill) / c.pp + self._loss_all_reduce_time(c)

    def adopt_refined(self, ev: Evaluation) -> None:
        """A :meth:`refine` answer computed by another process on the same cost model."""
        self._refined.setdefault(ev.candidate, ev)

    def refine(self, ev: Evaluation) -> Evaluation:
        """``ev``'s candidate priced for real: stages from the stage ILP, pipeline time from the
        runtime's simulator, activation memory from the schedule's in-flight micro-batches
        (cached by the candidate). Infeasible when no cut fits the memory the ILP is given."""
        from autopar.planner.stage_partition import modeled_step_time, partition_stages

        c = ev.candidate
        if ev.plan is None:
            return ev
        hit = self._refined.get(c)
        if hit is not None:
            return hit
        m = ev.plan.num_micro_batches
        problem = self.partition_problem(c)
        first_cut = self.sums.staging(c).cuts
        try:
            part = partition_stages(problem, time_limit_s=self.ilp_time_limit_s,
                                    initial=first_cut)
        except AutoparError as exc:
            found = f" ({exc.found})" if exc.found else ""
            out = Evaluation(c, f"stage ILP: {exc.summary}{found}")
            self._refined[c] = out
            return out
        st = self.sums.staging(c, part.ranges)
        sim = simulate_pipeline(self._work(c, m, st))
        # The ILP's objective models the schedule (its optimum often ties: it sees only the
        # bottleneck); the simulator is the reference for a partition. The first pass's cut, when
        # it fits the ILP's memory model, is simulated too and kept if it runs faster.
        chosen, first_sim = "ilp", None
        if tuple(first_cut) != tuple(part.ranges) and part.extra.get("initial_fits"):
            first_st = self.sums.staging(c)
            other = simulate_pipeline(self._work(c, m, first_st))
            first_sim = other.step_time
            if first_sim < sim.step_time * (1 - 1e-9):
                chosen, st, sim = "first pass", first_st, other
        pipe, _ = simulated_pipeline_time(self._work(c, m, st), sim)
        acts = self._schedule_activations(c, problem, st)
        lp = part.lp_bound if part.lp_bound is not None else part.step_time
        gap = part.gap
        info_ = {"method": "ilp" if problem.num_stages > 1 else "single stage",
                 "status": part.status, "objective_s": part.step_time, "lp_bound_s": lp,
                 "proven_optimal": part.proven_optimal,
                 "gap": gap if gap is not None else (
                     max(0.0, (part.step_time - lp) / part.step_time) if part.step_time else 0.0),
                 "integer_variables": part.num_variables,
                 "solver": part.extra.get("solver", "none"),
                 "first_pass_objective_s": modeled_step_time(problem, first_cut),
                 "simulated_pipeline_s": pipe.total_s, "chosen": chosen,
                 **({"first_pass_simulated_s": first_sim} if first_sim is not None else {}),
                 **self._resumed(sim)}
        out = self._finish(c, m, st, pipe, rank_acts=acts, partition=info_)
        out = dataclasses.replace(out, refined=True,
                                  extra={**out.extra, "stage_ilp_solve_s": part.solve_seconds})
        self._refined[c] = out
        return out

    def _resumed(self, sim: Any) -> dict[str, float]:
        """Resuming on shared cores in the simulated step (none on GPUs and with a core per
        process): the computes of all the pipeline's ranks begun after a wait, each
        ``resume_s`` more work."""
        count = sum(sim.resumed)
        if not count:
            return {}
        return {"resumed_computes": count, "resume_s": self.cluster.resume_s}

    def partition_problem(self, c: Candidate) -> Any:
        """The stage ILP's inputs for ``c``: this model's per-layer times (TP communication and
        recomputation included), per-rank parameters, activations at the recompute setting and
        boundary transfers; memory is what the ZeRO stage, ZeRO-3's gathered layers and the
        recomputed block leave of the device."""
        from autopar.planner.stage_partition import LayerCosts as StageLayer
        from autopar.planner.stage_partition import PartitionProblem

        m = self.setup.global_batch // (c.dp * c.micro_batch_size)
        costs = self._costs(c)
        times = self.sums.layer_times(costs, c.recompute, self.cp_attention(c),
                                      c.schedule.spec.splits_backward)
        layout = self.layout(c.tp, c.sequence_parallel, c.micro_batch_size)
        layers = []
        largest = 0.0
        # while one layer's backward runs: its rematerialized block and transients
        working = max(self.sums.table(c).working, default=0.0)
        w_bytes, g_bytes, _ = STATE_BYTES[self.setup.dtype]
        separate_host = self.cluster.host_link_bandwidth > 0
        n = c.dp * c.cp  # replicas: ZeRO shards over data- and context-parallel ranks
        opt_state = self.setup.optimizer.state_bytes
        per_param = sum(sharded_state_bytes(self.setup.dtype, c.zero, n, c.offload,
                                            separate_host, opt_state))
        # an expert's states shard over the dp / ep ranks holding it: priced as dense ones
        per_expert = sum(sharded_state_bytes(self.setup.dtype, c.zero, max(n // c.ep, 1),
                                             c.offload, separate_host, opt_state))
        for i, (lc, (f, b, w, _, _)) in enumerate(zip(costs, times)):
            if backward_whole_at_input(c.schedule.spec.splits_backward,
                                       c.recompute is RecomputeKind.FULL, self.sums.is_block[i]):
                # a stage holding a block runs its backward whole in its I (priced per stage
                # in StageSums.staging; per layer here, a stage holding only non-block layers
                # being rare)
                b, w = b + w - lc.split_s, 0.0  # the weight column held the split's host time
            held, experts = self.sums.layer_params(i, layout, c.tp, c.ep)
            largest = max(largest, held)
            params = held - experts + experts * per_expert / per_param
            layers.append(StageLayer(self.model.layer_names[i], f, b + w, w, params,
                                     self.sums.activation(i, lc, c.recompute), lc.boundary_bytes))
        buffers = 2 * largest * (w_bytes + g_bytes) if c.zero == 3 else 0.0
        memory = max(self.cluster.device.usable_memory_bytes - buffers - working, 1.0)
        p, v = c.pp, c.virtual_stages
        nodes = {self.sums.stage_node(r, c.tp * c.cp) for r in range(p)}
        latency, bandwidth = p2p_link(self.cluster, inter_node=len(nodes) > 1)
        # the optimizer step's temporary over the stepped share (memory.optimizer_step_bytes);
        # on a CPU it is bounded by a bucket, not per parameter: the evaluation counts it
        step_bytes = (optimizer_step_bytes(1 / n if c.zero >= 1 else 1.0, c.offload, True,
                                           self.setup.optimizer.kernel, self.setup.optimizer.step)
                      if separate_host else 0.0)
        return PartitionProblem(tuple(layers), p, m, c.schedule, v, memory, per_param,
                                bandwidth, latency, step_bytes,
                                release_at_input=c.schedule.spec.splits_backward
                                and c.recompute is RecomputeKind.FULL)

    def _schedule_activations(self, c: Candidate, problem: Any, st: Staging) -> list[float]:
        """Per pipeline rank: the peak over its action list of the activations its in-flight
        micro-batches hold, per local stage (what the stage ILP constrains), plus a recomputed
        block's working set."""
        from autopar.planner.stage_partition import in_flight_vectors

        if problem.num_stages == 1:
            return [st.ranks[0].activations * in_flight_micro_batches(
                c.schedule, 1, 1, problem.num_microbatches, 0,
                release_at_input=problem.release_at_input) + st.ranks[0].working]
        vectors = in_flight_vectors(problem)
        out = []
        for r, rs in enumerate(st.ranks):
            mine = [s.activation_bytes for s in st.stages if s.pp_rank == r]
            peak = max((sum(n * a for n, a in zip(vec, mine)) for vec in vectors[r]),
                       default=0.0)
            out.append(peak + rs.working)
        return out

    def _work(self, c: Candidate, m: int, st: Staging) -> PipelineWork:
        cores, efficiency, resume = self.host.pipeline_cores()
        return PipelineWork(c.schedule, c.pp, c.virtual_stages, m, st.forward, st.backward,
                            st.weight, st.p2p, cores=cores, replicas=c.dp * c.cp * c.tp,
                            efficiency=efficiency, resume_s=resume,
                            forward_wait_s=st.forward_wait, backward_wait_s=st.backward_wait,
                            first_backward_in_weight=first_backward_in_weight(
                                c.zero, bool(st.whole_at_input) and st.whole_at_input[0]))

    def _tied_sum_time(self, c: Candidate, st: Staging) -> float:
        """Seconds of summing the gradients of weights tied across pipeline ranks (a GPT's
        embedding on the first stage and its LM head on the last): one all-reduce per tied
        weight over the ranks holding it, after their data-parallel reduction and before the
        step (runtime/data_parallel.py ``finish_gradient_sync``), so exposed."""
        if c.pp == 1 or not self._tied_weights:
            return 0.0
        layout = self.layout(c.tp, c.sequence_parallel, c.micro_batch_size)
        split = layout.sharded_params if layout is not None else frozenset()
        rank_of = {i: stage.pp_rank for stage in st.stages
                   for i in range(stage.layers[0], stage.layers[1] + 1)}
        _, g_bytes, _ = STATE_BYTES[self.setup.dtype]
        total = 0.0
        for fqn, (layers, numel) in self._tied_weights.items():
            ranks = {rank_of[i] for i in layers}
            if len(ranks) < 2:
                continue
            nodes = {self.sums.stage_node(r, c.tp * c.cp) for r in ranks}
            per_node = max(sum(1 for r in ranks if self.sums.stage_node(r, c.tp * c.cp) == node)
                           for node in nodes)
            nbytes = numel / (c.tp if fqn in split else 1) * g_bytes
            total += collective_time(self.cluster, Collective.ALL_REDUCE, nbytes,
                                     GroupSpan(len(ranks), len(nodes), per_node),
                                     core_share=self.host.collective_share()).seconds
        return total

    def _loss_all_reduce_time(self, c: Candidate) -> float:
        """Seconds of averaging the batch loss over the world after the step: one all-reduce of a
        float64 over every rank (``ParallelModel`` returns the same loss on all of them), exposed.
        """
        world = c.dp * c.cp * c.tp * c.pp
        hit = self._loss_cache.get(world)
        if hit is None:  # the search's bound asks for every candidate; worlds are few
            per_node = min(world, self.cluster.devices_per_node)
            span = GroupSpan(world, -(-world // per_node), per_node)
            hit = collective_time(self.cluster, Collective.ALL_REDUCE, 8.0, span,
                                  core_share=self.host.collective_share()).seconds
            self._loss_cache[world] = hit
        return hit

    def _cp_comm(self, c: Candidate, st: Staging, rank: int) -> float:
        """Exposed seconds of context-parallel K/V exchange in one micro-batch of pipeline rank
        ``rank`` (part of its stages' tp_comm_s)."""
        if c.cp == 1:
            return 0.0
        costs = self._costs(c)
        kind = self.cp_attention(c)
        return sum(sum(costs[i].cp_comm.get(kind, (0.0, 0.0)))
                   for s in st.stages if s.pp_rank == rank
                   for i in range(s.layers[0], s.layers[1] + 1))

    def _ep_comm(self, c: Candidate, st: Staging, rank: int) -> float:
        """Exposed seconds of expert-parallel all-to-alls in one micro-batch of pipeline rank
        ``rank`` (part of its stages' tp_comm_s)."""
        if c.ep == 1:
            return 0.0
        costs = self._costs(c)
        return sum(costs[i].ep_forward_s + costs[i].ep_backward_s
                   for s in st.stages if s.pp_rank == rank
                   for i in range(s.layers[0], s.layers[1] + 1))

    def _finish(self, c: Candidate, m: int, st: Staging, pipe: PipelineTime,
                rank_acts: Sequence[float] | None = None,
                partition: Mapping[str, Any] | None = None) -> Evaluation:
        cl, setup = self.cluster, self.setup
        p, v = c.pp, c.virtual_stages
        dtype = setup.dtype
        w_bytes, g_bytes, _ = STATE_BYTES[dtype]
        usable = cl.device.usable_memory_bytes
        # gradients are reduced (and ZeRO shards) over every replica: dp x cp ranks
        replicas = c.dp * c.cp
        dp_span = (mesh_span(cl, c.dp, p, c.tp, "replica", c.cp, c.cp_innermost)
                   if replicas > 1 else None)
        interference = self.host.collective_interference
        ranks = self._rank_memory(c, m, st, rank_acts)
        dp_exposed = optimizer_s = slack = 0.0
        coll = CollectiveTimes(cl, dp_span, self._coll_cache.setdefault(dp_span, {}),
                               self.host.collective_share()) if dp_span is not None else None
        for r, rs in enumerate(st.ranks):
            if coll is not None:
                # rank r's backward ends `slack` before rank 0's (the drain of the pipeline)
                exposed = exposed_data_parallel_time(cl, c, rs, m, coll, w_bytes, g_bytes,
                                                     interference)
                exposed = max(0.0, exposed - slack)
                if c.zero in (1, 2):  # updated weights gathered after the step
                    exposed += coll(Collective.ALL_GATHER, rs.trainable_params * w_bytes,
                                    DDP_BUCKET_BYTES)
                dp_exposed = max(dp_exposed, exposed)
            # the trainable parameters: frozen ones are not stepped
            experts = rs.expert_params - rs.frozen_expert_params
            trainable = rs.trainable_params
            local = (trainable - experts) / replicas \
                + experts / max(replicas // c.ep, 1) if c.zero >= 1 else trainable
            # ZeRO: a rank steps the pieces of the tensors in its shard (runtime/zero.py), on
            # average its 1/replicas of them
            stepped_tensors = rs.tensors - rs.frozen_tensors
            tensors = stepped_tensors / replicas if c.zero >= 1 else stepped_tensors
            # every rank steps at once: on a CPU host they share its cores; an offloaded step
            # pipelines its copies and steps over the rank's buckets
            buckets = max(1, math.ceil(trainable / BUCKET_ELEMENTS))
            optimizer_s = max(optimizer_s, offloaded_optimizer_time(
                cl, local, c.offload, w_bytes, state_bytes=self.setup.optimizer.state_bytes,
                tensors=tensors, kernel=self.setup.optimizer.kernel, buckets=buckets,
                step=self.setup.optimizer.step) / self.host.optimizer_share())
            slack += rs.backward_chunk0
        peak_rank = max(ranks, key=lambda x: x.total)
        dp_exposed += self._tied_sum_time(c, st)
        loss_s = self._loss_all_reduce_time(c)
        step = pipe.total_s + dp_exposed + optimizer_s + loss_s
        # -- breakdown from the bottleneck rank
        b = st.ranks[pipe.bottleneck_rank]
        unit = b.forward + b.backward
        scale = pipe.busy_s / unit if unit > 0 else 0.0
        cp_comm = self._cp_comm(c, st, pipe.bottleneck_rank)
        ep_comm = self._ep_comm(c, st, pipe.bottleneck_rank)
        breakdown = {
            "compute_s": (unit - b.recompute - b.tp_comm) * scale,
            "tp_comm_s": (b.tp_comm - cp_comm - ep_comm) * scale,
            **({"cp_comm_s": cp_comm * scale} if c.cp > 1 else {}),
            **({"ep_comm_s": ep_comm * scale} if c.ep > 1 else {}),
            "pp_comm_s": pipe.p2p_s,
            "dp_comm_s": dp_exposed,
            "bubble_s": pipe.total_s - pipe.busy_s - pipe.p2p_s,
            "recompute_s": b.recompute * scale,
            "optimizer_s": optimizer_s,
            "loss_comm_s": loss_s,
        }
        tokens = setup.global_batch * setup.seq
        model_flops = self.model_flops_per_sequence * setup.global_batch
        hw_flops = model_flops + st.recompute_flops * setup.global_batch / c.micro_batch_size
        n = cl.num_devices
        prediction = Prediction(
            step_time_s=step, tokens_per_s=tokens / step,
            tflops_per_gpu=model_flops / step / n / 1e12,
            mfu=model_flops / (step * n * self.device_peak),
            peak_memory_bytes=int(peak_rank.total), breakdown=breakdown,
            memory={k: val for k, val in peak_rank.to_json().items() if k != "total"},
            stage_partition=dict(partition or {"method": "min-max split (first pass)",
                                               "pipeline": pipe.method}))
        plan = Plan(dp=c.dp, tp=c.tp, pp=p, ep=c.ep, virtual_stages=v,
                    reshard_after_forward=c.reshard_after_forward or c.zero < 3,
                    offload=c.offload, micro_batch_size=c.micro_batch_size,
                    num_micro_batches=m, schedule=c.schedule, recompute=c.recompute, zero=c.zero,
                    sequence_parallel=c.sequence_parallel, cp=c.cp,
                    cp_attention=self.cp_attention(c), cp_innermost=c.cp_innermost,
                    stages=tuple(StagePlan(s.index, s.layers, s.pp_rank, s.chunk)
                                 for s in st.stages))
        extra = {"hfu": hw_flops / (step * n * self.device_peak),
                 "hardware_tflops_per_gpu": hw_flops / step / n / 1e12,
                 "model_flops_per_step": model_flops, "memory_limit_bytes": usable,
                 "tokens_per_s_per_gpu": tokens / step / n}
        return Evaluation(c, self._out_of_memory(ranks), plan, prediction, tuple(ranks),
                          st.stages, extra)

    def _rank_memory(self, c: Candidate, m: int, st: Staging,
                     rank_acts: Sequence[float] | None = None) -> list[RankMemory]:
        """Peak bytes of each pipeline rank (:func:`autopar.planner.memory.rank_memory`) with
        the activations of the micro-batches the schedule keeps in flight (``rank_acts`` when
        the caller counted them)."""
        if rank_acts is None:
            rank_acts = self._rank_activations(c, m, st)
        return rank_memory(c, st.ranks, rank_acts, self.setup.dtype,
                           self.cluster.host_link_bandwidth > 0, self._receives_ahead(c, m),
                           self.setup.optimizer)

    def _receives_ahead(self, c: Candidate, m: int) -> tuple[int, ...]:
        """Per pipeline rank, the boundary tensors received ahead of their compute
        (``runtime/pipeline.py``): on NCCL, which pairs messages by their order, the lists are
        lowered with each receive posted where its send is (``add_communication(match=
        "order")``) and held until its compute (``ScheduleSpec.receives_ahead``: up to p - 1
        on interleaved 1F1B's first rank); on gloo, which pairs them by tag, every receive is
        posted one compute ahead, so one is held."""
        if c.pp == 1:
            return ()
        if not self.cluster.gpu:
            return (1,) * c.pp
        key = (c.schedule, c.pp, c.virtual_stages, m)  # the search asks per candidate
        ahead = self._ahead_cache.get(key)
        if ahead is None:
            spec = c.schedule.spec
            ahead = self._ahead_cache[key] = tuple(
                spec.receives_ahead(c.pp, c.virtual_stages, m, r) for r in range(c.pp))
        return ahead

    def memory_floor(self, c: Candidate) -> float:
        """Bytes below which the busiest pipeline rank of ``c`` cannot peak, from sums over the
        whole model (no stage cut): its ranks' model states and in-flight activations, averaged
        over the p ranks, bound the busiest one's (the peak adds buffers, working memory and the
        optimizer step's temporary on top). With S the states of every layer on one tp rank (a
        tied table once; experts over ep, their ZeRO shards over the dp / ep ranks holding
        them), A one micro-batch's activations of every layer and f the fewest micro-batches any
        rank keeps in flight: max_r (S_r + f_r A_r) >= (S + f A) / p."""
        table = self.sums.table(c)
        layers = len(table.costs)
        held = self.sums.rank_params(((0, layers - 1),), self.sums.layout(c), c.tp, c.ep)
        separate_host = self.cluster.host_link_bandwidth > 0
        n = c.dp * c.cp
        opt_state = self.setup.optimizer.state_bytes
        dtype = self.setup.dtype

        def per_param(shards: int, trainable: bool) -> float:
            w, g, o = sharded_state_bytes(dtype, c.zero, shards, c.offload, separate_host,
                                          opt_state if trainable else 0.0)
            return w + (g + o if trainable else o)  # frozen: weights and a master copy

        ne = max(n // c.ep, 1)
        dense, fdense = held.params - held.experts, held.frozen - held.frozen_experts
        states = ((dense - fdense) * per_param(n, True) + fdense * per_param(n, False)
                  + (held.experts - held.frozen_experts) * per_param(ne, True)
                  + held.frozen_experts * per_param(ne, False))
        m = self.setup.global_batch // (c.dp * c.micro_batch_size)
        if c.schedule.spec.splits_backward and c.recompute is RecomputeKind.FULL:
            # its stages may free their activations at I (:meth:`_rank_activations`), which
            # only the action lists count (seconds each): the states alone bound it
            fewest = 0.0
        else:
            key = (c.schedule, c.pp, c.virtual_stages, m)
            fewest = self._fewest_cache.get(key)
            if fewest is None:
                fewest = self._fewest_cache[key] = min(
                    c.schedule.spec.in_flight(c.pp, c.virtual_stages, m, r) for r in range(c.pp))
        activations = table.prefix[5][-1]  # the A column (StageSums.table) over every layer
        return (states + fewest * activations) / c.pp

    def _rank_activations(self, c: Candidate, m: int, st: Staging) -> list[float]:
        """Activation bytes of each pipeline rank: the micro-batches its schedule keeps in
        flight, and the working memory of its largest layer's backward."""
        # every stage freeing its activations at its I (full recompute under a split backward);
        # a stage that does not (no block) keeps them to its W, which all stages are charged
        at_input = bool(st.whole_at_input) and all(st.whole_at_input)
        key = (c.schedule, c.pp, c.virtual_stages, m, at_input)
        flight = self._in_flight_cache.get(key)
        if flight is None:
            flight = self._in_flight_cache[key] = [
                in_flight_micro_batches(c.schedule, c.pp, c.virtual_stages, m, r,
                                        release_at_input=at_input)
                for r in range(c.pp)]
        return [rs.activations * f + rs.working for rs, f in zip(st.ranks, flight)]

    def _out_of_memory(self, ranks: Sequence[RankMemory]) -> str | None:
        """Why the busiest rank does not fit the device (None when every rank does)."""
        usable = self.cluster.device.usable_memory_bytes
        peak = max(ranks, key=lambda x: x.total)
        if peak.total <= usable:
            return None
        return (f"needs {fmt_bytes(peak.total)} on pp rank {peak.pp_rank} (weights "
                f"{fmt_bytes(peak.weights)}, grads {fmt_bytes(peak.gradients)}, optimizer "
                f"{fmt_bytes(peak.optimizer)}, activations {fmt_bytes(peak.activations)}); "
                f"{fmt_bytes(usable)} usable")

    def with_sharding(self, ev: Evaluation) -> Evaluation:
        """``ev`` with its plan's per-GEMM tensor-parallel choices (the sharding search's, by
        node name of the captured graph; left empty when the graph is a shallower copy of the
        model: the names of the blocks it did not capture do not exist)."""
        if ev.plan is None or ev.candidate.tp == 1 or self.model.extended:
            return ev
        layout = self.layout(ev.candidate.tp, ev.candidate.sequence_parallel,
                             ev.candidate.micro_batch_size)
        return dataclasses.replace(
            ev, plan=ev.plan.replace(gemm_sharding=dict(layout.gemm_sharding)))


def lower_bound_step(cm: CostModel, c: Candidate) -> float:
    """A step time no candidate with this (dp, tp, pp, micro-batch, sp) can beat: its compute
    and tensor-parallel communication spread perfectly over the pipeline, without bubble,
    pipeline or data-parallel communication, recompute or optimizer step."""
    costs = cm._costs(c)
    m = cm.setup.global_batch // (c.dp * c.micro_batch_size)
    work = sum(lc.forward_s + lc.backward_s + lc.weight_s + lc.tp_forward_s + lc.tp_backward_s
               for lc in costs)
    return m * work / c.pp
