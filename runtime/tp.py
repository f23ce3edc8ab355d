"""Autograd-aware tensor-parallel collectives, bound to one process group.

Generated per-rank programs call these as ``tp.<name>(x, ...)`` on a :class:`TPGroup`. Each
is a ``torch.autograd.Function`` whose backward is the collective's adjoint:

=================  ==========================  ==========================================
method             forward                      backward
=================  ==========================  ==========================================
``all_reduce``     sum over ranks (g)           identity
``copy_to_tp``     identity (f)                 sum over ranks
``all_gather``     concatenate along ``dim``    keep this rank's slice, or reduce-scatter
                                                when the consumer's gradient is partial
``reduce_scatter`` sum, keep this rank's chunk  all-gather
``shard``          keep this rank's chunk       all-gather
``all_to_all``     re-shard ``src -> dst``      re-shard ``dst -> src``
=================  ==========================  ==========================================

plus the two ops whose sharded form needs work of its own: the vocabulary-parallel embedding
(masked lookup, partial result) and cross-entropy (one all-gather of each rank's log-sum-exp and
target logit per token; the full-vocabulary logits never exist).

Process groups come from :class:`autopar.runtime.mesh.ParallelMesh` (the groups of one DeviceMesh,
NCCL on GPUs, gloo on CPU). Every collective is waited through
:func:`autopar.runtime.comm.wait_work` with the mesh's timeout, so a peer that never joins or
has died raises :class:`~autopar.errors.CommunicationTimeoutError` naming this rank, what it was
doing and the collective, instead of hanging. A group of size 1 makes every method the identity.

Dropout (``tp.dropout``, ``tp.attention_dropout``) draws its masks from
:class:`autopar.runtime.rng.DropoutRNG` (``TPGroup.rng``): a function of the seed, the step, the
dropout site and the global coordinates of each element, so every plan draws the single-device
run's masks (docs/reliability.md).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from autopar.errors import ShardingError
from autopar.runtime.comm import collective
from autopar.runtime.rng import DropoutRNG
from autopar.runtime.running_stats import batch_norm, update_buffer

__all__ = ["TPGroup", "FUNCTIONS", "saved_gathers"]


def _what(name: str, x: torch.Tensor) -> str:
    dtype = str(x.dtype).removeprefix("torch.")
    return f"tensor-parallel {name} of {dtype}{list(x.shape)}"


def _ag_tensor(out: torch.Tensor, x: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    collective(fn, out, x, group=group, what=_what("all-gather", x))


def _rs_tensor(out: torch.Tensor, x: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    collective(fn, out, x, group=group, what=_what("reduce-scatter", x))


def _all_reduce(x: torch.Tensor, group, name: str = "all-reduce") -> None:
    collective(dist.all_reduce, x, group=group, what=_what(name, x))


def _check(size: int, n: int, what: str, dim: int) -> None:
    if size % n:
        raise ShardingError(f"{what}: dim {dim} has size {size}, which {n} ranks cannot split "
                            f"evenly", expected=f"a multiple of the tensor-parallel size {n}",
                            found=str(size),
                            fix="choose a batch/sequence length (or model dims) divisible by tp")


def _gather(x: torch.Tensor, dim: int, blocks: int, group, n: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; with blocks, re-interleave them. The result
    is contiguous, as the whole tensor of one process would be (GPT-Neo's attention output,
    gathered along its heads, is viewed to the hidden size next: a strided gather cannot be)."""
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * front.shape[0],) + tuple(front.shape[1:]), dtype=x.dtype,
                      device=x.device)
    _ag_tensor(out, front, group)
    if blocks > 1:  # [rank, block, piece] -> [block, rank, piece]
        piece = front.shape[0] // blocks
        out = out.view(n, blocks, piece, *front.shape[1:]).transpose(0, 1).reshape(out.shape)
    return out.movedim(0, dim).contiguous()


def _slice(x: torch.Tensor, dim: int, blocks: int, rank: int, n: int) -> torch.Tensor:
    size = x.shape[dim]
    _check(size, n * blocks, "shard", dim)
    if blocks == 1:
        return x.narrow(dim, rank * (size // n), size // n).contiguous()
    parts = [b.narrow(dim, rank * (b.shape[dim] // n), b.shape[dim] // n)
             for b in x.chunk(blocks, dim=dim)]
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group, n: int) -> torch.Tensor:
    _check(x.shape[dim], n, "reduce_scatter", dim)
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((front.shape[0] // n,) + tuple(front.shape[1:]), dtype=x.dtype,
                      device=x.device)
    _rs_tensor(out, front, group)
    return out.movedim(0, dim).contiguous()  # as one process's tensor is (see _gather)


def _all_to_all(x: torch.Tensor, src: int, dst: int, group, n: int) -> torch.Tensor:
    """x is sharded on ``src`` (full on ``dst``); return it sharded on ``dst`` (full on src)."""
    _check(x.shape[dst], n, "all_to_all", dst)
    send = torch.stack(x.chunk(n, dim=dst)).contiguous()  # [n, ...]: chunk j goes to rank j
    recv = torch.empty_like(send)
    collective(dist.all_to_all_single, recv, send, group=group, what=_what("all-to-all", x))
    return torch.cat(recv.unbind(0), dim=src)


class _Regather:
    """A sequence-parallel all-gather's output as autograd keeps it: this rank's shard, gathered
    again when the backward needs the whole (:func:`saved_gathers`)."""

    __slots__ = ("shard", "dim", "blocks", "group", "n", "packs", "unpacks", "held")

    def __init__(self, shard: torch.Tensor, dim: int, blocks: int, group: Any, n: int) -> None:
        self.shard, self.dim, self.blocks, self.group, self.n = shard, dim, blocks, group, n
        self.packs = self.unpacks = 0
        self.held: torch.Tensor | None = None

    def full(self) -> torch.Tensor:
        """The gathered tensor's storage (its base), gathered once for all the ops that saved
        it (the q, k and v projections of one input) and let go after the last of them."""
        if self.held is None:
            out = _gather(self.shard, self.dim, self.blocks, self.group, self.n).contiguous()
            self.held = out if out._base is None else out._base
        base = self.held
        self.unpacks += 1
        if self.unpacks >= self.packs:
            self.held = None
        return base


def _pack_saved(t: torch.Tensor) -> Any:
    base = t if t._base is None else t._base
    meta = getattr(base, "_autopar_regather", None)
    if meta is None:
        # Saved as autograd saves without hooks: a parameter (a leaf) as itself, so ZeRO-3
        # swapping its data in before the backward is seen; any other tensor without its
        # grad_fn. A node saving its own output (gelu, softmax) would otherwise hold itself alive
        # through C++ references Python's gc cannot see, and a graph kept by retain_graph (the
        # zero-bubble schedules' split backward) would never be freed: every step leaked it.
        return t if t.grad_fn is None else t.detach()
    meta.packs += 1
    return meta, t.size(), t.stride(), t.storage_offset()


def _unpack_saved(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    meta, size, stride, offset = packed
    return meta.full().as_strided(size, stride, offset)


def saved_gathers() -> Any:
    """Autograd keeps this rank's shard of a sequence-parallel all-gather's output, not the
    gathered tensor, and gathers it again in the backward (Korthikanti et al. 2022, section
    4.2.2; Megatron-LM's sequence-parallel linear layers): the column-parallel GEMM after the
    gather saves its input for the weight gradient, ``tp`` times the shard, and only the shard
    is kept. One more all-gather per such input in the backward. Active around the forward of
    each stage that holds such a gather (runtime/pipeline.py, ``StageModule.regathers``); an
    all-gather without ``grad='reduce_scatter'`` and every other tensor are saved as autograd
    saves them."""
    return torch.autograd.graph.saved_tensors_hooks(_pack_saved, _unpack_saved)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        _all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        _all_reduce(grad, ctx.group, "all-reduce (backward of f)")
        return grad, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, blocks, reduce_grad, group, rank, n):
        ctx.args = (dim, blocks, reduce_grad, group, rank, n)
        return _gather(x, dim, blocks, group, n)

    @staticmethod
    def backward(ctx, grad):
        dim, blocks, reduce_grad, group, rank, n = ctx.args
        if reduce_grad:
            if blocks > 1:  # sum over ranks, then keep this rank's pieces of every block
                grad = grad.contiguous().clone()
                _all_reduce(grad, group, "all-reduce (backward of all-gather)")
                out = _slice(grad, dim, blocks, rank, n)
            else:
                out = _reduce_scatter(grad, dim, group, n)
        else:
            out = _slice(grad, dim, blocks, rank, n)
        return out, None, None, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, n):
        ctx.args = (dim, group, n)
        return _reduce_scatter(x, dim, group, n)

    @staticmethod
    def backward(ctx, grad):
        dim, group, n = ctx.args
        return _gather(grad, dim, 1, group, n), None, None, None


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, blocks, group, rank, n):
        ctx.args = (dim, blocks, group, n)
        return _slice(x, dim, blocks, rank, n)

    @staticmethod
    def backward(ctx, grad):
        dim, blocks, group, n = ctx.args
        return _gather(grad, dim, blocks, group, n), None, None, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, dst, group, n):
        ctx.args = (src, dst, group, n)
        return _all_to_all(x, src, dst, group, n)

    @staticmethod
    def backward(ctx, grad):
        src, dst, group, n = ctx.args
        return _all_to_all(grad, dst, src, group, n), None, None, None, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits sharded along the class dim.

    Each rank reduces its own classes to a log-sum-exp and the target's logit (zero when the
    target is another rank's class); one all-gather of those two numbers per token gives the
    global log-sum-exp (a stable log-sum-exp over ranks) and target logit. Megatron-LM does the
    same with three all-reduces (max, sum of exponentials, target logit).
    """

    @staticmethod
    def forward(ctx, logits, target, start, reduction, ignore_index, group, n):
        local = logits.float()
        v_local = local.shape[1]
        valid = target != ignore_index
        in_range = (target >= start) & (target < start + v_local) & valid
        local_target = torch.where(in_range, target - start, torch.zeros_like(target))
        # where, not a product: a padded class's logit is -inf (passes/pad_vocab.py)
        picked = torch.where(in_range, local.gather(1, local_target.unsqueeze(1)).squeeze(1),
                             torch.zeros((), dtype=local.dtype, device=local.device))
        both = torch.stack([torch.logsumexp(local, dim=1), picked])  # [2, tokens]
        if group is not None:
            gathered = torch.empty((n * 2, both.shape[1]), dtype=both.dtype, device=both.device)
            _ag_tensor(gathered, both.contiguous(), group)
            gathered = gathered.view(n, 2, both.shape[1])
            lse = torch.logsumexp(gathered[:, 0], dim=0)
            picked = gathered[:, 1].sum(0)
        else:
            lse, picked = both[0], both[1]
        loss = torch.where(valid, lse - picked, torch.zeros_like(lse))
        count = valid.sum()
        softmax = (local - lse.unsqueeze(1)).exp()
        ctx.save_for_backward(softmax, local_target, in_range, valid, count)
        ctx.reduction = reduction
        ctx.dtype = logits.dtype
        if reduction == 0:  # none
            return loss.to(logits.dtype)
        if reduction == 1:  # mean over non-ignored targets (nan when there are none, as torch)
            return (loss.sum() / count).to(logits.dtype)
        return loss.sum().to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, in_range, valid, count = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_target] -= in_range.to(g.dtype)
        if ctx.reduction == 0:
            scale = grad.float() * valid
        elif ctx.reduction == 1:  # none counted: no gradient (torch's; 0/0 would be NaN)
            scale = grad.float() * valid / count.clamp(min=1)
        else:
            scale = grad.float() * valid
        g = g * scale.unsqueeze(1)
        return g.to(ctx.dtype), None, None, None, None, None, None


class TPGroup:
    """The tensor-parallel process group of this rank, and the collectives over it."""

    def __init__(self, group: Any = None, rng: DropoutRNG | None = None) -> None:
        self.group = group
        if group is None:
            self.rank, self.size = 0, 1
        else:
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
        #: Where the program's dropout masks come from (seed, step, rows of the micro-batch).
        self.rng = rng if rng is not None else DropoutRNG()
        #: The context-parallel group (runtime/cp.py) whose tokens this rank's tensors hold, if
        #: any: a dropout mask is drawn for the whole sequence and this rank's tokens kept.
        self.cp: Any = None

    @classmethod
    def from_mesh(cls, mesh: Any) -> "TPGroup":
        """The tp axis of an :class:`autopar.runtime.mesh.ParallelMesh`."""
        return cls(mesh.tp_group)

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size})"

    # -- placement changes ----------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Partial -> Replicate (Megatron's g): sum over ranks; backward identity."""
        return x if self.size == 1 else _AllReduce.apply(x, self.group)

    def copy_to_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Replicate -> Replicate whose gradient is partial (Megatron's f): identity; backward
        sums the gradient over ranks."""
        return x if self.size == 1 else _CopyToTP.apply(x, self.group)

    def all_gather(self, x: torch.Tensor, dim: int, blocks: int = 1,
                   grad: str = "slice") -> torch.Tensor:
        """Shard(dim) -> Replicate. ``grad='reduce_scatter'`` when the consumer's gradient is
        partial (sequence parallel before a column-parallel GEMM)."""
        if grad not in ("slice", "reduce_scatter"):
            raise ValueError(f"grad must be 'slice' or 'reduce_scatter', got {grad!r}")
        if self.size == 1:
            return x
        out = _AllGather.apply(x, dim, blocks, grad == "reduce_scatter", self.group, self.rank,
                               self.size)
        if grad == "reduce_scatter":  # sequence parallel before a column GEMM: kept as the shard
            # contiguous, so that the GEMM's flattening is a view of it (what autograd saves),
            # not a copy (the copy a gather along dim > 0 needed anyway, made here)
            out = out.contiguous()
            base = out if out._base is None else out._base
            base._autopar_regather = _Regather(x.detach(), dim, blocks, self.group, self.size)
        return out

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Partial -> Shard(dim); backward all-gather."""
        return x if self.size == 1 else _ReduceScatter.apply(x, dim, self.group, self.size)

    def shard(self, x: torch.Tensor, dim: int, blocks: int = 1) -> torch.Tensor:
        """Replicate -> Shard(dim): keep this rank's chunk; backward all-gather."""
        return x if self.size == 1 else _Shard.apply(x, dim, blocks, self.group, self.rank,
                                                      self.size)

    def all_to_all(self, x: torch.Tensor, src_dim: int, dst_dim: int) -> torch.Tensor:
        """Shard(src_dim) -> Shard(dst_dim)."""
        return x if self.size == 1 else _AllToAll.apply(x, src_dim, dst_dim, self.group,
                                                        self.size)

    # -- ops with a sharded form of their own -----------------------------------------------
    def vocab_parallel_embedding(self, weight: torch.Tensor, indices: torch.Tensor,
                                 padding_idx: int = -1) -> torch.Tensor:
        """Lookup in this rank's rows of a vocabulary-sharded table; a Partial result (rows
        owned by other ranks contribute zero here)."""
        rows = weight.shape[0]
        _check_indices(indices, rows * self.size, "an embedding")
        start = self.rank * rows
        outside = (indices < start) | (indices >= start + rows)
        local = torch.where(outside, torch.zeros_like(indices), indices - start)
        pad = padding_idx - start if padding_idx >= 0 and start <= padding_idx < start + rows else -1
        out = torch.ops.aten.embedding.default(weight, local, pad)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    def vocab_parallel_cross_entropy(self, logits: torch.Tensor, target: torch.Tensor,
                                     reduction: int = 1, ignore_index: int = -100) -> torch.Tensor:
        """``aten.cross_entropy_loss`` on logits sharded along the class dim (dim 1), without
        gathering them; the result is replicated. reduction: 0 none, 1 mean, 2 sum."""
        if logits.dim() != 2:
            raise ShardingError("vocab-parallel cross-entropy takes [tokens, classes] logits",
                                found=f"logits of shape {tuple(logits.shape)}")
        _check_indices(target, logits.shape[1] * self.size, "a loss's classes", ignore_index)
        start = self.rank * logits.shape[1]
        return _VocabParallelCrossEntropy.apply(logits, target, start, int(reduction),
                                                int(ignore_index),
                                                self.group if self.size > 1 else None, self.size)


    # -- dropout with plan-independent masks (runtime/rng.py) ---------------------------------
    def _local_keep(self, site: str, shape: Sequence[int], p: float, batch_dim: int | None,
                    shard_dim: int | None, blocks: int, device: torch.device,
                    seq_dim: int | None = None) -> torch.Tensor:
        full = list(shape)
        if shard_dim is not None and self.size > 1:
            full[shard_dim] *= self.size
        cp = self.cp if seq_dim is not None and self.cp is not None and self.cp.size > 1 else None
        if cp is not None:  # the whole sequence's mask, then this rank's tokens of it
            local = full[seq_dim]
            full[seq_dim] *= cp.size
        keep = self.rng.keep_mask(site, full, batch_dim, p, device)
        if cp is not None:
            keep = keep.index_select(seq_dim, cp.positions(torch.arange(local, device=device)))
        if shard_dim is not None and self.size > 1:
            keep = _slice(keep, shard_dim, blocks, self.rank, self.size)
        return keep

    def dropout(self, x: torch.Tensor, p: float, train: bool = True, *, site: str,
                batch_dim: int | None = 0, shard_dim: int | None = None,
                blocks: int = 1, seq_dim: int | None = None) -> torch.Tensor:
        """``aten.dropout`` whose mask is a function of (seed, step, site, global element):
        ``x`` is this rank's piece (``Shard(shard_dim)`` over tp, or the whole tensor; under
        context parallelism, this rank's tokens along ``seq_dim``)."""
        if not train or p == 0.0 or not self.rng.training:
            return x
        if p >= 1.0:
            return x * 0.0
        keep = self._local_keep(site, x.shape, p, batch_dim, shard_dim, blocks, x.device, seq_dim)
        return x * (keep.to(x.dtype) * (1.0 / (1.0 - p)))

    def feature_dropout(self, x: torch.Tensor, p: float, train: bool = True, *, site: str,
                        batch_dim: int | None = 0, shard_dim: int | None = None,
                        blocks: int = 1) -> torch.Tensor:
        """``aten.feature_dropout`` (``nn.Dropout1d/2d/3d``: whole channels of ``x`` of shape
        (N, C, ...) zeroed) with the mask drawn as :meth:`dropout` draws it, over (N, C)."""
        if not train or p == 0.0 or not self.rng.training:
            return x
        if p >= 1.0:
            return x * 0.0
        shape = list(x.shape[:2]) + [1] * (x.dim() - 2)
        keep = self._local_keep(site, shape, p, batch_dim if batch_dim in (0, 1) else None,
                                shard_dim if shard_dim in (0, 1) else None, blocks, x.device)
        return x * (keep.to(x.dtype) * (1.0 / (1.0 - p)))

    def draw_random(self, *args: Any, op: str, site: str, batch_dim: int | None = None,
                    **kwargs: Any) -> torch.Tensor:
        """A random op of the captured graph (``rand``, ``randn``, their ``_like`` forms,
        ``bernoulli``, ``bernoulli_``, ``uniform_``, ``normal_``: stochastic depth's draws)
        drawn per sample as dropout's masks are: sample ``g``'s slice along ``batch_dim`` from a
        generator seeded by (seed, step, site, g); one draw for a tensor without a batch dim.
        Every plan draws the same numbers, every tp rank alike (the tensor is replicated)."""
        name = op.split("::")[1].split(".")[0]
        if name in ("rand", "randn"):
            size = [int(d) for d in args[0]]
            out = torch.empty(size, dtype=kwargs.get("dtype") or torch.get_default_dtype(),
                              device=kwargs.get("device"))
            fill = "uniform_" if name == "rand" else "normal_"
            rest: tuple = ()
        elif name in ("rand_like", "randn_like"):
            out = torch.empty_like(args[0], dtype=kwargs.get("dtype"))
            fill = "uniform_" if name == "rand_like" else "normal_"
            rest = ()
        elif name == "bernoulli":  # out-of-place: args[0] holds the probabilities (or p given)
            probs = args[0] if len(args) < 2 else torch.full_like(args[0], float(args[1]))
            out = torch.empty_like(args[0])
            self.rng.draw_per_sample(
                out, site, batch_dim,
                lambda t, g, a, b: torch.bernoulli(_along(probs, batch_dim, a, b), generator=g,
                                                   out=t))
            return out
        else:  # an in-place fill of args[0]
            out, fill, rest = args[0], name, tuple(args[1:])
        self.rng.draw_per_sample(out, site, batch_dim,
                                 lambda t, g, a, b: getattr(t, fill)(*rest, generator=g))
        return out

    def attention_dropout(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                          is_causal: bool = False, *, scale: float | None = None,
                          enable_gqa: bool = False, site: str, shard_dim: int | None = None,
                          batch_dim: int | None = 0) -> torch.Tensor:
        """``scaled_dot_product_attention`` with dropout on the attention probabilities drawn as
        :meth:`dropout` draws (the fused kernels draw from the process's RNG stream), computed
        the math way; without dropout (evaluation) the fused kernel runs. ``shard_dim``: the
        sharded dim of the output (1: heads)."""
        if dropout_p == 0.0 or not self.rng.training:
            return torch.ops.aten.scaled_dot_product_attention.default(
                q, k, v, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
        if shard_dim is not None and shard_dim >= q.dim() - 1:
            raise ShardingError("attention dropout with the head dim sharded",
                                found=f"output sharded on dim {shard_dim}",
                                fix="shard attention by heads, or drop attention dropout")
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        factor = scale if scale is not None else q.shape[-1] ** -0.5
        scores = torch.matmul(q, k.transpose(-2, -1)) * factor
        if is_causal:
            causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool,
                                device=q.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attn_mask, float("-inf"))
            else:
                scores = scores + attn_mask
        probs = torch.softmax(scores, dim=-1)
        keep = self._local_keep(site, probs.shape, dropout_p, batch_dim, shard_dim, 1, q.device)
        probs = probs * (keep.to(probs.dtype) * (1.0 / (1.0 - dropout_p)))
        return torch.matmul(probs, v)


# -- functional forms: the call_function targets of per-rank fx graphs (tp.<method>(x) in the
#    generated source). Plain module-level functions, so fx can print, pickle and re-import them.

def all_reduce(tp: TPGroup, x: torch.Tensor) -> torch.Tensor:
    return tp.all_reduce(x)


def copy_to_tp(tp: TPGroup, x: torch.Tensor) -> torch.Tensor:
    return tp.copy_to_tp(x)


def all_gather(tp: TPGroup, x: torch.Tensor, dim: int, blocks: int = 1,
               grad: str = "slice") -> torch.Tensor:
    return tp.all_gather(x, dim, blocks, grad)


def reduce_scatter(tp: TPGroup, x: torch.Tensor, dim: int) -> torch.Tensor:
    return tp.reduce_scatter(x, dim)


def shard(tp: TPGroup, x: torch.Tensor, dim: int, blocks: int = 1) -> torch.Tensor:
    return tp.shard(x, dim, blocks)


def all_to_all(tp: TPGroup, x: torch.Tensor, src_dim: int, dst_dim: int) -> torch.Tensor:
    return tp.all_to_all(x, src_dim, dst_dim)


def _check_indices(indices: torch.Tensor, bound: int, table: str,
                   ignore: int | None = None) -> None:
    """Refuse an index outside ``[0, bound)`` (``ignore`` aside) as one process's lookup does
    (``index out of range in self``): the sharded lookups mask every row they do not hold, so
    an id beyond the whole table would silently read zeros. ``_assert_async`` raises at once on
    a CPU and checks on the device on a GPU, without the host waiting for it (and it traces
    under ``torch.compile`` without a graph break)."""
    valid = (indices >= 0) & (indices < bound)
    if ignore is not None:
        valid = valid | (indices == ignore)
    torch._assert_async(valid.all(), f"index out of range in self: an index outside {table} "
                                     f"of {bound} rows")


def vocab_parallel_embedding(tp: TPGroup, weight: torch.Tensor, indices: torch.Tensor,
                             padding_idx: int = -1) -> torch.Tensor:
    return tp.vocab_parallel_embedding(weight, indices, padding_idx)


def vocab_parallel_cross_entropy(tp: TPGroup, logits: torch.Tensor, target: torch.Tensor,
                                 reduction: int = 1, ignore_index: int = -100) -> torch.Tensor:
    return tp.vocab_parallel_cross_entropy(logits, target, reduction, ignore_index)


def dropout(tp: TPGroup, x: torch.Tensor, p: float, train: bool = True, *, site: str,
            batch_dim: int | None = 0, shard_dim: int | None = None,
            blocks: int = 1, seq_dim: int | None = None) -> torch.Tensor:
    return tp.dropout(x, p, train, site=site, batch_dim=batch_dim, shard_dim=shard_dim,
                      blocks=blocks, seq_dim=seq_dim)


def feature_dropout(tp: TPGroup, x: torch.Tensor, p: float, train: bool = True, *, site: str,
                    batch_dim: int | None = 0, shard_dim: int | None = None,
                    blocks: int = 1) -> torch.Tensor:
    return tp.feature_dropout(x, p, train, site=site, batch_dim=batch_dim, shard_dim=shard_dim,
                              blocks=blocks)


def draw_random(tp: TPGroup, *args: Any, op: str, site: str, batch_dim: int | None = None,
                **kwargs: Any) -> torch.Tensor:
    return tp.draw_random(*args, op=op, site=site, batch_dim=batch_dim, **kwargs)


def _along(t: torch.Tensor, dim: int | None, start: int, length: int | None) -> torch.Tensor:
    return t if dim is None or length is None else t.narrow(dim, start, length)


def attention_dropout(tp: TPGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                      is_causal: bool = False, *, scale: float | None = None,
                      enable_gqa: bool = False, site: str, shard_dim: int | None = None,
                      batch_dim: int | None = 0) -> torch.Tensor:
    return tp.attention_dropout(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                enable_gqa=enable_gqa, site=site, shard_dim=shard_dim,
                                batch_dim=batch_dim)


#: The functional forms by name.
FUNCTIONS = {f.__name__: f for f in (all_reduce, copy_to_tp, all_gather, reduce_scatter, shard,
                                     all_to_all, vocab_parallel_embedding,
                                     vocab_parallel_cross_entropy, dropout, attention_dropout,
                                     feature_dropout, draw_random, batch_norm, update_buffer)}
