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


def build_rms_gpt():
    """The own GPT with torch's nn.RMSNorm (``aten.rms_norm``) in place of every LayerNorm, the
    norm weights randomized so a wrong shard or a missing gradient sum shows.
    Returns (model, loss_fn, inputs, targets, captured)."""
    import torch.nn as nn

    from autopar import capture
    from conftest import build_own_gpt

    model, loss_fn = build_own_gpt()
    hidden = model.config.hidden
    for block in model.blocks:
        block.ln_1, block.ln_2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
    model.ln_f = nn.RMSNorm(hidden)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.RMSNorm):
                m.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=gen))
    tokens = torch.randint(0, 128, (2, 17), generator=gen)
    inputs, targets = (tokens[:, :-1],), (tokens[:, 1:],)
    return model, loss_fn, inputs, targets, capture(model, inputs, loss_fn,
                                                    example_targets=targets)


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


def check_collectives():
    """On every rank: each TPGroup collective forward and backward against the function it
    stands for, computed in full on this rank from inputs every rank can regenerate (seeded).
    Returns {name: max abs error}."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from autopar.runtime.mesh import ParallelMesh
    from autopar.runtime.tp import TPGroup
    from autopar.sharding import StridedShard, shard_tensor

    tp = TPGroup.from_mesh(ParallelMesh(1, 1, dist.get_world_size()))
    n, r = tp.size, tp.rank
    g = torch.Generator().manual_seed(0)
    full = torch.randn(4, 8, 12, generator=g)
    w = torch.randn(4, 8, 12, generator=g)
    per_rank = [torch.randn(4, 8, 12, generator=g) for _ in range(n)]  # distinct per rank
    errs: dict[str, float] = {}

    def err(name, got, want):
        value = (got - want).abs().max().item()  # NaN kept: max(0.0, nan) would drop it
        errs[name] = value if value != value else max(errs.get(name, 0.0), value)

    # all_gather (Shard(1) -> R), backward keeps the slice
    x = full.chunk(n, 1)[r].clone().requires_grad_()
    y = tp.all_gather(x, 1)
    err("all_gather", y, full)
    (y * w).sum().backward()
    err("all_gather.grad", x.grad, w.chunk(n, 1)[r])
    # laid out as the whole tensor of one process (contiguous): a view of it works, as the
    # graph's next op may take one (GPT-Neo views its head-gathered attention output)
    err("all_gather.view", y.detach().view(4, -1), full.view(4, -1))
    # all_gather whose consumer's gradient is partial: backward reduce-scatter
    x = full.chunk(n, 1)[r].clone().requires_grad_()
    (tp.all_gather(x, 1, grad="reduce_scatter") * per_rank[r]).sum().backward()
    err("all_gather[rs].grad", x.grad, sum(per_rank).chunk(n, 1)[r])
    # all_gather with blocks (fused QKV layout)
    p = StridedShard(2, split_factor=3)
    x = shard_tensor(full, p, n, r).requires_grad_()
    y = tp.all_gather(x, 2, blocks=3)
    err("all_gather[blocks]", y, full)
    (y * w).sum().backward()
    err("all_gather[blocks].grad", x.grad, shard_tensor(w, p, n, r))
    # reduce_scatter (P -> Shard(1)), backward all-gather
    x = per_rank[r].clone().requires_grad_()
    y = tp.reduce_scatter(x, 1)
    err("reduce_scatter", y, sum(per_rank).chunk(n, 1)[r])
    err("reduce_scatter.view", y.detach().view(4, -1), sum(per_rank).chunk(n, 1)[r].reshape(4, -1))
    (y * w.chunk(n, 1)[r]).sum().backward()
    err("reduce_scatter.grad", x.grad, w)
    # shard (R -> Shard), backward all-gather; and with blocks
    for blocks in (1, 3):
        x = full.clone().requires_grad_()
        place = StridedShard(2, split_factor=3) if blocks == 3 else None
        y = tp.shard(x, 2, blocks=blocks)
        want = shard_tensor(full, place, n, r) if place else full.chunk(n, 2)[r]
        err(f"shard[{blocks}]", y, want)
        wl = shard_tensor(w, place, n, r) if place else w.chunk(n, 2)[r]
        (y * wl).sum().backward()
        err(f"shard[{blocks}].grad", x.grad, w)
    # all_reduce (g) and copy_to_tp (f)
    x = per_rank[r].clone().requires_grad_()
    y = tp.all_reduce(x)
    err("all_reduce", y, sum(per_rank))
    (y * w).sum().backward()
    err("all_reduce.grad", x.grad, w)
    x = full.clone().requires_grad_()
    y = tp.copy_to_tp(x)
    err("copy_to_tp", y, full)
    (y * per_rank[r]).sum().backward()
    err("copy_to_tp.grad", x.grad, sum(per_rank))
    # all_to_all: Shard(1) -> Shard(2)
    x = full.chunk(n, 1)[r].clone().requires_grad_()
    y = tp.all_to_all(x, 1, 2)
    err("all_to_all", y, full.chunk(n, 2)[r])
    (y * w.chunk(n, 2)[r]).sum().backward()
    err("all_to_all.grad", x.grad, w.chunk(n, 1)[r])
    # vocab-parallel cross-entropy against F.cross_entropy on the full logits
    logits = torch.randn(10, 16, generator=g) * 3
    target = torch.randint(0, 16, (10,), generator=g)
    target[3] = -100
    upstream = torch.randn(10, generator=g)
    for reduction, name in ((0, "none"), (1, "mean"), (2, "sum")):
        ref_in = logits.clone().requires_grad_()
        ref = F.cross_entropy(ref_in, target, reduction=name, ignore_index=-100)
        local = logits.chunk(n, 1)[r].clone().requires_grad_()
        got = tp.vocab_parallel_cross_entropy(local, target, reduction, -100)
        err(f"cross_entropy[{name}]", got, ref)
        (ref * upstream).sum().backward() if name == "none" else ref.backward()
        (got * upstream).sum().backward() if name == "none" else got.backward()
        err(f"cross_entropy[{name}].grad", local.grad, ref_in.grad.chunk(n, 1)[r])
    # every target ignored (a micro-batch of padding): the mean is 0/0, its gradient zero
    ignored = torch.full_like(target, -100)
    ref_in = logits.clone().requires_grad_()
    F.cross_entropy(ref_in, ignored, ignore_index=-100).backward()
    local = logits.chunk(n, 1)[r].clone().requires_grad_()
    tp.vocab_parallel_cross_entropy(local, ignored, 1, -100).backward()
    err("cross_entropy[mean, all ignored].grad", local.grad, ref_in.grad.chunk(n, 1)[r])
    # vocab-parallel embedding: the sum over ranks is the lookup, padding row gets no gradient
    table = torch.randn(16, 6, generator=g)
    idx = torch.randint(0, 16, (3, 5), generator=g)
    idx[0, 0] = 5
    ref_w = table.clone().requires_grad_()
    ref = F.embedding(idx, ref_w, padding_idx=5)
    local = table.chunk(n, 0)[r].clone().requires_grad_()
    got = tp.all_reduce(tp.vocab_parallel_embedding(local, idx, padding_idx=5))
    err("vocab_embedding", got, ref)
    wgt = torch.randn(3, 5, 6, generator=g)
    (ref * wgt).sum().backward()
    (got * wgt).sum().backward()
    err("vocab_embedding.grad", local.grad, ref_w.grad.chunk(n, 0)[r])
    return errs


def build_cumsum_mlp():
    """Two blocks of column GEMM -> ReLU -> a running sum over the sequence (``aten.cumsum``,
    as prefix-sum token mixers compute) -> row GEMM. autopar has no rule for cumsum; DTensor's
    strategy (any dim but the summed one) lets it run on the column GEMM's hidden shards, so
    each block needs one all-reduce. The loss is F.mse_loss, whose tuple-valued
    broadcast_tensors has no rule: under sequence parallelism its elements keep Replicate.
    Returns (model, loss_fn, inputs, targets, captured)."""
    import torch.nn as nn

    from autopar import capture

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

        def forward(self, x):
            return x + self.down(torch.cumsum(torch.relu(self.up(x)), dim=1) / x.shape[1])

    class PrefixMixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    gen = torch.Generator().manual_seed(6)
    torch.manual_seed(6)
    model = PrefixMixer()
    inputs, targets = (torch.randn(2, 8, 16, generator=gen),), (torch.randn(2, 8, 16, generator=gen),)

    def loss_fn(y, t):  # broadcast_tensors (no rule, tuple-valued) then mse_loss: under SP
        return torch.nn.functional.mse_loss(y, t)  # its elements stay replicated

    return model, loss_fn, inputs, targets, capture(model, inputs, loss_fn,
                                                    example_targets=targets)


def check_saved_gathers():
    """On every rank: a sequence-parallel all-gather feeding column-parallel GEMMs (three, as
    LLaMA's q, k and v), forward and backward under ``saved_gathers`` against the same without
    it. Returns (max abs gradient difference, bytes autograd keeps for the gathered input with
    and without, all-gathers run in the backward)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import autopar.runtime.tp as tpmod
    from autopar.runtime.mesh import ParallelMesh
    from autopar.runtime.tp import TPGroup, saved_gathers

    tp = TPGroup.from_mesh(ParallelMesh(1, 1, dist.get_world_size()))
    n, r = tp.size, tp.rank
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 8 * n, 16, generator=g)
    weights = [torch.randn(12, 16, generator=g) for _ in range(3)]
    kept: list[int] = []
    pack = tpmod._pack_saved

    def counting(t):
        out = pack(t)
        if not isinstance(out, torch.Tensor):
            kept.append(out[0].shard.untyped_storage().nbytes())
        return out

    gathers = []
    gather = tpmod._gather
    results = {}
    for hooked in (False, True):
        x = full.chunk(n, 1)[r].clone().requires_grad_()
        ws = [w.clone().requires_grad_() for w in weights]
        tpmod._pack_saved = counting
        try:
            with saved_gathers() if hooked else torch.enable_grad():
                y = tp.all_gather(x, 1, grad="reduce_scatter")
                loss = sum(F.linear(y, w).pow(2).sum() for w in ws)
            tpmod._gather = lambda *a: gathers.append(1) or gather(*a)
            loss.backward()
        finally:
            tpmod._pack_saved, tpmod._gather = pack, gather
        results[hooked] = (x.grad, [w.grad for w in ws], len(gathers))
        gathers.clear()
    diff = max((a - b).abs().max().item() for a, b in
               zip([results[True][0], *results[True][1]], [results[False][0], *results[False][1]]))
    return diff, kept, results[True][2], full.chunk(n, 1)[r].numel() * full.element_size()


def count_saved_gathers(sequence_parallel: bool):
    """On every rank: one training step of a small GPT under tp = world, counting the tensors
    autograd keeps as sequence shards (runtime/tp.py saved_gathers) and the loss."""
    import torch.distributed as dist

    import autopar
    import autopar.runtime.tp as tpmod
    from autopar import models

    torch.manual_seed(0)
    zm = models.build("gpt", dropout=0.0, layers=2, hidden=64, heads=4, vocab=128, seq=32)
    tokens = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    kept = []
    pack = tpmod._pack_saved

    def counting(t):
        out = pack(t)
        if not isinstance(out, torch.Tensor):
            kept.append(1)
        return out

    tpmod._pack_saved = counting
    try:
        pm = autopar.parallelize(zm.model, example_inputs=(x,), example_targets=(y,),
                                 loss_fn=zm.loss_fn, optimizer=torch.optim.SGD,
                                 plan={"dp": 1, "tp": dist.get_world_size(), "pp": 1,
                                       "micro_batch_size": 4,
                                       "sequence_parallel": sequence_parallel})
        loss = pm.train_step(x, y)
        pm.close()
    finally:
        tpmod._pack_saved = pack
    return len(kept), loss
