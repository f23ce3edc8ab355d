"""Shared by the tensor-parallel tests: a cost spec for tiny models, the per-rank job, checks."""

from __future__ import annotations

import re

import sympy
import torch

from autopar.ir import info, op_name
from autopar.passes.shard import TPCostSpec

#: The tiny test models have hidden 64 where real ones have 768..12288. Whether Megatron's split
#: pays off depends on compute per byte communicated (~ hidden x link bandwidth / FLOP/s) and on
#: vocab vs hidden; a device ~1e5x slower than an A100 on a link ~3e3x slower puts a hidden-64
#: model where GPT-2..GPT-3 sit on a real node, so the search faces the same trade-offs. The real
#: numbers (TPCostSpec()) are used on full-size shapes in test_tp_search.py.
TINY_COST = TPCostSpec(peak_flops=1e9, hbm_bandwidth=1e10, link_bandwidth=1e8,
                       link_latency=1e-5)


def run_rank_programs(configs):
    """On every rank of a LocalPool: exec this rank's generated source, load its shards, run
    forward and backward, and return {key: (loss, {attribute: grad}, graph_loss)}.

    ``graph_loss`` is the same step run through the per-rank fx GraphModule instead of the
    source, when the config carries one."""
    import torch.distributed as dist

    from autopar.runtime.mesh import ParallelMesh
    from autopar.runtime.tp import TPGroup

    tp = TPGroup.from_mesh(ParallelMesh(1, 1, dist.get_world_size()))
    out = {}
    for key, sources, states, inputs, targets, graph in configs:
        rank = tp.rank
        namespace: dict = {}
        exec(compile(sources[rank], f"<tp rank {rank} {key}>", "exec"), namespace)
        module = namespace[f"TensorParallelRank{rank}"](tp)
        module.load_state_dict(states[rank])
        loss = module(*inputs, *targets)
        loss.backward()
        grads = {k: p.grad.detach().clone() for k, p in module.named_parameters()
                 if p.grad is not None}
        graph_loss = None
        if graph is not None:
            with torch.no_grad():
                tensors = [states[rank][a] for a in graph[1]]
                result = graph[0](tp, *tensors, *inputs, *targets)
                graph_loss = (result[0] if isinstance(result, (tuple, list)) else result).item()
        out[key] = (loss.item(), grads, graph_loss)
    return out


def block_layers(program):
    return [layer.name for layer in program.captured.layers if layer.is_block]


def block_gemms(program, layer: str) -> list[str]:
    """The sharding of each GEMM of ``layer``, in graph order."""
    out = []
    for n in program.sharded.graph.nodes:
        meta = info(n)
        if n.op == "call_function" and meta.layer == layer and meta.strategy is not None \
                and meta.strategy.gemm is not None:
            out.append(meta.strategy.gemm.value)
    return out


def attention_strategies(program, layer: str) -> list[str]:
    return [info(n).strategy.name for n in program.sharded.graph.nodes
            if n.op == "call_function" and info(n).layer == layer
            and op_name(n) == "scaled_dot_product_attention"]


def is_megatron_block(program, layer: str) -> bool:
    """Column-parallel GEMM(s), then a row-parallel one, twice (attention, then MLP), attention
    split by heads."""
    seq = " ".join(block_gemms(program, layer))
    return bool(re.fullmatch(r"(column )+row (column )+row", seq)) and \
        attention_strategies(program, layer) == ["heads"]


def activation_bytes(program) -> sympy.Expr:
    """b * s * hidden * bytes: the size of one block input."""
    for n in program.captured.gm.graph.nodes:
        if n.op == "call_function" and info(n).layer == block_layers(program)[0]:
            spec = info(n.all_input_nodes[0]).spec
            return spec.nbytes
    raise AssertionError("no block")
