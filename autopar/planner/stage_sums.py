"""A candidate's per-layer costs summed over its stages and pipeline ranks: what the step
composition (:mod:`autopar.planner.cost_model`) and the stage ILP's inputs read.

Per layer at a recompute setting (:meth:`StageSums.layer_times`, :meth:`StageSums.activation`):
forward and backward with their tensor-parallel and context-parallel communication, the
weight-gradient half, the recomputed forward (full: the block's forward and its collectives;
selective: the attention core, Korthikanti et al. 2022), and the saved bytes. Those columns are
kept as prefix sums (:class:`LayerTable`), so a stage's sums are two lookups whatever its
length; :meth:`StageSums.staging` cuts the layers into the schedule's stages (the first pass's
min-max split, or given cuts) and sums each stage and each pipeline rank (its parameters with a
tied table counted once, the largest layer's, the experts it holds, its activations).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Sequence

from autopar.cluster import Cluster
from autopar.ir import LayerKind
from autopar.plan_types import RecomputeKind
from autopar.planner.candidates import Candidate, HeldParams, RankSums, Staging, StageCost
from autopar.planner.comm import mesh_span, p2p_time
from autopar.planner.host import Host
from autopar.planner.layer_costs import LayerCosts
from autopar.planner.model_costs import ModelCosts
from autopar.planner.schedule_model import backward_whole_at_input, first_backward_in_weight
from autopar.planner.stage_partition import min_max_split
from autopar.planner.tp_layout import TPLayout

__all__ = ["LayerTable", "StageSums"]


@dataclasses.dataclass(frozen=True)
class LayerTable:
    """One mesh's per-layer costs at one recompute setting, as prefix sums over the layers:
    column j's sum over layers [a, b] is ``prefix[j][b + 1] - prefix[j][a]``. Columns: forward,
    backward, weight gradient, recompute, tensor-parallel time; saved activation bytes; forward
    and backward tensor-parallel calls."""

    costs: Sequence[LayerCosts]
    times: Sequence[tuple[float, float, float, float, float]]
    prefix: tuple[tuple[float, ...], ...]
    #: per layer, the bytes held only while its backward runs: what a recomputed block
    #: re-materializes beyond what it keeps, plus its backward transients
    working: tuple[float, ...]
    #: FLOPs recomputed per micro-batch over the whole model
    recompute_flops: float
    #: whether the weight column includes the split backward's host time (``LayerCosts.split_s``)
    split: bool = False


class StageSums:
    """Stage and rank sums of one model's candidates on one cluster (cached: many candidates
    share them; only m, ZeRO and the schedule's shape differ). ``costs``, ``layout`` and
    ``cp_attention`` are the cost model's per-layer prices, tensor-parallel layout and K/V
    exchange of a candidate."""

    def __init__(self, model: ModelCosts, cluster: Cluster, host: Host,
                 costs: Callable[[Candidate], Sequence[LayerCosts]],
                 layout: Callable[[Candidate], TPLayout | None],
                 cp_attention: Callable[[Candidate], str]) -> None:
        self.model, self.cluster, self.host = model, cluster, host
        self.costs, self.layout, self.cp_attention = costs, layout, cp_attention
        self.is_block = [k is LayerKind.BLOCK for k in model.layer_kinds]
        self._split_cache: dict[tuple, tuple[tuple[int, int], ...]] = {}
        self._staging_cache: dict[tuple, Staging] = {}
        self._table_cache: dict[tuple, LayerTable] = {}
        self._params_cache: dict[tuple, HeldParams] = {}

    def layer_times(self, costs: Sequence[LayerCosts], recompute: RecomputeKind,
                     cp_attention: str = "ring", split_backward: bool = False
                     ) -> list[tuple[float, float, float, float, float]]:
        """(forward, backward, weight, recompute, tp) per layer, forward/backward incl. TP and
        the context-parallel K/V exchange (counted with the tensor-parallel communication); the
        weight's time includes the split backward's host cost when the schedule splits it."""
        out = []
        for lc, block in zip(costs, self.is_block):
            cp_f, cp_b = lc.cp_comm.get(cp_attention, (0.0, 0.0))
            r = 0.0
            if block and recompute is RecomputeKind.FULL:
                r = lc.forward_s + lc.tp_forward_s + cp_f + lc.checkpoint_s
            elif block and recompute is RecomputeKind.SELECTIVE and not lc.cp_comm:
                r = lc.core_forward_s  # under cp the ring attention keeps no scores to redo
            # SP's GEMM inputs gathered again in the backward, unless the layer is a block
            # recomputed whole (runtime/layer_recompute.py: it saves nothing to gather again;
            # its recompute's forward gathers them, in r)
            again = 0.0 if block and recompute is RecomputeKind.FULL else lc.regather_s
            tp = lc.tp_forward_s + lc.tp_backward_s + cp_f + cp_b + again
            out.append((lc.forward_s + lc.tp_forward_s + cp_f,
                        lc.backward_s + lc.tp_backward_s + cp_b + r + again,
                        lc.weight_s + (lc.split_s if split_backward else 0.0), r, tp))
        return out

    def activation(self, i: int, lc: LayerCosts, recompute: RecomputeKind) -> float:
        """Saved bytes of layer ``i`` per micro-batch at the recompute setting."""
        if self.is_block[i] and recompute is RecomputeKind.FULL:
            return lc.ckpt_bytes
        if self.is_block[i] and recompute is RecomputeKind.SELECTIVE:
            return lc.act_selective_bytes
        return lc.act_bytes

    def split(self, times: Sequence[float], num_stages: int, key: tuple
              ) -> tuple[tuple[int, int], ...]:
        """The first pass's stage cut (min-max contiguous split), cached by ``key``."""
        k = (key, num_stages)
        out = self._split_cache.get(k)
        if out is None:
            out = min_max_split(times, num_stages)
            self._split_cache[k] = out
        return out

    def table(self, c: Candidate) -> LayerTable:
        """Prefix sums over the layers of ``c``'s per-layer costs at its recompute setting (cached:
        a stage's sums are then two lookups, whatever its length)."""
        costs = self.costs(c)
        cp_attention = self.cp_attention(c)
        # a split backward's host time, where the device prices one (else the same table)
        split = (c.schedule.spec.splits_backward
                 and self.cluster.device.split_backward_overhead_s > 0)
        key = (id(costs), c.recompute, cp_attention, split)
        hit = self._table_cache.get(key)
        if hit is None:
            times = self.layer_times(costs, c.recompute, cp_attention, split)
            acts = [self.activation(i, lc, c.recompute) for i, lc in enumerate(costs)]
            # while a layer's backward runs: its rematerialized activations (recompute) and
            # its transient gradients
            working = [(lc.act_bytes - a if block and c.recompute is not RecomputeKind.NONE
                        else 0.0) + lc.transient_bytes
                       for lc, a, block in zip(costs, acts, self.is_block)]
            f_calls: list[float] = []
            b_calls: list[float] = []
            for lc, block in zip(costs, self.is_block):
                f = sum(1 for _, direction, _ in lc.tp_calls if direction == "forward")
                b = sum(1 for _, direction, _ in lc.tp_calls if direction == "backward")
                if block and c.recompute is RecomputeKind.FULL:
                    b += f  # the forward re-run inside the backward
                f_calls.append(f)
                b_calls.append(b)
            rec_flops = 0.0
            for lc, block in zip(costs, self.is_block):
                if block and c.recompute is RecomputeKind.FULL:
                    rec_flops += lc.gemm_flops
                elif block and c.recompute is RecomputeKind.SELECTIVE:
                    rec_flops += lc.core_flops
            columns: list[list[float]] = [[t[j] for t in times] for j in range(5)]
            columns += [acts, f_calls, b_calls]
            hit = LayerTable(costs, times, tuple(tuple(itertools.accumulate(col, initial=0.0))
                                                 for col in columns), tuple(working), rec_flops,
                             split)
            self._table_cache[key] = hit
        return hit

    def staging(self, c: Candidate, cuts: Sequence[tuple[int, int]] | None = None
                 ) -> "Staging":
        """Stage cut (the first pass's unless ``cuts`` are given) and per-stage, per-rank sums
        of a candidate (cached: many candidates share them; only m, ZeRO and the schedule's
        shape differ)."""
        spec = c.schedule.spec
        zero_bubble = spec.splits_backward
        table = self.table(c)
        # the table stands for the per-layer prices (so for tp, cp, ep, SP, the micro-batch, the
        # recompute setting and each axis's span); the data-parallel degree enters no sum
        # the first stage's weight gradients go one layer at a time under ZeRO-3 only; else its
        # whole backward is one call in its W
        by_layer = zero_bubble and not first_backward_in_weight(c.zero)
        key = (id(table), c.pp, c.virtual_stages, zero_bubble, by_layer, spec.placement,
               tuple(cuts) if cuts else None)
        hit = self._staging_cache.get(key)
        if hit is not None:
            return hit
        p, v = c.pp, c.virtual_stages
        costs, times = table.costs, table.times
        if cuts is None:
            cuts = self.split([f + b + w for f, b, w, _, _ in times], p * v,
                              (c.tp, c.sequence_parallel, c.micro_batch_size, c.recompute,
                               mesh_span(self.cluster, c.dp, p, c.tp, "tp", c.cp,
                                         c.cp_innermost), c.cp))
        layout = self.layout(c)
        rank_of = [spec.stage_to_rank(s, p) for s in range(len(cuts))]
        p2ps = []
        for s, (first, last) in enumerate(cuts[:-1]):
            inter = self.stage_node(rank_of[s], c.tp * c.cp) != \
                self.stage_node(rank_of[s + 1], c.tp * c.cp)
            p2ps.append(p2p_time(self.cluster, costs[last].boundary_bytes, inter_node=inter))
        # a transfer both ends' cores copy (local processes): each stage's forward and backward
        # also spend the time of the transfers it receives and sends (planner/host.py)
        host_copies = self.host.transfers_take_compute
        F, B, W, R, T, A, FC, BC = table.prefix
        chunks = {r: spec.stages_of_rank(r, p, v) for r in range(p)}
        stages: list[StageCost] = []
        whole = tuple(backward_whole_at_input(zero_bubble, c.recompute is RecomputeKind.FULL,
                                              any(self.is_block[first:last + 1]))
                      for first, last in cuts)
        for s, (first, last) in enumerate(cuts):
            lo, hi = first, last + 1
            f, b, w = F[hi] - F[lo], B[hi] - B[lo], W[hi] - W[lo]
            if not zero_bubble:
                b, w = b + w, 0.0
            elif whole[s]:  # one backward call, no split's host time (the table added it)
                b, w = b + w - (sum(costs[i].split_s for i in range(lo, hi))
                                if table.split else 0.0), 0.0
            elif s == 0 and not by_layer and table.split:
                # no input to differentiate: the runtime's W runs the whole backward in one call,
                # without the split's host time (the table added it per layer). I and W keep
                # their halves here, for the closed form (the paper's lists step the same
                # whichever of the two runs the work: tests/test_zb_v.py); the simulator moves
                # it all to W (PipelineWork.first_backward_in_weight)
                w = max(w - sum(costs[i].split_s for i in range(lo, hi)), 0.0)
            p2p = p2ps[s] if s < len(cuts) - 1 else 0.0
            if host_copies:
                copies = p2p + (p2ps[s - 1] if s > 0 else 0.0)
                f, b = f + copies, b + copies
            rank = rank_of[s]
            stages.append(StageCost(s, (first, last), rank, chunks[rank].index(s), f, b, w,
                                    R[hi] - R[lo], T[hi] - T[lo], p2p, A[hi] - A[lo]))
        # what each stage receives from another rank: its input, and its output's gradient
        received = [max(costs[first - 1].boundary_bytes if s > 0 and rank_of[s - 1] != rank_of[s]
                        else 0.0,
                        costs[last].boundary_bytes if s < len(cuts) - 1
                        and rank_of[s + 1] != rank_of[s] else 0.0)
                    for s, (first, last) in enumerate(cuts)]
        ranks = []
        for rank in range(p):
            mine = [stages[s] for s in chunks[rank]]
            held = self.rank_params(tuple(st.layers for st in mine), layout, c.tp, c.ep)
            working = max((max(table.working[st.layers[0]:st.layers[1] + 1]) for st in mine),
                          default=0.0)
            ranks.append(RankSums(
                params=held.params, largest_layer_params=held.largest_layer,
                expert_params=held.experts, frozen_params=held.frozen,
                frozen_expert_params=held.frozen_experts,
                frozen_tensors=held.frozen_tensors,
                largest_layer_trainable=held.largest_layer_trainable,
                layers=sum(st.layers[1] - st.layers[0] + 1 for st in mine),
                activations=sum(st.activation_bytes for st in mine), working=max(working, 0.0),
                forward=sum(st.forward_s for st in mine),
                backward=sum(st.backward_s + st.weight_s for st in mine),
                backward_chunk0=sum(st.backward_s + st.weight_s for st in mine if st.chunk == 0),
                recompute=sum(st.recompute_s for st in mine),
                tp_comm=sum(st.tp_comm_s for st in mine), tensors=held.tensors,
                received_bytes=max((received[s] for s in chunks[rank]), default=0.0),
                largest_param=held.largest_param))
        # a tensor-parallel collective's arrival (a0 per call) is spent waiting on the peers,
        # not computing: on shared cores it takes no core (runtime/simulator.py)
        a0 = self.cluster.collective_latency_s if c.tp > 1 else 0.0
        fwd_wait = tuple(a0 * (FC[last + 1] - FC[first]) for first, last in cuts)
        bwd_wait = tuple(a0 * (BC[last + 1] - BC[first]) for first, last in cuts)
        out = Staging(tuple(stages), tuple(ranks),
                      tuple(st.forward_s for st in stages), tuple(st.backward_s for st in stages),
                      tuple(st.weight_s for st in stages), tuple(st.p2p_s for st in stages[:-1]),
                      table.recompute_flops, tuple(cuts), fwd_wait, bwd_wait, whole)
        self._staging_cache[key] = out
        return out

    def stage_node(self, pp_rank: int, tp: int) -> int:
        """The node of pipeline rank ``pp_rank``'s first rank; ``tp``: the ranks of one stage
        (tp x cp: pipeline stages stride by both, runtime/mesh.py)."""
        return (pp_rank * tp) // self.cluster.devices_per_node

    def layer_params(self, i: int, layout: TPLayout | None, tp: int, ep: int = 1
                      ) -> tuple[float, float]:
        """(parameters, of which experts) layer ``i`` reads, per tensor- and expert-parallel
        rank."""
        split = layout.sharded_params if layout is not None else frozenset()
        tmpl = self.model.template(i)
        total = experts = 0.0
        for fqn, numel in tmpl.params.items():
            share = numel / tp if fqn in split else numel
            if fqn in tmpl.expert_params:
                share /= ep
                experts += share
            total += share
        return total, experts

    def rank_params(self, ranges: tuple[tuple[int, int], ...], layout: TPLayout | None,
                     tp: int, ep: int = 1) -> HeldParams:
        """The parameters one tp rank holding the layers of ``ranges`` holds (a tied table read
        by two of them once; experts split over ep ranks): :class:`HeldParams`."""
        split = layout.sharded_params if layout is not None else frozenset()
        key = (ranges, split, tp, ep)  # layouts of several micro-batches often shard alike
        hit = self._params_cache.get(key)
        if hit is not None:
            return hit
        seen: dict[Any, float] = {}
        experts: dict[Any, float] = {}
        frozen: dict[Any, bool] = {}
        largest = largest_trainable = 0.0
        for first, last in ranges:
            for i in range(first, last + 1):
                tmpl = self.model.template(i)
                layer_total = layer_trainable = 0.0
                for fqn, numel in tmpl.params.items():
                    share = numel / tp if fqn in split else numel
                    where = tmpl.param_key(i, fqn)
                    if fqn in tmpl.expert_params:
                        share /= ep
                        experts[where] = share
                    layer_total += share
                    seen[where] = share
                    frozen[where] = fqn in tmpl.frozen
                    layer_trainable += 0.0 if frozen[where] else share
                largest = max(largest, layer_total)
                largest_trainable = max(largest_trainable, layer_trainable)
        trainable = [share for where, share in seen.items() if not frozen[where]]
        out = HeldParams(
            params=sum(seen.values()), largest_layer=largest, experts=sum(experts.values()),
            tensors=len(seen), largest_param=max(trainable, default=0.0),
            frozen=sum(share for where, share in seen.items() if frozen[where]),
            frozen_experts=sum(share for where, share in experts.items() if frozen[where]),
            frozen_tensors=len(seen) - len(trainable), largest_layer_trainable=largest_trainable)
        self._params_cache[key] = out
        return out
