"""Per-layer costs: a layer's template priced on a cluster.

:func:`price_layer` prices a layer template (:mod:`autopar.planner.layer_templates`;
:class:`~autopar.planner.model_costs.ModelCosts` builds them from the analysis pass) under a
tensor-parallel layout on a cluster (:mod:`autopar.planner.kernels` for each term) into
:class:`LayerCosts`: forward and backward time, saved activations, boundary bytes and the
layout's collectives.

**Per node** (one micro-batch of ``b`` sequences of ``s``):

- GEMM ``(batch, M, N, K)``: :func:`~autopar.planner.kernels.gemm_time`; backward: the
  input-gradient GEMM ``(batch, M, K, N)`` and, for weights, the weight-gradient GEMM
  ``(1, N, K, batch M)``.
- fused attention: ``t = max(F / (peak * e_attn), bytes / (bw * e_mem), floor)``, backward
  ``2.5 F`` (FlashAttention-2 recomputes the scores: 5 matmuls to the forward's 2); a device's
  measured ``attention_table`` where it has one.
- everything else is memory-bound, backward twice the bytes (gradient in, saved input, gradient
  out), and only for ops on the gradient path.

Bytes are the analysis pass's, re-priced at the training precision.

**Tensor parallel** (``t``): the layout is the sharding search's (:mod:`autopar.planner.tp_layout`:
``tensor_parallelize`` on the captured graph, once per ``(t, SP)``). A node whose strategy splits
it does ``1/t`` of the work (column GEMMs ``N/t``, row GEMMs ``K/t``, batched GEMMs and attention
by heads, everything else ``1/t`` of its bytes); a saved activation, a pipeline boundary tensor
or a parameter costs ``1/t`` of its bytes per rank when its producer's placement is sharded.
Communication per micro-batch is the program's own list (``TPProgram.layer_comm``: each
collective's kind, direction and bytes), priced by :mod:`autopar.planner.comm` on the
tensor-parallel group; Megatron-LM does not overlap it, neither does this model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from autopar.cluster import Cluster
from autopar.planner.comm import Collective, collective_time, p2p_time
from autopar.planner.kernels import (ATTENTION_BACKWARD_FACTOR, PRECISION_BYTES, conv_times,
                                     gemm_time, memory_time, table_rate)
from autopar.planner.layer_templates import (BIAS_OP, CONV_OP, EXPERT_OP, LayerSplit, Split,
                                             Template, TensorRef, TermKind, seq_degree)
from autopar.planner.memory import STATE_BYTES

__all__ = ["LayerCosts", "price_layer", "seq_degree", "BIAS_OP",
           "GRAD_ACCUMULATION_READS_WRITES", "cp_exchange"]

#: Gradient-sized reads and writes of accumulating one micro-batch's weight gradients: read the
#: buffer and the new gradient, write the buffer (autograd's ``.grad +=``, or the data-parallel
#: layer's add into its flat bucket, runtime/zero.py), once per micro-batch: what makes many small
#: micro-batches cost more than a few large ones beyond their GEMM rates. Megatron can fuse it into
#: the weight-gradient GEMM (``gradient_accumulation_fusion``); autopar's runtime does not.
GRAD_ACCUMULATION_READS_WRITES = 3

#: Ops runtime/moe.py runs per local expert (linear, chunk, activation, product, linear) and for
#: the routing around them (sort, count, gather, weigh, accumulate...; with expert parallelism
#: also the count exchange, two all-to-alls and the regrouping): what the host's per-node cost
#: multiplies, counted from the code.
MOE_OPS_PER_EXPERT = 5
MOE_ROUTING_OPS = (25, 43)  # forward ops: without, with expert parallelism
MOE_ROUTING_GRAD_OPS = (8, 14)  # of them, autograd nodes the backward runs


@dataclass(frozen=True, slots=True)
class LayerCosts:
    """One layer, one micro-batch, on one tensor-parallel rank."""

    forward_s: float  # compute only
    backward_s: float  # input gradients (and memory-bound backward)
    weight_s: float  # weight gradients
    core_forward_s: float  # attention core forward (selective recomputation)
    tp_forward_s: float
    tp_backward_s: float
    act_bytes: float  # saved activations, no recomputation
    act_selective_bytes: float
    ckpt_bytes: float  # the input full recomputation keeps
    boundary_bytes: float  # what a pipeline cut after it sends (per tp rank)
    gemm_flops: float  # forward GEMM FLOPs of the whole layer (unsplit)
    core_flops: float
    #: (collective, "forward"/"backward", bytes at the training precision) per call
    tp_calls: tuple[tuple[str, str, float], ...] = ()
    #: Context parallelism: the exposed time of the K/V exchange of its attention, forward and
    #: backward, by algorithm ("ring", "allgather"); empty at cp = 1.
    cp_comm: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    #: Backward all-gathers of the sequence-parallel GEMM inputs kept as shards (seconds; not
    #: in ``tp_backward_s``: a fully recomputed layer saves nothing and gathers nothing more)
    regather_s: float = 0.0
    #: Expert parallelism: the all-to-alls of its experts (dispatch and combine), forward and
    #: backward, exposed (also counted in ``tp_forward_s`` / ``tp_backward_s``).
    ep_forward_s: float = 0.0
    ep_backward_s: float = 0.0
    #: What a cut between it and the next layer of the same template sends (per tp rank):
    #: :attr:`boundary_bytes` plus the tables the next block reads too (``Template``)
    inner_boundary_bytes: float = 0.0
    #: Held only while the layer's backward runs, on top of the saved activations: the gradient
    #: of its largest tensor and of that tensor's input (``Template.transient``).
    transient_bytes: float = 0.0
    #: Host seconds the zero-bubble schedules' split backward adds to its weight-gradient
    #: action (``DeviceSpec.split_backward_overhead_s`` per autograd node); 0 otherwise.
    split_s: float = 0.0
    #: Host seconds a full recompute's checkpoint of this layer adds beyond its forward run
    #: again (``DeviceSpec.checkpoint_call_overhead_s`` + its saved tensors x
    #: ``checkpoint_tensor_overhead_s``): charged to repeated blocks under full recompute.
    checkpoint_s: float = 0.0


def price_layer(template: Template, split: LayerSplit, cluster: Cluster, dtype: str, tp: int,
                b: int, s: int, graph_float_bytes: int, tp_span: Any, cp: int = 1,
                cp_span: Any = None, ep: int = 1, ep_span: Any = None,
                moe_imbalance: float = 1.0) -> LayerCosts:
    """One micro-batch of ``b`` sequences of ``s`` through a layer on one tensor-parallel rank
    (``split`` is the template under the plan's layout: :meth:`ModelCosts.split`).

    Under context parallelism (``cp`` > 1) the rank holds ``s / cp`` tokens of each sequence:
    every op is priced at that length but attention, whose queries see the whole sequence's
    keys (its FLOPs are the whole sequence's over ``cp``: the head-tail layout balances causal
    work), plus the exchange of keys and values over ``cp_span`` (:func:`cp_exchange`).

    Experts (mixture-of-experts): every routed row through its expert's two GEMMs, times
    ``moe_imbalance`` (the busiest expert rank's rows over the mean; 1 = uniform routing, which
    the load-balancing loss aims at); under expert parallelism (``ep`` > 1, over ``ep_span``) two
    all-to-alls per experts operation forward (dispatch, combine) and two backward, of each
    rank's routed rows, not overlapped (Megatron-LM's default)."""
    v = template.values(b, s // cp)
    full = template.values(b, s) if cp > 1 else v
    esize = PRECISION_BYTES[dtype]
    scale = esize / graph_float_bytes
    fwd = bwd = wgt = core = 0.0
    cp_comm: dict[str, list[float]] = {"ring": [0.0, 0.0], "allgather": [0.0, 0.0]}
    d = cluster.device
    for term, how, div in zip(template.terms, split.gemm, split.divisor):
        i = term.index
        if term.kind is TermKind.GEMM:
            batch, m, n, k = v[i], v[i + 1], v[i + 2], v[i + 3]
            if term.op == EXPERT_OP:  # this rank's E / ep experts, one GEMM each (a loop)
                experts = batch / ep
                rows = m * moe_imbalance / experts
                fwd += experts * gemm_time(cluster, dtype, 1, rows, n, k)
                if term.backward:
                    bwd += experts * gemm_time(cluster, dtype, 1, rows, k, n)
                    wgt += experts * gemm_time(cluster, dtype, 1, n, k, rows)
                continue
            if term.op == CONV_OP:  # (groups, M, N, K), its bytes, kernel elements, images
                moved, kernel, images = v[i + 4] * scale / div, v[i + 5], v[i + 6]
                if how is Split.COLUMN and batch > 1:  # grouped: each rank its groups
                    batch = batch / tp
                elif how is Split.COLUMN:
                    n = math.ceil(n / tp)
                elif how is Split.ROW:
                    k = k / tp
                f, f_input, f_weight = conv_times(cluster, dtype, batch, m, n, k, kernel, images,
                                                moved)
                fwd += f
                if term.backward:  # the input's gradient (B), the weight's (W)
                    if term.input_grads:
                        bwd += f_input
                    if term.weight_grad:
                        wgt += f_weight
                continue
            if how is Split.COLUMN:
                n = math.ceil(n / tp)
            elif how is Split.ROW:
                k = k / tp
            elif how is Split.BATCH:
                batch = batch / tp
            f = gemm_time(cluster, dtype, batch, m, n, k)
            bias = d.op_table.get(term.op) if term.op and dtype == d.default_dtype else None
            if bias is not None:  # measured: the bias broadcast into the output, its gradient
                f += batch * m * n * bias[0]
                if term.backward:
                    bwd += batch * m * n * bias[1]
            fwd += f
            if term.core:
                core += f
            if term.backward:
                if term.weight_grad:
                    bwd += gemm_time(cluster, dtype, batch, m, k, n)
                    wgt += gemm_time(cluster, dtype, 1, n, k, batch * m)
                else:
                    if term.input_grads >= 1:
                        bwd += gemm_time(cluster, dtype, batch, m, k, n)
                    if term.input_grads >= 2:
                        bwd += gemm_time(cluster, dtype, batch, k, n, m)
            continue
        flops, moved = v[i] / div, v[i + 1] * scale / div
        if term.kind is TermKind.ATTENTION and cp > 1:
            flops, moved = full[i] / div / cp, full[i + 1] * scale / div / cp
        if term.kind is TermKind.ATTENTION and d.attention_table and dtype == d.default_dtype:
            seq, head = v[i + 2], v[i + 3]
            rows_f = [(r[0], r[1], r[2]) for r in d.attention_table]
            rows_b = [(r[0], r[1], r[3]) for r in d.attention_table]
            f = max(flops / table_rate(rows_f, (seq, head)), d.kernel_floor_s)
            fb = max(ATTENTION_BACKWARD_FACTOR * flops / table_rate(rows_b, (seq, head)),
                     d.kernel_floor_s)
        elif term.kind is TermKind.ATTENTION:
            rate = d.peak(dtype) * d.attention_efficiency
            bw = d.memory_bandwidth * d.memory_efficiency
            f = max(flops / rate, moved / bw, d.kernel_floor_s)
            fb = max(ATTENTION_BACKWARD_FACTOR * flops / rate, 2 * moved / bw, d.kernel_floor_s)
        else:
            f = memory_time(cluster, moved)
            fb = memory_time(cluster, 2 * moved)
            per_element = d.op_table.get(term.op) if dtype == d.default_dtype else None
            if per_element is not None:  # measured: slower to compute than to stream
                elements = v[i + 2] / div
                f = max(f, elements * per_element[0])
                fb = max(fb, elements * per_element[1])
        fwd += f
        if term.core:
            core += f
        if term.backward:
            bwd += fb
        if term.kind is TermKind.ATTENTION and cp > 1:
            kv = v[i + 4] / div  # this rank's keys and values (elements)
            for kind, (tf, tb) in cp_exchange(cluster, cp, cp_span, kv, esize, f, fb).items():
                cp_comm[kind][0] += tf
                cp_comm[kind][1] += tb
    # the host's cost per node: the graph's nodes and runtime/moe.py's ops (per local expert
    # and routing)
    nodes, grad_nodes = float(template.nodes), float(template.grad_nodes)
    for experts in template.moe_experts:
        local = experts / ep
        nodes += MOE_OPS_PER_EXPERT * local + MOE_ROUTING_OPS[ep > 1]
        grad_nodes += MOE_OPS_PER_EXPERT * local + MOE_ROUTING_GRAD_OPS[ep > 1]
    # CPU processes: dispatch and autograd on the thread that then computes, serial
    fwd += nodes * d.node_overhead_s
    bwd += grad_nodes * d.node_backward_overhead_s
    # gradient accumulation: each micro-batch's weight gradients are added into the step's
    # gradient buffer (read it and the new gradient, write it back), with the weight gradients
    local = sum(n / tp if fqn in split.sharded_params else n for fqn, n in template.params.items())
    wgt += memory_time(cluster, GRAD_ACCUMULATION_READS_WRITES * STATE_BYTES[dtype][1] * local)
    # GPUs: the host launches ahead while earlier kernels run; a layer whose launches take longer
    # than its kernels (small micro-batches) waits for the host
    fwd = max(fwd, nodes * d.launch_overhead_s)
    bwd += max(0.0, grad_nodes * d.launch_backward_overhead_s - bwd - wgt)
    # the zero-bubble schedules' split backward: the runtime's graph walk and per-group autograd
    # calls, charged to the weight-gradient action when the schedule splits (stage_sums.py)
    split_s = grad_nodes * d.split_backward_overhead_s
    # full recompute's checkpoint (runtime/layer_recompute.py): a frame per block, hooks per
    # saved tensor
    checkpoint_s = d.checkpoint_call_overhead_s \
        + len(template.saved) * d.checkpoint_tensor_overhead_s
    # tensor-parallel communication: the program's collectives
    tp_f = tp_b = 0.0
    calls = []
    for (kind, forward, float_tensor), nbytes in zip(split.comm, split.comm_bytes(b, s)):
        nbytes = nbytes * scale if float_tensor else nbytes
        t = collective_time(cluster, kind, nbytes, tp_span).seconds
        if forward:
            tp_f += t
        else:
            tp_b += t
        calls.append((kind.value, "forward" if forward else "backward", nbytes))

    ep_f = ep_b = 0.0
    if ep > 1:
        for i in template.moe_rows:  # the rows this rank routes, sent as ep parts
            nbytes = v[i] * esize * ep  # comm.py prices an all-to-all by the whole exchange
            t = collective_time(cluster, Collective.ALL_TO_ALL, nbytes, ep_span).seconds
            ep_f += 2 * t
            ep_b += 2 * t
        tp_f += ep_f
        tp_b += ep_b
        calls.extend((Collective.ALL_TO_ALL.value, d, v[i] * esize * ep)
                     for i in template.moe_rows for d in ("forward",) * 2 + ("backward",) * 2)

    regather_s = 0.0
    for t, again in zip(template.saved, split.regather):
        if again:  # the whole tensor, gathered once per backward (shared by its readers)
            whole = v[t.index] * (esize if t.is_float else 1)
            regather_s += collective_time(cluster, Collective.ALL_GATHER, whole, tp_span).seconds

    def nbytes(tensors: list[TensorRef], shares: list[int], include_core: bool = True) -> float:
        total = 0.0
        for t, share in zip(tensors, shares):
            if t.core and not include_core:
                continue
            width = max(esize, 4) if t.wide else esize
            total += v[t.index] * (width if t.is_float else 1) / share
        return total

    return LayerCosts(
        forward_s=fwd, backward_s=bwd, weight_s=wgt, core_forward_s=core,
        tp_forward_s=tp_f, tp_backward_s=tp_b,
        act_bytes=nbytes(template.saved, split.saved),
        act_selective_bytes=nbytes(template.saved, split.saved, include_core=False),
        ckpt_bytes=nbytes(template.checkpoint, split.checkpoint),
        boundary_bytes=nbytes(template.boundary, split.boundary),
        inner_boundary_bytes=nbytes(template.inner_boundary, split.inner_boundary),
        transient_bytes=2 * nbytes(template.transient, split.transient),
        gemm_flops=v[template.gemm_flops], core_flops=v[template.core_flops],
        tp_calls=tuple(calls), ep_forward_s=ep_f, ep_backward_s=ep_b,
        cp_comm={k: (f, b_) for k, (f, b_) in cp_comm.items()} if cp > 1 else {},
        regather_s=regather_s, split_s=split_s, checkpoint_s=checkpoint_s)


def cp_exchange(cluster: Cluster, cp: int, span: Any, kv_elements: float, esize: int,
                forward_s: float, backward_s: float) -> dict[str, tuple[float, float]]:
    """Exposed seconds (forward, backward) of one attention's K/V exchange over ``cp`` ranks, by
    algorithm (autopar/runtime/cp.py), for a rank holding ``kv_elements`` keys and values
    (``esize`` bytes each) whose attention takes ``forward_s`` / ``backward_s`` in all.

    ``ring``: ``cp - 1`` hops of the block forward, each overlapped with one block's attention
    (``forward_s / cp``), only the excess exposed; backward the same hops plus ``cp`` hops of the
    block's dK/dV accumulator (fp32: twice the bytes at bf16), overlapped with the backward's
    blocks. ``allgather``: the whole sequence's K/V gathered before the attention (exposed) and,
    backward, gathered again and the dK/dV reduce-scattered (fp32)."""
    inter = span is not None and span.nodes > 1
    block_bytes, grad_bytes = kv_elements * esize, kv_elements * 4  # dK/dV accumulate in fp32
    hop = p2p_time(cluster, block_bytes, inter_node=inter)
    grad_hop = p2p_time(cluster, grad_bytes, inter_node=inter)
    fwd_block, bwd_block = forward_s / cp, backward_s / cp
    ring = ((cp - 1) * max(0.0, hop - fwd_block),
            (cp - 1) * max(0.0, hop - bwd_block) + cp * max(0.0, grad_hop - bwd_block)
            + grad_hop)  # the last hop home waits for the last block
    gather = collective_time(cluster, Collective.ALL_GATHER, block_bytes * cp, span).seconds
    scatter = collective_time(cluster, Collective.REDUCE_SCATTER, grad_bytes * cp, span).seconds
    return {"ring": ring, "allgather": (gather, gather + scatter)}
