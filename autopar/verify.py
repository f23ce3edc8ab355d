"""The equivalence check: one micro-batch through the parallel program and the original model.

``parallelize(..., verify=True)`` and :meth:`ParallelModel.verify` run here. Every rank already
holds the whole original model (``parallelize`` takes real weights), so every rank checks its own
part, and nothing but one small vector crosses the network:

1. This rank's data-parallel share of the batch gives its first micro-batch (the whole
   sequence: under context parallelism the rank holds some of its tokens, step 3).
2. The reference: the captured graph of the original model (``CapturedGraph.run``: the single
   device program) runs that micro-batch in evaluation (dropout off, batch norms by their
   running statistics, no buffer updated), keeping only the *layer boundary* tensors this
   rank's stages compute (a tensor made in one layer and read by a later one) and the loss,
   and stopping after the last of them. The weights are the original model's while the parallel model has not trained;
   after training, the parallel model's own full weights (``state_dict()``, a gather).
3. The parallel program runs the same batch forward (``eval_step``); for the first micro-batch
   each of this rank's stage graphs is interpreted node by node, and every boundary tensor it
   holds in a comparable placement (replicated, or sharded: the reference is sliced with the
   node's placement; pending sums are skipped) is compared with the reference on the spot.
   Under context parallelism the reference is also cut to this rank's tokens (the head-tail
   layout along every dim of size ``s``; a tensor whose tokens are folded into another dim,
   ``b*s``, is not compared), and the loss, of which each cp rank holds its tokens' share, is
   averaged over the cp group before it is compared.
4. One all-reduce (MAX) of the per-layer ``[max abs, max rel]`` vector and one (SUM) of the
   counts give every rank the same :class:`VerificationReport`.

The relative difference of a tensor is ``max |parallel - reference| / max |reference|``. The
default tolerance is 1e-4 in fp32 (reordered sums move results by ~1e-7; a missing all-reduce or a
wrong shard by O(1)) and 5e-2 with mixed precision (bf16 keeps 8 bits of mantissa). Beyond it,
:class:`autopar.VerificationError` names the first layer that differs: the fault is there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.fx

from autopar.errors import VerificationError
from autopar.ir import META_KEY, SEQ, NodeKind, TensorSpec, info
from autopar.passes.loss_reduction import scaled_step
from autopar.passes.tp_transform import batch_dim_of, draws_per_sample
from autopar.runtime.loss_scale import LossScale
from autopar.runtime.rng import DropoutRNG
from autopar.runtime.running_stats import affine_as_statistics
from autopar.runtime.tp import TPGroup

__all__ = ["verify", "VerificationReport", "LayerCheck", "DEFAULT_TOLERANCE",
           "MIXED_PRECISION_TOLERANCE"]

DEFAULT_TOLERANCE = 1e-4
MIXED_PRECISION_TOLERANCE = 5e-2
#: Added to the reference's magnitude in relative differences (tensors that are ~0).
_FLOOR = 1e-6

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class LayerCheck:
    """The largest difference over the boundary tensors of one layer (or the loss), all ranks."""

    layer: str
    max_abs: float | None  # None: nothing of this layer could be compared
    max_rel: float | None
    tensors: int  # tensors compared, summed over ranks

    def fails(self, tolerance: float) -> bool:
        return self.max_rel is not None and not self.max_rel <= tolerance  # nan fails


@dataclass(frozen=True, slots=True)
class VerificationReport:
    """Per-layer differences between the parallel program and the original model."""

    layers: tuple[LayerCheck, ...]  # the captured layers in order, then "loss"
    tolerance: float
    micro_batch_size: int

    @property
    def failures(self) -> list[LayerCheck]:
        return [c for c in self.layers if c.fails(self.tolerance)]

    @property
    def first_failure(self) -> LayerCheck | None:
        bad = self.failures
        return bad[0] if bad else None

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {c.layer: {"max_abs": c.max_abs, "max_rel": c.max_rel, "tensors": c.tensors}
                for c in self.layers}

    def lines(self) -> list[str]:
        rows = [f"{'layer':<28} {'max abs':>10} {'max rel':>10} {'tensors':>7}"]
        for c in self.layers:
            mark = "  <- beyond tolerance" if c.fails(self.tolerance) else ""
            if c.max_rel is None:
                rows.append(f"{c.layer:<28} {'-':>10} {'-':>10} {c.tensors:>7}")
            else:
                rows.append(f"{c.layer:<28} {c.max_abs:>10.3g} {c.max_rel:>10.3g} "
                            f"{c.tensors:>7}{mark}")
        return rows

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def table(self) -> Any:
        """The report as a rich Table."""
        from rich.table import Table

        status = "ok" if self.ok else f"FAILED at {self.first_failure.layer}"
        t = Table(title=f"autopar verify: one micro-batch ({self.micro_batch_size} samples) vs the "
                        f"original model, tolerance {self.tolerance:g} relative: {status}")
        for col in ("layer", "max abs diff", "max rel diff", "tensors"):
            t.add_column(col, justify="left" if col == "layer" else "right")
        for c in self.layers:
            style = "red" if c.fails(self.tolerance) else None
            cells = (["-", "-"] if c.max_rel is None else [f"{c.max_abs:.3g}", f"{c.max_rel:.3g}"])
            t.add_row(c.layer, *cells, str(c.tensors), style=style)
        return t

    def print(self) -> None:
        from autopar.units import console

        console().print(self.table())


def verify(pm: Any, inputs: Any, targets: Any = (), *, tolerance: float | None = None,
           raise_on_failure: bool = True, local: bool = False) -> VerificationReport:
    """See the module docstring. Collective: call on every rank with the same batch."""
    if tolerance is None:
        mixed = pm.training.mixed_precision
        tolerance = MIXED_PRECISION_TOLERANCE if mixed else DEFAULT_TOLERANCE
    captured = pm.captured
    layer_index = {layer.name: i for i, layer in enumerate(captured.layers)}
    n_layers = len(captured.layers)
    stats = torch.full((n_layers + 1, 2), -1.0, dtype=torch.float64)
    counts = torch.zeros(n_layers + 1, dtype=torch.float64)

    inputs_p, targets_p = pm._prepare(inputs, targets, local, whole_sequence=True)
    m = pm.plan.num_micro_batches
    first = [t.chunk(m, dim=0)[0] if isinstance(t, torch.Tensor) and t.dim() else t
             for t in (*inputs_p, *targets_p)]
    micro_batch_size = next((t.shape[0] for t in first if isinstance(t, torch.Tensor)
                             and t.dim()), 1)

    # which boundary tensors this rank's stages hold, in which placement
    boundary = _boundary_nodes(captured)
    cp = pm.cp_group
    wanted: dict[int, dict[str, _Wanted]] = {}
    returns_loss: dict[int, bool] = {}
    for s in pm.executor.stage_modules:
        stage = pm.split.stages[s]
        wanted[s] = _comparable(stage.gm, captured, boundary, cp.size > 1)
        returns_loss[s] = bool(stage.returns_loss)
    keep = {w.origin for per in wanted.values() for w in per.values()}

    weights = _reference_weights(pm)
    # one process's parts: the loss terms' shares of the whole batch, with the stages' counts
    scale = LossScale(m, pm.plan.dp, totals=pm.loss_scale.totals)
    # the reference computes in fp32 with the fp32 weights: under mixed precision the inputs
    # the program reads in bf16 (ParallelModel._prepare) are read as the fp32 they came as
    n_in = len(captured.input_names)
    batch = [t.float() if pm.training.mixed_precision and k < n_in
             and isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t
             for k, t in enumerate(first)]
    draws = TPGroup(rng=DropoutRNG(pm.tp_group.rng.seed))  # the first micro-batch's state
    draws.rng.step = pm.steps
    draws.rng.set_rows(*pm._rows)
    reference, ref_loss = _run_reference(captured, weights, batch, keep,
                                         any(returns_loss.values()), pm.device, scale, draws)

    def record(row: int, value: torch.Tensor, ref: torch.Tensor) -> None:
        a, r = value.detach().double(), ref.detach().double()
        diff = float((a - r).abs().max()) if a.numel() else 0.0
        scale = float(r.abs().max()) if r.numel() else 0.0
        rel = diff / (scale + _FLOOR)
        if math.isnan(diff):
            diff = rel = float("inf")
        stats[row, 0] = max(float(stats[row, 0]), diff)
        stats[row, 1] = max(float(stats[row, 1]), rel)
        counts[row] += 1

    tp_rank, tp = pm.mesh.tp_rank, pm.plan.tp
    restore = {}
    recorders: list[_Recorder] = []
    for s, module in pm.executor.stage_modules.items():
        gm = object.__getattribute__(module, "_graph")
        restore[s] = gm
        recorder = _Recorder(gm, wanted[s], returns_loss[s], reference, ref_loss, record,
                             layer_index, n_layers, tp, tp_rank, cp)
        recorders.append(recorder)
        object.__setattr__(module, "_graph", recorder)
    try:
        pm.eval_step(inputs, targets, local=local)
    finally:
        for s, module in pm.executor.stage_modules.items():
            object.__setattr__(module, "_graph", restore[s])
    # each cp rank's loss is its tokens' share (x cp): their mean is the whole sequence's; the
    # ranks of a cp group hold the same stages, so all of them reach this all-reduce or none
    for recorder in recorders:
        if recorder.loss_part is not None:
            from autopar.runtime.comm import collective

            part = recorder.loss_part.detach().double().clone()
            collective(dist.all_reduce, part, group=cp.group,
                       what="the all-reduce of verify's context-parallel loss")
            record(n_layers, part / cp.size, ref_loss)

    if dist.is_initialized() and dist.get_world_size() > 1:
        from autopar.runtime.comm import collective

        device_stats, device_counts = stats.to(pm.device), counts.to(pm.device)
        collective(dist.all_reduce, device_stats, op=dist.ReduceOp.MAX,
                   what="the all-reduce of verify's per-layer differences")
        collective(dist.all_reduce, device_counts,
                   what="the all-reduce of verify's per-layer counts")
        stats, counts = device_stats.cpu(), device_counts.cpu()
    names = [layer.name for layer in captured.layers] + ["loss"]
    checks = tuple(LayerCheck(name, None if stats[i, 0] < 0 else float(stats[i, 0]),
                              None if stats[i, 1] < 0 else float(stats[i, 1]), int(counts[i]))
                   for i, name in enumerate(names))
    report = VerificationReport(checks, float(tolerance), int(micro_batch_size))
    if raise_on_failure and not report.ok:
        bad = report.first_failure
        raise VerificationError(
            f"layer {bad.layer} of the parallel program differs from the original model: max "
            f"relative difference {bad.max_rel:.3g} (max absolute {bad.max_abs:.3g})",
            expected=f"every layer within {tolerance:g} relative (one micro-batch, "
                     f"dropout off)",
            found="\n" + "\n".join(report.lines()),
            fix="the fault is in that layer's part of the program: read pm.generated_code() and "
                "its collectives, and report it with the plan (pm.plan.dumps())",
            report=report)
    return report


# ---------------------------------------------------------------------------------------------
# Which tensors to compare
# ---------------------------------------------------------------------------------------------

def _boundary_nodes(captured: Any) -> dict[str, str]:
    """Captured float tensors made in one layer and read in a later one (or returned): node
    name -> layer name."""
    out: dict[str, str] = {}
    for n in captured.gm.graph.nodes:
        if n.op != "call_function" or not isinstance(info(n).value, TensorSpec):
            continue
        if not info(n).value.is_float:
            continue
        layer = info(n).layer
        if any(u.op == "output" or (META_KEY in u.meta and info(u).layer != layer)
               for u in n.users):
            out[n.name] = layer
    return out


def _origin(n: torch.fx.Node) -> torch.fx.Node | None:
    """The op node a collective step converts (through chains of steps); None: received."""
    while META_KEY in n.meta and info(n).collective is not None:
        if len(n.args) < 2 or not isinstance(n.args[1], torch.fx.Node):
            return None
        n = n.args[1]
    return n if n.op == "call_function" else None


class _Wanted(NamedTuple):
    """A boundary tensor a stage holds: the captured node it is, its tp placement, its layer,
    and the dims that hold the sequence's tokens (cut over the cp ranks; () without cp)."""

    origin: str
    placement: Any
    layer: str
    token_dims: tuple[int, ...]


def _comparable(gm: torch.fx.GraphModule, captured: Any, boundary: Mapping[str, str],
                context_parallel: bool = False) -> dict[str, _Wanted]:
    """Stage node name -> what it is, for the boundary tensors it holds in a placement that can
    be compared locally (one stage node per captured tensor). Under context parallelism a
    tensor whose tokens are folded into another dim (``b*s``) is left out: which of its rows a
    rank holds depends on the fold."""
    from autopar.sharding import Replicate, is_sharded

    cap = captured._nodes_by_name()
    out: dict[str, tuple[str, Any, str]] = {}
    taken: set[str] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or META_KEY not in n.meta:
            continue
        src = _origin(n)
        if src is None or src.name not in boundary or src.name in taken:
            continue
        placement = info(n).placement
        if not (isinstance(placement, Replicate) or is_sharded(placement)):
            continue  # pending sums (Partial) are compared after their reduction
        if info(n).value != info(cap[src.name]).value:
            continue  # a name shared by accident: not the same tensor
        token_dims: tuple[int, ...] = ()
        if context_parallel:
            shape = info(cap[src.name]).spec.shape
            if any(SEQ in getattr(e, "free_symbols", ()) and e != SEQ for e in shape):
                continue
            token_dims = tuple(d for d, e in enumerate(shape) if e == SEQ)
        out[n.name] = _Wanted(src.name, placement, boundary[src.name], token_dims)
        taken.add(src.name)
    return out


# ---------------------------------------------------------------------------------------------
# The reference run and the recording run
# ---------------------------------------------------------------------------------------------

def _reference_weights(pm: Any) -> dict[str, torch.Tensor]:
    """The original model's tensors before any training step, else the parallel model's own
    (full) weights: the reference must compute with the weights the program holds."""
    model = pm.captured.model
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    if pm.steps > 0:
        tensors.update(pm.state_dict())  # collective: every rank has trained equally far
    return tensors


class _Enough(Exception):
    """Every tensor this rank compares is computed: the rest of the model is not needed."""


class _Reference(torch.fx.Interpreter):
    """The captured graph in evaluation (dropout off, batch norms by their running statistics,
    no buffer updated), keeping the named tensors (and stopping once they
    are all computed, unless the loss is wanted too)."""

    def __init__(self, gm: torch.fx.GraphModule, keep: set[str], need_loss: bool,
                 draws: Any = None) -> None:
        super().__init__(gm)
        self.keep = keep
        self.need_loss = need_loss
        #: A tensor-parallel communicator of one rank whose dropout state is the program's for
        #: this micro-batch: stochastic depth's draws (``tp.draw_random``), which the program
        #: makes in evaluation too, drawn alike.
        self.draws = draws
        #: The node running updates a buffer in place (BatchNorm's counter): on a copy here.
        self.writes_buffer = False
        self.kept: dict[str, torch.Tensor] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        if self.draws is not None and draws_per_sample(n):  # the program's own draws
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            out = self.draws.draw_random(*args, op=n.target.name(), site=n.name,
                                         batch_dim=batch_dim_of(info(n).spec), **kwargs)
        else:
            first = n.args[0] if n.op == "call_function" and n.args else None
            self.writes_buffer = isinstance(first, torch.fx.Node) and first.op == "placeholder" \
                and info(first).kind is NodeKind.BUFFER
            out = super().run_node(n)
        if n.name in self.keep:
            self.kept[n.name] = out.detach()
            if not self.need_loss and len(self.kept) == len(self.keep):
                raise _Enough
        return out

    def call_function(self, target: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        # evaluation, as the program's forward runs (eval_step): batch norms by their running
        # statistics, buffers updated in place (their counters) left alone: the op on a copy
        if target is aten.batch_norm.default and len(args) > 5:
            args = (args[0], *affine_as_statistics(args[1], args[2], args[3]), *args[3:5], False,
                    *args[6:])
        elif self.writes_buffer and isinstance(target, torch._ops.OpOverload) \
                and target._schema.is_mutable:
            args = (args[0].clone(), *args[1:])
        if target in (aten.dropout.default, aten.feature_dropout.default):
            return args[0]
        if target is aten.native_dropout.default:
            return args[0], torch.ones_like(args[0], dtype=torch.bool)
        if target is aten.scaled_dot_product_attention.default:
            args = list(args)
            if len(args) > 4:
                args[4] = 0.0
            kwargs = {**kwargs, "dropout_p": 0.0} if "dropout_p" in kwargs else kwargs
        return super().call_function(target, tuple(args), kwargs)


def _run_reference(captured: Any, weights: Mapping[str, torch.Tensor], batch: Sequence[Any],
                   keep: set[str], need_loss: bool, device: torch.device, scale: LossScale,
                   draws: Any = None) -> tuple[dict[str, torch.Tensor], Any]:
    """The reference run up to the last tensor this rank compares (the end: the loss, scaled
    by ``scale`` as the stages scale theirs: passes/loss_reduction.py)."""
    values = [weights[p.fqn] for p in captured.params.values()]
    values += [weights[b.fqn] for b in captured.buffers.values()]
    values += list(captured.constants.values())
    values = [v.detach().to(device) for v in values]
    gm = scaled_step(captured)
    if gm is not captured.gm:  # the loss as the stages scale it: this part's share of the batch
        batch = (*batch, scale)
    interp = _Reference(gm, keep, need_loss and captured.has_loss, draws)
    if not keep and not interp.need_loss:
        return {}, None
    try:
        with torch.no_grad():
            out = interp.run(*values, *batch)
    except _Enough:
        return interp.kept, None
    loss = out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out
    return interp.kept, loss if captured.has_loss else None


class _Recorder(torch.fx.Interpreter):
    """A stage graph run node by node; on its first call (the first micro-batch) every wanted
    tensor is compared with the reference as soon as it exists."""

    def __init__(self, gm: torch.fx.GraphModule, wanted: Mapping[str, _Wanted],
                 returns_loss: bool, reference: Mapping[str, torch.Tensor], ref_loss: Any,
                 record: Any, layer_index: Mapping[str, int], n_layers: int, tp: int,
                 tp_rank: int, cp: Any) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.gm = gm
        self.wanted = wanted
        self.returns_loss = returns_loss
        self.reference = reference
        self.ref_loss = ref_loss
        self.record = record
        self.layer_index = layer_index
        self.n_layers = n_layers
        self.tp, self.tp_rank = tp, tp_rank
        self.cp = cp
        #: Under context parallelism: this rank's share of the first micro-batch's loss, compared
        #: after the cp group's all-reduce.
        self.loss_part: torch.Tensor | None = None
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls > 1:
            return self.gm(*args)
        out = self.run(*args)
        if self.returns_loss and self.ref_loss is not None:
            loss = out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out
            if self.cp.size > 1:
                self.loss_part = loss
            else:
                self.record(self.n_layers, loss, self.ref_loss)
        return out

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.wanted:
            from autopar.sharding import shard_tensor

            want = self.wanted[n.name]
            local = self.reference[want.origin]
            for dim in want.token_dims:  # this rank's tokens of the whole sequence, which
                local = self.cp.split(local, dim)  # sequence parallelism cuts further
            if self.tp > 1:
                local = shard_tensor(local, want.placement, self.tp, self.tp_rank, want.origin)
            self.record(self.layer_index.get(want.layer, self.n_layers), out, local)
        return out

