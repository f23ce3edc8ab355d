"""Dropout masks that do not depend on the plan.

Eager dropout draws from each process's RNG stream, so tensor-parallel ranks holding the same
replicated activation draw different masks, data-parallel replicas and micro-batches consume the
stream in plan-dependent order, and a run on 8 GPUs never reproduces the single-device run. The
generated program instead draws every mask as a deterministic function of

    (seed, step, dropout site, global row of the sample, element within the sample)

For each sample of a micro-batch, with global row ``g`` in the global batch, a generator seeded
from a hash of ``(seed, step, site, g)`` draws the mask of the whole (unsharded) per-sample
tensor; a tensor-parallel rank then keeps its slice (``Shard(dim)`` -> its chunk). Any plan (dp,
pp, tp, sequence parallel, micro-batching, recompute) therefore draws the masks of the
single-process run of the same program (plan dp = pp = tp = 1), and a recomputed forward replays
them. The price: every tensor-parallel rank draws the full per-sample mask (tp times the random
numbers of a sharded draw) and a generator is seeded per sample and site. The masks differ from
eager PyTorch's (another stream), and between CPU and CUDA (other generators).

The executor says which rows a micro-batch holds (:meth:`DropoutRNG.set_rows`, from the
data-parallel rank and the micro-batch index); the step counter comes from the training loop.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence

import torch

__all__ = ["DropoutRNG", "TORCH_RANDOM_OPS"]

#: torch's ops whose result differs from one call to the next (they draw from its global RNG):
#: never recomputed on another stage (passes/split_stages.py), and the reason a checkpointed
#: block must restore that RNG when it runs again (runtime/layer_recompute.py).
TORCH_RANDOM_OPS = frozenset({
    "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
    "bernoulli", "dropout", "native_dropout", "feature_dropout", "alpha_dropout", "normal",
    "uniform", "multinomial", "exponential", "poisson", "rrelu", "rrelu_with_noise",
})


class DropoutRNG:
    """The dropout state of one rank: seed, step, the rows of the running micro-batch."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)
        self.step = 0
        #: (first global row, rows) of the micro-batch being run; None: the tensor's own rows.
        self.rows: tuple[int, int] | None = None
        #: False in evaluation: dropout is the identity.
        self.training = True

    def set_rows(self, first: int, count: int) -> None:
        self.rows = (int(first), int(count))

    def __repr__(self) -> str:
        return (f"DropoutRNG(seed={self.seed}, step={self.step}, rows={self.rows}, "
                f"training={self.training})")

    def _generator(self, device: torch.device, *key: object) -> torch.Generator:
        text = "/".join(str(k) for k in (self.seed, self.step, *key))
        seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        gen = torch.Generator(device=device)
        gen.manual_seed(seed & ((1 << 63) - 1))
        return gen

    def draw_per_sample(self, out: torch.Tensor, site: str, batch_dim: int | None,
                        draw: Callable[[torch.Tensor, torch.Generator, int, int | None], Any]
                        ) -> None:
        """Fill ``out`` sample by sample: ``draw(part, generator, start, length)`` for each
        sample's ``part`` along ``batch_dim`` (elements ``[start, start + length)``), the
        generator seeded by (seed, step, site, global row) as :meth:`keep_mask` seeds it; one
        call for the whole tensor (``length`` None) where it has no batch dim."""
        with torch.no_grad():
            if batch_dim is None or out.dim() == 0:
                first = self.rows[0] if self.rows is not None else 0
                draw(out, self._generator(out.device, site, "all", first), 0, None)
                return
            n = out.shape[batch_dim]
            first, count = self.rows if self.rows is not None else (0, n)
            if count <= 0 or n % count:
                first, count = 0, n  # not laid out by samples: one row per slab
            per = n // count
            for i in range(count):
                draw(out.narrow(batch_dim, i * per, per),
                     self._generator(out.device, site, first + i), i * per, per)

    def keep_mask(self, site: str, full_shape: Sequence[int], batch_dim: int | None, p: float,
                  device: torch.device) -> torch.Tensor:
        """A boolean mask of ``full_shape`` (True: keep, with probability 1 - p).

        ``batch_dim``: the dim that runs over the micro-batch's samples (its size a multiple of
        the micro-batch's rows: ``b`` or ``b * s`` flattened); None for a tensor with no batch
        dim (one draw for the whole tensor)."""
        shape = [int(d) for d in full_shape]
        if batch_dim is None:
            first = self.rows[0] if self.rows is not None else 0
            gen = self._generator(device, site, "all", first)
            return torch.rand(shape, generator=gen, device=device) >= p
        n = shape[batch_dim]
        first, count = self.rows if self.rows is not None else (0, n)
        if count <= 0 or n % count:
            first, count = 0, n  # not laid out by samples: one row per slab
        per = n // count
        sample_shape = shape[:batch_dim] + [per] + shape[batch_dim + 1:]
        masks = [torch.rand(sample_shape, generator=self._generator(device, site, first + i),
                            device=device) >= p for i in range(count)]
        return torch.cat(masks, dim=batch_dim) if len(masks) > 1 else masks[0]
