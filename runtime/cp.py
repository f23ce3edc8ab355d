"""Context parallelism: the sequence split over ranks, attention computed exactly across them.

Under context parallelism (cp) every activation of the model holds only this rank's tokens; the
only op that needs the others' is attention, whose keys and values are exchanged. Generated
per-rank programs call the functions at the bottom of this module as ``cp.<name>(cp, ...)`` on a
:class:`CPGroup`.

**Layout.** The sequence of length ``s`` is cut into ``2 x cp`` chunks of ``c = s / (2 cp)``
tokens; rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``, in that order, as Megatron-LM's
context parallelism and torch's ``context_parallel`` (its ``_HeadTailLoadBalancer``) lay out a
causal sequence: a rank with an early chunk (few keys to attend) also holds a late one (many), so
every rank does the same attention work. :meth:`CPGroup.split` takes a rank's tokens out of a
whole-sequence tensor, :meth:`CPGroup.positions` turns a local ``arange`` into the tokens' true
positions (rotary and learned position embeddings see each token where it is).

**Attention.** ``attention(q, k, v, is_causal, ...)`` with q, k, v of this rank's tokens
(``[batch, heads, tokens, head_dim]``) returns exactly what ``scaled_dot_product_attention``
over the whole sequence returns for them. Two algorithms, chosen by the plan:

- ``ring``: K/V blocks travel around the cp ranks (rank r sends to r + 1, receives from r - 1);
  the transfer of the next block is posted before the current block's attention and waited
  after it, so it overlaps (Liu et al. 2023, "Ring Attention with Blockwise Transformers"). The
  partial results merge with the online softmax (Milakov & Gimelshein 2018): a running row
  maximum, normalizer and unnormalized output. The backward pass replays the ring: each block's
  dK/dV accumulator travels with it and arrives home after ``cp`` hops; the queries' gradient
  uses the forward's log-sum-exp (Dao et al. 2022, FlashAttention's backward).
- ``allgather``: K/V of every rank gathered, one masked attention, dK/dV reduce-scattered back
  (Megatron-LM's ``all_gather`` CP communication type; cheaper for short sequences or GQA with
  few KV heads, where the gathered K/V are small).

Both skip what a causal mask hides: in the head-tail layout an off-diagonal block is half
visible (whole early-chunk keys, or whole late-chunk queries), and only that half is computed.
Every transfer waits with the mesh's
timeout (:func:`autopar.runtime.comm.wait_work`): a dead peer is a named error, not a hang.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import ShardingError
from autopar.runtime.comm import collective, wait_work

__all__ = ["CPGroup", "ATTENTION_KINDS", "head_tail_positions", "FUNCTIONS"]

#: The attention algorithms a plan may choose.
ATTENTION_KINDS = ("ring", "allgather")


def head_tail_positions(rank: int, size: int, local: int, device: Any = None) -> torch.Tensor:
    """The global positions of rank ``rank``'s ``local`` tokens in the head-tail layout."""
    if local % 2:
        raise ShardingError("context parallelism splits each rank's tokens into two chunks",
                            expected="an even number of tokens per rank (sequence length a "
                                     f"multiple of 2 x cp = {2 * size})",
                            found=f"{local} tokens on a rank", fix="pad the sequence or change cp")
    c = local // 2
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c, device=device)
    return torch.cat([first, second])


def _what(name: str, x: torch.Tensor) -> str:
    return f"context-parallel {name} of {str(x.dtype).removeprefix('torch.')}{list(x.shape)}"


# ---------------------------------------------------------------------------------------------
# One block of attention: queries against one block of keys, in fp32
# ---------------------------------------------------------------------------------------------

def _visible(rank: int, src: int, size: int, local: int, causal: bool):
    """(rows, cols, mask) of the part of rank ``rank``'s queries against rank ``src``'s keys
    that a causal mask leaves visible, in the head-tail layout (closed form, nothing scanned):
    the diagonal block is causal over local order (which is position order); against an
    earlier rank every query sees its first chunk's keys; against a later rank only the second
    chunk's queries see its keys, all of them. ``rows`` / ``cols``: slices (None: all);
    ``mask``: "causal" or None (all visible)."""
    if not causal:
        return None, None, None
    if src == rank:
        return None, None, "causal"
    c = local // 2
    if src < rank:
        return None, slice(0, c), None
    return slice(c, local), None, None


def _take(x: torch.Tensor, index: slice | None) -> torch.Tensor:
    return x if index is None else x[..., index, :]


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """K/V heads repeated to the query heads (grouped-query attention)."""
    return x if x.shape[-3] == heads else x.repeat_interleave(heads // x.shape[-3], dim=-3)


def _fold_heads(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of :func:`_expand_heads`: sum over each KV head's query group."""
    if g.shape[-3] == kv_heads:
        return g
    shape = g.shape
    return g.reshape(*shape[:-3], kv_heads, shape[-3] // kv_heads, *shape[-2:]).sum(-3)


def _kind_of(block) -> str:
    """"full" (every key visible) or "causal" (the diagonal block)."""
    return "causal" if block[2] == "causal" else "full"


def _causal_mask(rows: int, cols: int, device: Any) -> torch.Tensor:
    return torch.ones(rows, cols, dtype=torch.bool, device=device).tril()


def _fused(q: torch.Tensor) -> bool:
    """Blocks run through torch's fused CPU attention kernel (flash, with its log-sum-exp)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)


class _Accumulator:
    """This rank's queries' output and log-sum-exp over the blocks seen so far (fp32), merged
    as ``lse = logaddexp(lse, lse_b)``, ``out = out e^(lse_old - lse) + out_b e^(lse_b - lse)``."""

    def __init__(self, q: torch.Tensor, dv: int) -> None:
        rows = q.shape[:-1]
        self.lse = torch.full(rows, float("-inf"), dtype=torch.float32, device=q.device)
        self.o = torch.zeros(*rows, dv, dtype=torch.float32, device=q.device)

    def add(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            block) -> None:
        rows, cols, mask = block
        qb, kb, vb = _take(q, rows), _take(k, cols), _take(v, cols)
        kind = _kind_of(block)
        if _fused(q):
            out_b, lse_b = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
                qb, kb, vb, 0.0, kind == "causal", scale=scale)
            out_b, lse_b = out_b.float(), lse_b.float()
        else:
            sc = torch.matmul(qb.float(), kb.float().transpose(-2, -1)) * scale
            if mask is not None:
                sc = sc.masked_fill(~_causal_mask(sc.shape[-2], sc.shape[-1], sc.device),
                                    float("-inf"))
            lse_b = torch.logsumexp(sc, -1)  # every row kept sees a key (_visible)
            out_b = torch.matmul(torch.exp(sc - lse_b.unsqueeze(-1)), vb.float())
        lse_old = self.lse if rows is None else self.lse[..., rows]
        o_old = _take(self.o, rows)
        lse_new = torch.logaddexp(lse_old, lse_b)
        o_new = (o_old * torch.exp(lse_old - lse_new).unsqueeze(-1)
                 + out_b * torch.exp(lse_b - lse_new).unsqueeze(-1))
        if rows is None:
            self.lse, self.o = lse_new, o_new
        else:
            self.lse[..., rows] = lse_new
            self.o[..., rows, :] = o_new

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, log-sum-exp) of every query row."""
        return self.o, self.lse


def _block_grads(q, k, v, dout, out, lse, delta, scale, block):
    """dQ (over all query rows), dK, dV (over all key rows) of one block, fp32: the blockwise
    attention backward with the whole output's log-sum-exp (torch's fused CPU kernel takes it
    as given, as FlashAttention's ring variants pass theirs)."""
    rows, cols, mask = block
    kind = _kind_of(block)
    if _fused(q):
        dq_b, dk_b, dv_b = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward\
            .default(_take(dout, rows).to(q.dtype), _take(q, rows), _take(k, cols),
                     _take(v, cols), _take(out, rows), _take(lse.unsqueeze(-1), rows).squeeze(-1),
                     0.0, kind == "causal", scale=scale)
        dq_b, dk_b, dv_b = dq_b.float(), dk_b.float(), dv_b.float()
    else:
        qb, kb, vb = _take(q, rows).float(), _take(k, cols).float(), _take(v, cols).float()
        dob = _take(dout, rows)
        sc = torch.matmul(qb, kb.transpose(-2, -1)) * scale
        p = torch.exp(sc - _take(lse.unsqueeze(-1), rows))
        if mask is not None:
            p = p.masked_fill(~_causal_mask(p.shape[-2], p.shape[-1], p.device), 0.0)
        dv_b = torch.matmul(p.transpose(-2, -1), dob)
        dp = torch.matmul(dob, vb.transpose(-2, -1))
        ds = p * (dp - _take(delta.unsqueeze(-1), rows)) * scale
        dq_b = torch.matmul(ds, kb)
        dk_b = torch.matmul(ds.transpose(-2, -1), qb)

    def place(part, index, like_rows):
        if index is None:
            return part
        full = torch.zeros(*part.shape[:-2], like_rows, part.shape[-1], dtype=part.dtype,
                           device=part.device)
        full[..., index, :] = part
        return full

    return (place(dq_b, rows, q.shape[-2]), place(dk_b, cols, k.shape[-2]),
            place(dv_b, cols, v.shape[-2]))


# ---------------------------------------------------------------------------------------------
# Transfers over the cp ring
# ---------------------------------------------------------------------------------------------

class _Ring:
    """Posts one block's transfer to the next rank and from the previous one."""

    def __init__(self, cp: "CPGroup", what: str) -> None:
        self.cp, self.what = cp, what

    def start(self, send: torch.Tensor):
        recv = torch.empty_like(send)
        cp = self.cp
        ops = [dist.P2POp(dist.isend, send, cp.ranks[(cp.rank + 1) % cp.size], group=cp.group),
               dist.P2POp(dist.irecv, recv, cp.ranks[(cp.rank - 1) % cp.size], group=cp.group)]
        works = dist.batch_isend_irecv(ops)
        return recv, works, send

    def finish(self, pending) -> torch.Tensor:
        recv, works, _send = pending
        for w in works:
            wait_work(w, _what(self.what, recv), self.cp.timeout, sliced=False)  # transfers
        return recv


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp, causal, scale, kind):
        heads = q.shape[-3]
        size, rank = cp.size, cp.rank
        local = q.shape[-2]
        if local % 2:  # two chunks per rank (CPGroup.split refuses such a sequence first)
            head_tail_positions(rank, size, local)  # raises the named error
        acc = _Accumulator(q, v.shape[-1])
        kv = torch.stack([k, v]).contiguous()
        if kind == "ring":
            ring = _Ring(cp, "ring attention K/V transfer")
            for step in range(size):
                src = (rank - step) % size
                pending = ring.start(kv) if step < size - 1 else None
                block = _visible(rank, src, size, local, causal)
                if block is not None:
                    acc.add(q, _expand_heads(kv[0], heads), _expand_heads(kv[1], heads), scale,
                            block)
                if pending is not None:
                    kv = ring.finish(pending)
        else:
            gathered = cp.gather_blocks(kv)
            for src in range(size):
                block = _visible(rank, src, size, local, causal)
                if block is not None:
                    acc.add(q, _expand_heads(gathered[src][0], heads),
                            _expand_heads(gathered[src][1], heads), scale, block)
        out, lse = acc.result()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (cp, causal, scale, kind)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, causal, scale, kind = ctx.args
        heads, kv_heads = q.shape[-3], k.shape[-3]
        size, rank = cp.size, cp.rank
        local = q.shape[-2]
        dout = dout.float()
        delta = (dout * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

        def grads_of(src, kb, vb):
            block = _visible(rank, src, size, local, causal)
            if block is None:
                return None
            dq_b, dk_b, dv_b = _block_grads(q, _expand_heads(kb, heads), _expand_heads(vb, heads),
                                            dout, out, lse, delta, scale, block)
            return dq_b, _fold_heads(dk_b, kv_heads), _fold_heads(dv_b, kv_heads)

        kv = torch.stack([k, v]).contiguous()
        if kind == "ring":
            ring = _Ring(cp, "ring attention K/V transfer (backward)")
            dring = _Ring(cp, "ring attention dK/dV transfer")
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            moving = None  # the dK/dV accumulator of the block in hand, in transit
            for step in range(size):
                src = (rank - step) % size
                pending = ring.start(kv) if step < size - 1 else None
                g = grads_of(src, kv[0], kv[1])
                if moving is not None:
                    dkv = dring.finish(moving)
                if g is not None:
                    dq += g[0]
                    dkv = dkv + torch.stack([g[1], g[2]])
                # the accumulator moves on with its block: after ``size`` hops it is home
                moving = dring.start(dkv)
                if pending is not None:
                    kv = ring.finish(pending)
            dkv = dring.finish(moving)
        else:
            gathered = cp.gather_blocks(kv)
            parts = torch.zeros((size,) + tuple(kv.shape), dtype=torch.float32, device=q.device)
            for src in range(size):
                g = grads_of(src, gathered[src][0], gathered[src][1])
                if g is not None:
                    dq += g[0]
                    parts[src] = torch.stack([g[1], g[2]])
            dkv = cp.reduce_scatter_blocks(parts)
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None)


class CPGroup:
    """The context-parallel process group of this rank, and the sequence ops over it."""

    def __init__(self, group: Any = None, *, timeout: timedelta | float | None = None,
                 attention: str = "ring") -> None:
        self.group = group
        self.ranks: tuple[int, ...]
        if group is None:
            self.rank, self.size, self.ranks = 0, 1, (0,)
        else:
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
            self.ranks = tuple(dist.get_process_group_ranks(group))
        self.timeout = timeout
        if attention not in ATTENTION_KINDS:
            raise ShardingError(f"unknown context-parallel attention {attention!r}",
                                expected=f"one of {ATTENTION_KINDS}", found=repr(attention))
        self.attention_kind = attention

    @classmethod
    def from_mesh(cls, mesh: Any, attention: str = "ring") -> "CPGroup":
        return cls(mesh.cp_group, timeout=mesh.timeout, attention=attention)

    def __repr__(self) -> str:
        return f"CPGroup(rank={self.rank}, size={self.size}, attention={self.attention_kind})"

    # -- the layout -----------------------------------------------------------------------------
    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor (the head-tail layout along ``dim``)."""
        if self.size == 1:
            return x
        n = x.shape[dim]
        if n % (2 * self.size):
            raise ShardingError("the sequence does not split over the context-parallel ranks",
                                expected=f"a sequence length divisible by 2 x cp = {2 * self.size}",
                                found=f"length {n} (dim {dim} of a tensor of shape "
                                      f"{tuple(x.shape)})",
                                fix=f"pad the sequence to a multiple of {2 * self.size} (masking "
                                    "the padding out of the loss), or change cp")
        chunks = x.chunk(2 * self.size, dim=dim)
        return torch.cat([chunks[self.rank], chunks[2 * self.size - 1 - self.rank]], dim=dim)

    def positions(self, index: torch.Tensor) -> torch.Tensor:
        """Global positions of local token indices ``0 .. L-1`` (a local ``arange``)."""
        if self.size == 1:
            return index
        local = int(index.shape[-1])
        table = head_tail_positions(self.rank, self.size, local, index.device).to(index.dtype)
        return table[index.long()]

    def take_positions(self, table: torch.Tensor, dim: int, length: int) -> torch.Tensor:
        """``table`` sliced ``0:length`` along ``dim`` on one device, on this rank: the rows of
        its ``length`` tokens' true positions (a position-id buffer, a rotary cache)."""
        if self.size == 1:
            return table.narrow(dim, 0, length)
        index = head_tail_positions(self.rank, self.size, int(length), table.device)
        return table.index_select(dim, index)

    # -- attention ------------------------------------------------------------------------------
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                  scale: float | None = None) -> torch.Tensor:
        """Exact attention of this rank's queries over the whole sequence's keys and values."""
        scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
        if self.size == 1:
            return torch.ops.aten.scaled_dot_product_attention.default(
                q, k, v, None, 0.0, is_causal, scale=scale,
                enable_gqa=k.shape[-3] != q.shape[-3])
        if q.shape[-3] % k.shape[-3]:
            raise ShardingError("query heads are not a multiple of the key/value heads",
                                found=f"{q.shape[-3]} and {k.shape[-3]}")
        return _CPAttention.apply(q, k, v, self, bool(is_causal), scale, self.attention_kind)

    # -- the loss -------------------------------------------------------------------------------
    def token_mean(self, loss_sum: torch.Tensor, target: torch.Tensor,
                   ignore_index: int = -100) -> torch.Tensor:
        """This rank's share of the mean over every cp rank's counted tokens: ``loss_sum``
        (the sum over this rank's tokens) times ``cp / N``, N the tokens not equal to
        ``ignore_index`` on all cp ranks. Averaged over the cp ranks (as the data-parallel
        engine averages replicas) it is one device's mean, whatever each rank counts."""
        count = (target != ignore_index).sum().to(torch.float64).reshape(1)
        if self.size > 1:
            collective(dist.all_reduce, count, group=self.group,
                       what="context-parallel count of the loss's tokens", timeout=self.timeout)
        return loss_sum * (self.size / count.to(loss_sum.dtype)).reshape(())

    # -- collectives of the allgather algorithm ------------------------------------------------
    def gather_blocks(self, kv: torch.Tensor) -> torch.Tensor:
        out = torch.empty((self.size * kv.shape[0],) + tuple(kv.shape[1:]), dtype=kv.dtype,
                          device=kv.device)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        collective(fn, out, kv.contiguous(), group=self.group, what=_what("K/V all-gather", kv),
                   timeout=self.timeout)
        return out.view((self.size,) + tuple(kv.shape))

    def reduce_scatter_blocks(self, parts: torch.Tensor) -> torch.Tensor:
        out = torch.empty(parts.shape[1:], dtype=parts.dtype, device=parts.device)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        collective(fn, out, parts.flatten(0, 1).contiguous(), group=self.group,
                   what=_what("dK/dV reduce-scatter", out), timeout=self.timeout)
        return out


# -- functional forms: the call_function targets of per-rank fx graphs ----------------------------

def attention(cp: CPGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    return cp.attention(q, k, v, is_causal, scale)


def positions(cp: CPGroup, index: torch.Tensor) -> torch.Tensor:
    return cp.positions(index)


def take_positions(cp: CPGroup, table: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    return cp.take_positions(table, dim, length)


def token_mean(cp: CPGroup, loss_sum: torch.Tensor, target: torch.Tensor,
               ignore_index: int = -100) -> torch.Tensor:
    return cp.token_mean(loss_sum, target, ignore_index)


FUNCTIONS = {"attention": attention, "positions": positions, "take_positions": take_positions,
             "token_mean": token_mean}
