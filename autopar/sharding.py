"""Placements over the tensor-parallel axis, and the collectives that move between them.

The vocabulary is torch.distributed.tensor's own placement types, for one mesh axis (tp):

- ``Replicate()``: every rank holds the whole tensor.
- ``Shard(dim)``: rank r holds the r-th of ``tp`` equal chunks along ``dim``.
- ``_StridedShard(dim, split_factor=k)`` (here :data:`StridedShard`): ``dim`` is first cut into
  ``k`` blocks, each block is sharded, and rank r holds its chunk of every block, concatenated.
  This is the layout of a fused projection whose output is later split into ``k`` equal parts
  (GPT-2's ``c_attn``: rank r holds ``[q_r; k_r; v_r]``), as torch defines it.
- ``Partial("sum")``: every rank holds a full-shape tensor; the value is the sum over ranks.

:func:`redistribution` is the single table of which collectives turn one placement into
another, forward and backward (Megatron's f and g among them); the sharding search prices it,
the collective-insertion pass emits it and the runtime (``autopar.runtime.tp``) executes it.
:func:`shard_tensor` / :func:`unshard_tensors` slice a full tensor into its per-rank pieces and
back (state dicts, gradients).

A leaf module: it imports only torch and :mod:`autopar.errors`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

from autopar.errors import ShardingError

__all__ = [
    "Placement",
    "Replicate",
    "Shard",
    "StridedShard",
    "Partial",
    "REPLICATE",
    "PARTIAL",
    "is_sharded",
    "shard_dim",
    "num_blocks",
    "make_shard",
    "placement_str",
    "local_shape",
    "shard_tensor",
    "unshard_tensors",
    "pad_to",
    "crop_to",
    "shard_slices",
    "Collective",
    "CollectiveStep",
    "redistribution",
    "gradient_is_partial",
]

REPLICATE = Replicate()
PARTIAL = Partial("sum")


def is_sharded(p: Any) -> bool:
    """Shard or StridedShard (StridedShard is not a Shard subclass in torch)."""
    return isinstance(p, (Shard, StridedShard))


def shard_dim(p: Any) -> int | None:
    return p.dim if is_sharded(p) else None


def num_blocks(p: Any) -> int:
    """How many blocks a sharded dim is cut into before sharding (1 for a plain Shard)."""
    return int(p.split_factor) if isinstance(p, StridedShard) else 1


def make_shard(dim: int, blocks: int = 1) -> Placement:
    return Shard(dim) if blocks == 1 else StridedShard(dim, split_factor=blocks)


def placement_str(p: Any) -> str:
    """Short text: R, P, S(1), S(2)x3 (a StridedShard of 3 blocks); tuples as (a, b)."""
    if isinstance(p, tuple):
        return "(" + ", ".join(placement_str(q) for q in p) + ")"
    if p is None:
        return "-"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    if isinstance(p, StridedShard):
        return f"S({p.dim})x{num_blocks(p)}"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    raise TypeError(f"not a placement: {p!r}")


def local_shape(shape: Sequence[Any], p: Any, tp: int) -> tuple[Any, ...]:
    """The per-rank shape of a tensor of ``shape`` placed as ``p`` (sizes may be sympy)."""
    out = list(shape)
    if is_sharded(p):
        out[p.dim] = out[p.dim] // tp
    return tuple(out)


def _check_divisible(size: int, p: Any, tp: int, what: str) -> None:
    k = num_blocks(p)
    if size % (tp * k):
        raise ShardingError(f"{what}: dim {p.dim} of size {size} cannot be split {tp} ways"
                            + (f" in each of {k} blocks" if k > 1 else ""),
                            expected=f"a size divisible by {tp * k}", found=str(size),
                            fix="choose a tensor-parallel size that divides it, or pad the model")


def shard_slices(size: int, p: Any, tp: int, rank: int) -> list[tuple[int, int]]:
    """The [start, stop) ranges along the sharded dim that rank ``rank`` holds, in order."""
    k = num_blocks(p)
    block = size // k
    piece = block // tp
    return [(j * block + rank * piece, j * block + (rank + 1) * piece) for j in range(k)]


def shard_tensor(t: torch.Tensor, p: Any, tp: int, rank: int, what: str = "tensor") -> torch.Tensor:
    """Rank ``rank``'s piece of the full tensor ``t`` under placement ``p`` (a copy)."""
    if isinstance(p, Replicate):
        return t.detach().clone()
    if not is_sharded(p):
        raise ShardingError(f"{what} cannot be sliced from a full tensor as {placement_str(p)}",
                            expected="Replicate, Shard or StridedShard")
    _check_divisible(t.shape[p.dim], p, tp, what)
    parts = [t.narrow(p.dim, a, b - a) for a, b in shard_slices(t.shape[p.dim], p, tp, rank)]
    return torch.cat(parts, dim=p.dim).detach().clone() if len(parts) > 1 else parts[0].detach().clone()


def unshard_tensors(pieces: Sequence[torch.Tensor], p: Any) -> torch.Tensor:
    """The full tensor from every rank's piece (rank order); the inverse of shard_tensor."""
    if isinstance(p, Replicate):
        return pieces[0].detach().clone()
    if isinstance(p, Partial):
        return torch.stack([x.detach() for x in pieces]).sum(0)
    k = num_blocks(p)
    blocks = [x.chunk(k, dim=p.dim) for x in pieces]
    return torch.cat([blocks[r][j] for j in range(k) for r in range(len(pieces))], dim=p.dim)


def crop_to(value: torch.Tensor, logical: tuple[int, ...]) -> torch.Tensor:
    """A padded tensor cut back to its logical shape (a view)."""
    for d, size in enumerate(logical):
        if value.shape[d] != size:
            value = value.narrow(d, 0, size)
    return value


def pad_to(value: torch.Tensor, full: tuple[int, ...]) -> torch.Tensor:
    """A logical tensor zero-padded to the program's shape ``full``."""
    if tuple(value.shape) == tuple(full):
        return value
    out = value.new_zeros(full)
    out[tuple(slice(0, s) for s in value.shape)] = value
    return out


# ---------------------------------------------------------------------------------------------
# Collectives between placements
# ---------------------------------------------------------------------------------------------

class Collective(enum.Enum):
    """What a step does on the wire (forward or backward)."""

    NONE = "none"  # identity
    SLICE = "slice"  # local: keep this rank's chunk
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"

    @property
    def communicates(self) -> bool:
        return self not in (Collective.NONE, Collective.SLICE)

    def ring_factor(self, tp: int) -> float:
        """Bytes each rank sends, as a fraction of the full tensor's bytes (ring algorithms)."""
        if self is Collective.ALL_REDUCE:
            return 2 * (tp - 1) / tp
        if self in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
            return (tp - 1) / tp
        if self is Collective.ALL_TO_ALL:
            return (tp - 1) / tp ** 2
        return 0.0


@dataclass(frozen=True, slots=True)
class CollectiveStep:
    """One call of the runtime's ``TPGroup.<method>(x, **kwargs)`` and what it costs.

    ``forward`` / ``backward`` name the collective each direction performs; ``note`` says why,
    in Megatron's terms where there are some (f: identity forward, all-reduce backward; g: the
    reverse).
    """

    method: str
    kwargs: tuple[tuple[str, Any], ...]
    forward: Collective
    backward: Collective
    note: str = ""

    def __post_init__(self) -> None:
        if self.method not in _METHODS:
            raise ValueError(f"unknown tensor-parallel method {self.method!r}; expected one of "
                             f"{sorted(_METHODS)}")

    @property
    def kwargs_dict(self) -> dict[str, Any]:
        return dict(self.kwargs)


_METHODS = {"all_reduce", "copy_to_tp", "all_gather", "reduce_scatter", "shard", "all_to_all"}


def _all_gather(dim: int, blocks: int, partial_grad: bool) -> CollectiveStep:
    kw: list[tuple[str, Any]] = [("dim", dim)]
    if blocks > 1:
        kw.append(("blocks", blocks))
    if partial_grad:
        kw.append(("grad", "reduce_scatter"))
        return CollectiveStep("all_gather", tuple(kw), Collective.ALL_GATHER,
                              Collective.REDUCE_SCATTER, "all-gather; backward reduce-scatter")
    return CollectiveStep("all_gather", tuple(kw), Collective.ALL_GATHER, Collective.SLICE,
                          "all-gather; backward keeps this rank's slice")


def _shard(dim: int, blocks: int) -> CollectiveStep:
    kw: list[tuple[str, Any]] = [("dim", dim)]
    if blocks > 1:
        kw.append(("blocks", blocks))
    return CollectiveStep("shard", tuple(kw), Collective.SLICE, Collective.ALL_GATHER,
                          "local slice; backward all-gather")


_ALL_REDUCE = CollectiveStep("all_reduce", (), Collective.ALL_REDUCE, Collective.NONE,
                             "g: sum partial results; backward identity")
_COPY_TO_TP = CollectiveStep("copy_to_tp", (), Collective.NONE, Collective.ALL_REDUCE,
                             "f: identity; backward all-reduce of partial gradients")


def redistribution(src: Any, dst: Any, partial_grad: bool = False) -> tuple[CollectiveStep, ...] | None:
    """The steps that turn a tensor placed as ``src`` into ``dst`` (None: impossible).

    ``partial_grad`` says the consumer's local gradient for the replicated result is partial
    (the consumer computes a sharded or partial output from it): the backward must then sum
    over ranks, which is Megatron's f (or, after an all-gather, a reduce-scatter instead of a
    slice). It only matters when ``dst`` is Replicate.
    """
    if isinstance(dst, Partial):
        return () if isinstance(src, Partial) and src == dst else None
    if isinstance(dst, Replicate):
        if isinstance(src, Replicate):
            return (_COPY_TO_TP,) if partial_grad else ()
        if isinstance(src, Partial):
            return (_ALL_REDUCE, _COPY_TO_TP) if partial_grad else (_ALL_REDUCE,)
        return (_all_gather(src.dim, num_blocks(src), partial_grad),)
    if not is_sharded(dst):
        raise TypeError(f"not a placement: {dst!r}")
    if src == dst:
        return ()
    d, k = dst.dim, num_blocks(dst)
    if isinstance(src, Replicate):
        return (_shard(d, k),)
    if isinstance(src, Partial):
        if k == 1:
            return (CollectiveStep("reduce_scatter", (("dim", d),), Collective.REDUCE_SCATTER,
                                   Collective.ALL_GATHER, "reduce-scatter; backward all-gather"),)
        return (_ALL_REDUCE, _shard(d, k))
    if num_blocks(src) == 1 and k == 1:
        return (CollectiveStep("all_to_all", (("src_dim", src.dim), ("dst_dim", d)),
                               Collective.ALL_TO_ALL, Collective.ALL_TO_ALL,
                               "all-to-all; backward all-to-all"),)
    return (_all_gather(src.dim, num_blocks(src), False), _shard(d, k))


def gradient_is_partial(input_placement: Any, output_placement: Any) -> bool:
    """Whether an op's local gradient for a replicated input is a partial sum over ranks.

    Each rank computes only its part of a sharded or partial output, so the gradient it
    propagates to a replicated input covers only that part; the true gradient is the sum over
    ranks. (A multi-output op counts as distributed if any output is.)
    """
    if not isinstance(input_placement, Replicate):
        return False
    outs = output_placement if isinstance(output_placement, tuple) else (output_placement,)
    return any(o is not None and not isinstance(o, Replicate) for o in outs)
