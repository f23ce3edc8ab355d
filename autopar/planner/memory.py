"""Memory per rank: model states by precision and ZeRO stage, activations by schedule position.

Model states (Rajbhandari et al. 2020, ZeRO, section 3). With ``P`` the parameters a
rank holds after tensor and pipeline splitting, ``d`` the data-parallel degree, and per-parameter
bytes ``(w, g, o)``:

- ``bf16``, (2, 4, 12): bf16 weights, **fp32 gradients** (accumulated over micro-batches and
  reduced across replicas in fp32: autopar's runtime, ``MixedPrecision.grad_dtype``, and
  Megatron-LM's default for bf16, ``accumulate_allreduce_grads_in_fp32``), fp32 master weights,
  momentum and variance: 18 bytes per parameter, as Megatron-LM's distributed-optimizer
  documentation counts them. Measured on an H200: 18.2 bytes per parameter allocated after a
  step of GPT-2 medium (``benchmarks/gpu_memory.py``);
- ``fp16``, (2, 2, 12): fp16 gradients, the ZeRO paper's 16 bytes (Megatron-LM's fp16 default);
- ``fp32``, (4, 4, 8).

=======  =============  =============  =============  ==================  ==================
ZeRO     weights        gradients      optimizer      total, (2, 2, 12)   total, (2, 4, 12)
=======  =============  =============  =============  ==================  ==================
0        w P            g P            o P            16 P                18 P
1        w P            g P            o P / d        4 P + 12 P / d      6 P + 12 P / d
2        w P            g P / d        o P / d        2 P + 14 P / d      2 P + 16 P / d
3        w P / d        g P / d        o P / d        16 P / d            18 P / d
=======  =============  =============  =============  ==================  ==================

ZeRO-3 also holds the gathered parameters of the layer it runs and of the one it prefetches, and
the unsharded gradients of the layer whose backward runs and of the one being reduce-scattered.

Activations: a rank holds the activations of ``in_flight`` micro-batches (see
:func:`autopar.planner.schedule_model.in_flight_micro_batches`: the peaks of the runtime's
action lists) at the recompute setting's size, plus, with recomputation, one layer's full
activations while that layer's backward runs.

The optimizer step: after the last backward the activations are gone, but the step allocates a
temporary of its own (:func:`optimizer_step_bytes`). torch's Adam / AdamW on CUDA tensors take the
``foreach`` path (``torch.optim.optimizer._default_to_fused_or_foreach``), whose
``_multi_tensor_adam`` computes ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`` for every
stepped tensor at once: one fp32 temporary the size of the rank's stepped (ZeRO: sharded)
master weights. On a CPU the for-loop path (``_single_tensor_adam``) computes
``(exp_avg_sq.sqrt() / bias_correction2_sqrt)``, two temporaries the size of one tensor, while
the previous tensor's ``denom`` is still bound: the runtime's optimizer steps each parameter's
piece of a flat bucket (runtime/data_parallel.py, 25 MiB by default) as one tensor, so the
rank's largest parameter, a bucket's share at most. Other optimizers hold other temporaries
(SGD none, SGD with weight decay foreach a decayed copy of every gradient): ``parallelize``
counts the optimizer it is given on probes (``OptimizerFactory.step_cost``: the bytes that grow
with the tensors stepped and those held per element of the one being stepped), on the path the
device takes, and prices those. An offloaded optimizer steps on the host and leaves none on the
device. The rank's peak is its states plus the larger of the two moments: ``max(activations + buffers, step temporary)``. Measured on an H100
(``benchmarks/gpu_memory.py``, 2026-11-28): LLaMA-7B shapes cut to 4 layers (1.07 B parameters,
2 x 2048 tokens, full recompute) peak 3.99 GiB above their states, the 4.0 GiB of that
temporary, where the activations alone would have been 1.7 GiB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

from autopar.plan_types import MOMENT_BYTES, OptimizerKernel, OptimizerProfile, OptimizerStep

if TYPE_CHECKING:
    from autopar.planner.candidates import Candidate, RankSums

__all__ = ["STATE_BYTES", "ModelStateBytes", "model_state_bytes", "offloaded_state_bytes",
           "sharded_state_bytes",
           "optimizer_step_bytes", "RankMemory", "rank_memory", "peak_rank_memory"]

#: bytes per parameter (weights, gradients, optimizer states) by training precision (bf16: the
#: gradients in fp32, as the runtime keeps them; see the module docstring).
STATE_BYTES: dict[str, tuple[int, int, int]] = {
    "bf16": (2, 4, 12),
    "fp16": (2, 2, 12),
    "fp32": (4, 4, 8),
}


# MOMENT_BYTES (plan_types): Adam's two fp32 moments, the optimizer state of ``STATE_BYTES``, and
# what ``offload="disk"`` keeps in files. Another optimizer's own state replaces it
# (``OptimizerProfile.state_bytes``, measured by the runtime from the optimizer it is given:
# SGD with momentum 4, plain SGD 0, AdamW with ``amsgrad`` 12).


def offloaded_state_bytes(optimizer_bytes: float, offload: str, separate_host: bool,
                          state_bytes: float = MOMENT_BYTES) -> float:
    """Optimizer bytes per parameter left in the device's memory when its state is offloaded
    (``Plan.offload``; runtime/zero.py, runtime/offload.py): none on a GPU (``separate_host``:
    the master weights and the optimizer's state live in host memory or files); on a CPU
    cluster, whose device is the host, "optimizer" moves nothing and "disk" takes the
    optimizer's element-wise state out (``state_bytes`` per parameter)."""
    if offload == "none":
        return optimizer_bytes
    if separate_host:
        return 0.0
    return optimizer_bytes if offload == "optimizer" else optimizer_bytes - state_bytes


def sharded_state_bytes(dtype: str, zero: int, shards: int, offload: str, separate_host: bool,
                        state_bytes: float = MOMENT_BYTES) -> tuple[float, float, float]:
    """Bytes per parameter one rank keeps of its (weights, gradients, optimizer state) at ZeRO
    stage ``zero`` over ``shards`` ranks (stage 1 shards the optimizer state, 2 also the
    gradients, 3 also the weights), with the optimizer state ``offload`` leaves on the device
    (:func:`offloaded_state_bytes`); the optimizer state is the fp32 master weights under mixed
    precision and the optimizer's own ``state_bytes`` (Adam's moments by default)."""
    w, g, adam_o = STATE_BYTES[dtype]
    o = offloaded_state_bytes(adam_o - MOMENT_BYTES + state_bytes, offload, separate_host,
                              state_bytes)
    return (w / (shards if zero >= 3 else 1), g / (shards if zero >= 2 else 1),
            o / (shards if zero >= 1 else 1))


#: Bytes per stepped parameter of the master weights the optimizer updates (fp32 in every
#: training precision: runtime/zero.py keeps fp32 masters under mixed precision).
MASTER_BYTES = 4

#: Elements of the runtime's default flat gradient bucket (``DataParallelConfig.bucket_mb`` =
#: 25, fp32 gradients): the largest tensor the CPU's for-loop optimizer steps at once.
BUCKET_ELEMENTS = 25 * 2**20 // 4


def optimizer_step_bytes(stepped_params: float, offload: str, separate_host: bool,
                         kernel: OptimizerKernel | None = None,
                         step: OptimizerStep | None = None,
                         largest: float | None = None) -> float:
    """Device bytes the optimizer step allocates on top of the states (module docstring). With
    ``step``'s counted temporaries (``OptimizerFactory.step_cost``): its bytes per element of
    every stepped parameter, plus its bytes per element of the largest tensor one step call
    holds (``largest``; by default a flat bucket's, runtime/data_parallel.py). The for-loop's
    12 there (the tensor it steps and the previous one's denominator) are exact for tensors of
    equal size and a bound where they shrink. Without a count, AdamW's by its ``kernel`` (None:
    torch's default, foreach on a GPU, ``separate_host``, the for-loop on a CPU): foreach one
    fp32 temporary per stepped parameter (its ``_foreach_sqrt``), the for-loop two the size of
    the largest tensor it steps, the fused kernel none. None on the device when the step is
    offloaded to the host."""
    if separate_host and offload != "none":
        return 0.0
    largest = min(stepped_params, BUCKET_ELEMENTS if largest is None else largest)
    if step is not None and step.temporary_bytes is not None:
        return (step.temporary_bytes * stepped_params
                + (step.tensor_temporary_bytes or 0.0) * largest)
    kernel = kernel or OptimizerKernel.default_on(separate_host)
    if kernel is OptimizerKernel.FUSED:
        return 0.0
    if kernel is OptimizerKernel.FOREACH:
        return MASTER_BYTES * stepped_params
    return 2 * MASTER_BYTES * largest


@dataclass(frozen=True, slots=True)
class ModelStateBytes:
    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def model_state_bytes(params: float, dp: int, zero: int, dtype: str,
                      state_bytes: float = MOMENT_BYTES) -> ModelStateBytes:
    """Weights, gradients and optimizer states of ``params`` parameters on one rank, the
    optimizer's own state ``state_bytes`` per parameter (Adam's moments by default)."""
    if dtype not in STATE_BYTES:
        raise ValueError(f"unknown training precision {dtype!r}; expected one of "
                         f"{sorted(STATE_BYTES)}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    w, g, o = sharded_state_bytes(dtype, zero, dp, "none", False, state_bytes)
    return ModelStateBytes(weights=w * params, gradients=g * params, optimizer=o * params)


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Peak memory of one pipeline rank (bytes)."""

    pp_rank: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    #: ZeRO-3 gathered parameters and the pipeline's receives posted ahead of their compute.
    buffers: float = 0.0
    #: The optimizer step's temporary (:func:`optimizer_step_bytes`): allocated after the
    #: backward, when the activations and buffers are freed.
    optimizer_step: float = 0.0

    @property
    def states(self) -> float:
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return _peak_bytes(self.weights, self.gradients, self.optimizer, self.activations,
                           self.buffers, self.optimizer_step)

    def to_json(self) -> dict[str, int]:
        return {"weights": int(self.weights), "gradients": int(self.gradients),
                "optimizer": int(self.optimizer), "activations": int(self.activations),
                "buffers": int(self.buffers), "optimizer_step": int(self.optimizer_step),
                "total": int(self.total)}


def _peak_bytes(weights: float, gradients: float, optimizer: float, activations: float,
                buffers: float, optimizer_step: float) -> float:
    """A rank's peak: its states, and the larger of its activations with the buffers and the
    optimizer step's temporary (allocated once those are freed)."""
    return weights + gradients + optimizer + max(activations + buffers, optimizer_step)


def _rank_fields(c: "Candidate", ranks: Sequence["RankSums"], activations: Sequence[float],
                 dtype: str, separate_host: bool, receives_ahead: Sequence[int] = (),
                 optimizer: OptimizerProfile = OptimizerProfile()
                 ) -> Iterator[tuple[float, ...]]:
    """Per pipeline rank: (weights, gradients, optimizer, activations, buffers, optimizer step)
    bytes, as :func:`rank_memory` documents them."""
    w_bytes, g_bytes, _ = STATE_BYTES[dtype]
    n = c.dp * c.cp  # replicas
    zero = c.zero
    w_per, g_per, o_per = sharded_state_bytes(dtype, zero, n, c.offload, separate_host,
                                              optimizer.state_bytes)
    ne = max(n // c.ep, 1)  # the ranks an expert's ZeRO shards span
    w_ex, g_ex, o_ex = sharded_state_bytes(dtype, zero, ne, c.offload, separate_host,
                                           optimizer.state_bytes)
    gathered = zero == 3 and not c.reshard_after_forward
    for r, (rs, acts) in enumerate(zip(ranks, activations)):
        # unsharded gradients: a frozen layer has none
        if gathered:
            buffers = rs.params * w_bytes + 2 * rs.largest_layer_trainable * g_bytes
        elif zero == 3:
            buffers = 2 * (rs.largest_layer_params * w_bytes
                           + rs.largest_layer_trainable * g_bytes)
        else:
            buffers = 0.0
        if receives_ahead:
            buffers += receives_ahead[r] * rs.received_bytes
        ex = rs.expert_params
        dense = rs.params - ex
        # frozen parameters: weights alone (no master copy, runtime/zero.py), no gradient, no
        # optimizer state, not stepped
        fex = rs.frozen_expert_params
        fdense = rs.frozen_params - fex
        tex, tdense = ex - fex, dense - fdense
        stepped = tdense / n + tex / ne if zero >= 1 else rs.trainable_params
        # the largest tensor one step call holds: a parameter, a ZeRO shard's piece of it at
        # most a bucket's share, a flat bucket at most (runtime/data_parallel.py)
        largest = min(rs.largest_param or math.inf,
                      BUCKET_ELEMENTS / (n if zero >= 1 else 1))
        yield (w_per * dense + w_ex * ex, g_per * tdense + g_ex * tex, o_per * tdense + o_ex * tex,
               acts, buffers, optimizer_step_bytes(stepped, c.offload, separate_host,
                                                   optimizer.kernel, optimizer.step, largest))


def rank_memory(c: "Candidate", ranks: Sequence["RankSums"], activations: Sequence[float],
                dtype: str, separate_host: bool, receives_ahead: Sequence[int] = (),
                optimizer: OptimizerProfile = OptimizerProfile()) -> list[RankMemory]:
    """Peak bytes of each pipeline rank of candidate ``c``: model states at its ZeRO stage over
    its dp x cp replicas (:func:`model_state_bytes`, inlined: the search calls this for every
    rank of every candidate; experts' shards span the dp / ep ranks holding the same experts),
    the optimizer state left on the device by ``c.offload`` (:func:`offloaded_state_bytes`),
    ``activations[r]`` (the schedule's in-flight micro-batches), and ZeRO-3's gathered buffers:
    the weights of the layer running and of the one prefetched and the unsharded gradients of
    the layer computed and of the one reduce-scattered; kept gathered between forward and
    backward (``reshard_after_forward=False``), the whole stage's weights;
    ``receives_ahead[r]`` boundary tensors received ahead of their compute
    (``ScheduleSpec.receives_ahead`` on a transport that pairs messages by their order, NCCL:
    up to p - 1 on interleaved 1F1B's first rank; one on gloo), each the largest the rank
    receives; and the optimizer step's temporary over the parameters the rank steps, by the
    ``optimizer``'s kernel or its counted step (:func:`optimizer_step_bytes`), whose own state
    is its ``state_bytes`` per parameter (:func:`sharded_state_bytes`)."""
    return [RankMemory(r, *fields)
            for r, fields in enumerate(_rank_fields(c, ranks, activations, dtype, separate_host,
                                                    receives_ahead, optimizer))]


def peak_rank_memory(c: "Candidate", ranks: Sequence["RankSums"], activations: Sequence[float],
                     dtype: str, separate_host: bool, receives_ahead: Sequence[int] = (),
                     optimizer: OptimizerProfile = OptimizerProfile()
                     ) -> tuple[RankMemory, float]:
    """The rank of :func:`rank_memory` with the highest total (the first of equals) and the
    least total without the optimizer state over all ranks, without a :class:`RankMemory` per
    rank: the search's memory screen asks this of every candidate, most of which do not fit
    (GPT-3 175B on 1024 GPUs: 14,000 candidates of up to 64 ranks)."""
    peak = -1.0
    best: tuple[int, tuple[float, ...]] | None = None
    least = math.inf
    for r, f in enumerate(_rank_fields(c, ranks, activations, dtype, separate_host,
                                       receives_ahead, optimizer)):
        total = _peak_bytes(*f)
        if total > peak:
            peak, best = total, (r, f)
        least = min(least, total - f[2])  # without the optimizer state
    if best is None:
        raise ValueError("a candidate has at least one pipeline rank")
    return RankMemory(best[0], *best[1]), least
