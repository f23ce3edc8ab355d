"""Tensor parallelism for a captured model: search, collectives, per-rank code, state dicts.

``tensor_parallelize(captured, tp, sequence_parallel=False, cost=...)`` runs

    split_gemm_bias -> shard_graph (the ILP, passes/shard.py) -> insert_collectives

on a copy of the captured graph and returns a :class:`TPProgram`: the per-rank fx graph (every
collective a node that keeps its layer), readable per-rank source, the slicing of the full
model's tensors into shards and back, each GEMM's sharding and the communication per layer.
The design and its limits are in docs/tensor-parallel.md.
"""

from __future__ import annotations

import enum
import linecache
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import sympy
import torch
import torch.fx
import torch.nn as nn

from autopar.errors import InvalidInputError, ShardingError
from autopar.frontend import CapturedGraph
from autopar.ir import META_KEY, SEQ, NodeKind, copy_graph_module, info, op_name
from autopar.plan_types import GemmSharding, Plan
from autopar.sharding import (
    Collective,
    placement_str,
    shard_tensor,
    unshard_tensors,
)

__all__ = ["tensor_parallelize", "TPProgram", "CollectiveCall", "LayerComm", "Direction",
           "TPCostSpec"]

from autopar.passes.shard import TPCostSpec  # noqa: E402  (re-exported vocabulary)
from autopar.passes.index_checks import reads_model_input  # noqa: E402

if TYPE_CHECKING:
    from autopar.passes.pad_vocab import VocabPadding


class Direction(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True, slots=True)
class CollectiveCall:
    """One collective of one step: where, which, which direction, and the tensor it moves."""

    layer: str
    node: str
    collective: Collective
    direction: Direction
    #: Bytes of the full (unsharded) tensor the collective is about, sympy in b and s.
    message_bytes: Any
    note: str = ""

    def __post_init__(self) -> None:
        if not self.collective.communicates:
            raise ValueError(f"{self.collective} is local, not a collective")

    def ring_bytes(self, tp: int) -> Any:
        """Bytes each rank sends (ring algorithms)."""
        return self.message_bytes * sympy.Rational(self.collective.ring_factor(tp)).limit_denominator(4096)


@dataclass(frozen=True, slots=True)
class LayerComm:
    """The collectives one layer performs per micro-batch."""

    layer: str
    calls: tuple[CollectiveCall, ...]

    def select(self, collective: Collective | None = None,
               direction: Direction | None = None) -> list[CollectiveCall]:
        return [c for c in self.calls if (collective is None or c.collective is collective)
                and (direction is None or c.direction is direction)]

    def count(self, collective: Collective | None = None, direction: Direction | None = None) -> int:
        return len(self.select(collective, direction))

    def message_bytes(self, collective: Collective | None = None,
                      direction: Direction | None = None) -> Any:
        return sympy.Add(*[c.message_bytes for c in self.select(collective, direction)])

    def ring_bytes(self, tp: int, collective: Collective | None = None,
                   direction: Direction | None = None) -> Any:
        return sympy.Add(*[c.ring_bytes(tp) for c in self.select(collective, direction)])


def _check_divisible(captured: CapturedGraph, tp: int, sizes: Mapping[str, int],
                     sequence_parallel: bool, strict: bool, unpadded: str | None = None) -> None:
    """Attention heads and vocabulary must split evenly (unless strict=False: replicated)."""
    problems: list[str] = []
    for n in captured.gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = op_name(n)
        if name == "scaled_dot_product_attention":
            heads = info(n.args[0]).spec.shape[1] if info(n.args[0]).spec.ndim == 4 else None
            if heads is not None and heads.is_Integer and int(heads) % tp:
                problems.append(f"attention {n.name} has {heads} heads")
        elif name == "cross_entropy_loss":
            classes = info(n.args[0]).spec.shape[-1]
            if classes.is_Integer and int(classes) % tp:
                problems.append(f"the loss {n.name} has {classes} classes")
        elif name == "embedding" and reads_model_input(n.args[1]):
            rows = info(n.args[0]).spec.shape[0]
            if rows.is_Integer and int(rows) % tp:
                problems.append(f"embedding {n.name} has {rows} rows (vocabulary)")
    if problems and strict:
        raise ShardingError(
            f"tp={tp} does not divide the model",
            expected=f"attention heads and vocabulary divisible by {tp}",
            found="; ".join(sorted(set(problems)))
            + (f" (the vocabulary cannot be padded: {unpadded})" if unpadded else ""),
            fix="choose a tp that divides them, pad the vocabulary to a multiple of tp (e.g. "
                "GPT-2's 50257 -> 50304), or pass strict=False (CLI: --no-strict) to run those "
                "parts replicated")
    if sequence_parallel and sizes.get("s", 0) % tp:
        none = sizes.get("s") == 1 and SEQ not in captured.example_sizes
        raise ShardingError("sequence parallelism splits the sequence over the tp ranks",
                            expected=f"a sequence length divisible by tp={tp}",
                            found=f"s={sizes.get('s')}" + (" (the inputs hold no sequence: "
                                                            "images)" if none else ""),
                            fix="plan with sequence_parallel=False" if none else
                                "change the sequence length or tp")


def tensor_parallelize(captured: CapturedGraph, tp: int, *, sequence_parallel: bool = False,
                       cost: TPCostSpec | None = None, sizes: Mapping[str, int] | None = None,
                       pins: Mapping[str, GemmSharding | str] | None = None,
                       strict: bool = True, depth: int | None = None,
                       warn_unruled: bool = True,
                       vocab_multiple: int | None = None) -> "TPProgram":
    """Shard ``captured`` over ``tp`` ranks.

    Args:
        captured: from :func:`autopar.capture` (not modified).
        tp: tensor-parallel size (1 gives the replicated program).
        sequence_parallel: shard the norm / dropout regions along the sequence (Megatron SP).
        cost: hardware numbers for the search (default: an A100 NVLink node).
        sizes: batch and sequence length the costs are evaluated at (default: the example's).
        pins: GEMM node name -> column / row / replicate, to override the search.
        strict: raise when heads or vocabulary do not divide by tp (False: run them replicated).
        depth: the real model's number of blocks when ``captured`` is a shallower copy (the
            planner captures two): the search weighs the blocks as the real model has them.
        warn_unruled: warn (``UnsupportedOpWarning``) about ops without a sharding rule (the
            planner lists them in its layout instead).
        vocab_multiple: pad the vocabulary to a multiple of ``vocab_multiple * tp`` first
            (``autopar.passes.pad_vocab``; Megatron-LM pads to 128 * tp; 0 pads only where tp
            does not divide it); None leaves it as it is.
    """
    from autopar.passes.analyze import analyze
    from autopar.passes.infra import PassContext, PassManager
    from autopar.passes.shard import shard_graph, split_gemm_bias
    from autopar.passes.tp_transform import insert_collectives

    if not isinstance(captured, CapturedGraph):
        raise InvalidInputError("tensor_parallelize takes a CapturedGraph",
                                expected="the result of autopar.capture(model, ...)",
                                found=type(captured).__name__)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise InvalidInputError("tp must be a positive integer", found=repr(tp))
    if sequence_parallel and tp == 1:
        raise InvalidInputError("sequence parallelism needs tp > 1", found="tp=1",
                                fix="drop sequence_parallel or raise tp")
    sizes = dict(sizes or captured.example_size_kwargs())
    padding = None
    if vocab_multiple is not None:
        from autopar.passes.pad_vocab import pad_vocabulary

        padding = pad_vocabulary(captured, vocab_multiple, tp)
        captured = padding.captured
    _check_divisible(captured, tp, sizes, sequence_parallel, strict,
                     padding.skipped if padding is not None else None)
    analyze(captured)
    gm, _ = copy_graph_module(captured.gm)
    ctx = PassContext(captured=captured,
                      options={"tp": tp, "sequence_parallel": sequence_parallel,
                               "cost": cost or TPCostSpec(), "sizes": sizes,
                               "pins": {k: GemmSharding(v) for k, v in (pins or {}).items()},
                               "depth": depth, "warn_unruled": warn_unruled})
    # split_gemm_bias and shard_graph annotate the copy in place; insert_collectives returns a
    # new per-rank graph, so the copy stays the global sharded graph
    local = PassManager([split_gemm_bias, shard_graph, insert_collectives]).run(gm, ctx)
    sharded = gm
    return TPProgram(captured=captured, tp=tp, sequence_parallel=sequence_parallel,
                     sharded=sharded, gm=local, solution=ctx.results["shard_graph"],
                     cost=ctx.options["cost"], sizes=sizes, timings=dict(ctx.timings),
                     vocab_padding=padding)


class TPProgram:
    """The tensor-parallel program for one model and one tp size (all ranks)."""

    def __init__(self, *, captured: CapturedGraph, tp: int, sequence_parallel: bool,
                 sharded: torch.fx.GraphModule, gm: torch.fx.GraphModule, solution: Any,
                 cost: TPCostSpec, sizes: Mapping[str, int], timings: Mapping[str, float],
                 vocab_padding: "VocabPadding | None" = None) -> None:
        from autopar.passes.tp_codegen import param_layouts

        self.captured = captured
        self.tp = tp
        self.sequence_parallel = sequence_parallel
        #: The global graph with each node's strategy and placement (biases split off).
        self.sharded = sharded
        #: The per-rank graph: placeholders (tp, parameters..., inputs...), collectives as
        #: call_function nodes on TPGroup methods; node.meta["autopar"].layer kept.
        self.gm = gm
        self.solution = solution
        self.cost = cost
        self.sizes = dict(sizes)
        self.timings = dict(timings)
        #: What padding the vocabulary did (None: not asked for).
        self.vocab_padding = vocab_padding
        self.layouts = param_layouts(
            gm, vocab_padding.logical_shapes if vocab_padding is not None else None)
        self._aliases = {p.fqn: p.aliases for p in captured.params.values()}
        self._sources: dict[int, str] = {}

    # -- what was decided ---------------------------------------------------------------------
    @property
    def gemm_sharding(self) -> dict[str, GemmSharding]:
        """Each GEMM of the captured graph (by node name) and how it is split."""
        return self.solution.gemm_sharding(self.sharded.graph)

    @property
    def placements(self) -> dict[str, Any]:
        """Output placement of every tensor node of the (bias-split) global graph."""
        return {n.name: info(n).placement for n in self.sharded.graph.nodes
                if info(n).placement is not None}

    @property
    def parameter_placements(self) -> dict[str, Any]:
        return {p.fqn: p.placement for p in self.layouts}

    def plan(self, base: Plan | None = None) -> Plan:
        """A Plan carrying this program's tp, sequence parallelism and GEMM shardings."""
        return (base or Plan()).replace(tp=self.tp, sequence_parallel=self.sequence_parallel,
                                        gemm_sharding=self.gemm_sharding)

    @property
    def layer_comm(self) -> tuple[LayerComm, ...]:
        """Collectives per layer and micro-batch, forward and backward, in layer order."""
        calls: dict[str, list[CollectiveCall]] = {layer.name: [] for layer in self.captured.layers}
        for n in self.gm.graph.nodes:
            if n.op != "call_function" or META_KEY not in n.meta:
                continue
            meta = info(n)
            step = meta.collective
            if step is not None:
                nbytes = meta.spec.nbytes
                for kind, direction in ((step.forward, Direction.FORWARD),
                                        (step.backward, Direction.BACKWARD)):
                    if kind.communicates:
                        calls.setdefault(meta.layer, []).append(
                            CollectiveCall(meta.layer, n.name, kind, direction, nbytes, step.note))
            strategy = meta.strategy
            if strategy is not None and getattr(strategy, "internal", ()):
                for kind, elems in strategy.internal:
                    calls.setdefault(meta.layer, []).append(
                        CollectiveCall(meta.layer, n.name, kind, Direction.FORWARD,
                                       sympy.sympify(elems) * 4, f"inside {strategy.name} {op_name(n)}"))
        return tuple(LayerComm(name, tuple(cs)) for name, cs in calls.items())

    def summary(self, *, timing: bool = False) -> list[str]:
        """A few lines for reports and the generated source's docstring (which stays
        deterministic: no timings unless asked)."""
        sp = "on" if self.sequence_parallel else "off"
        solved = f", solved in {self.solution.solve_s:.2f} s" if timing else ""
        lines = [f"Sequence parallel: {sp}. Sharding search: {self.solution.num_variables} ILP "
                 f"variables{solved}, costs at "
                 + ", ".join(f"{k}={v}" for k, v in sorted(self.sizes.items())) + "."]
        gemms: dict[str, int] = {}
        for kind in self.gemm_sharding.values():
            gemms[kind.value] = gemms.get(kind.value, 0) + 1
        lines.append("GEMMs: " + ", ".join(f"{v} {k}" for k, v in sorted(gemms.items())) + ".")
        lines.append("Collectives per micro-batch:")
        for lc in self.layer_comm:
            fwd = lc.select(direction=Direction.FORWARD)
            bwd = lc.select(direction=Direction.BACKWARD)
            if not fwd and not bwd:
                continue

            def names(cs):
                counts: dict[str, int] = {}
                for c in cs:
                    counts[c.collective.value] = counts.get(c.collective.value, 0) + 1
                return ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none"

            lines.append(f"  {lc.layer}: forward {names(fwd)}; backward {names(bwd)}")
        return lines

    # -- code -----------------------------------------------------------------------------------
    def source(self, rank: int) -> str:
        """Python source of rank ``rank``'s module (deterministic)."""
        from autopar.passes.tp_codegen import emit_rank_source

        if not isinstance(rank, int) or not 0 <= rank < self.tp:
            raise InvalidInputError(f"rank must be in [0, {self.tp})", found=repr(rank))
        if rank not in self._sources:
            model = type(self.captured.model).__name__ if self.captured.model is not None else "model"
            self._sources[rank] = emit_rank_source(
                self.gm, tp=self.tp, rank=rank, title=f"{model}", summary=self.summary())
        return self._sources[rank]

    def module_class(self, rank: int) -> type:
        """The class the source defines (compiled from the source text itself)."""
        source = self.source(rank)
        filename = f"<autopar tp rank {rank} of {self.tp}: {id(self):x}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace: dict[str, Any] = {"__name__": f"autopar_tp_rank{rank}"}
        exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated code
        return namespace[f"TensorParallelRank{rank}"]

    def module(self, rank: int, tp_group: Any = None, *, device: Any = None,
               full: Mapping[str, torch.Tensor] | nn.Module | None = None) -> nn.Module:
        """Rank ``rank``'s module on ``tp_group`` (a TPGroup, a ParallelMesh or a process
        group), with its shards sliced out of ``full`` (a model or its tensors) if given."""
        from autopar.runtime.tp import TPGroup

        if not isinstance(tp_group, TPGroup):
            tp_group = TPGroup.from_mesh(tp_group) if hasattr(tp_group, "tp_group") else TPGroup(tp_group)
        mod = self.module_class(rank)(tp_group, device=device)
        if full is not None:
            mod.load_state_dict(self.shard_state_dict(full, rank))
        return mod

    def write(self, out_dir: str | os.PathLike, ranks: Iterable[int] | None = None) -> list[Path]:
        """Write ``rank{r}.py`` for each rank (all by default); returns the paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for r in (range(self.tp) if ranks is None else ranks):
            path = out / f"rank{r}.py"
            path.write_text(self.source(r))
            paths.append(path)
        return paths

    # -- state dicts ----------------------------------------------------------------------------
    def full_tensors(self, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """Parameters, buffers (persistent or not) and lifted constants of the full model."""
        model = model if model is not None else self.captured.model
        if model is None:
            raise InvalidInputError("no model to read tensors from", fix="pass the model")
        out = dict(model.named_parameters(remove_duplicate=False))
        out.update(model.named_buffers(remove_duplicate=False))
        for n in self.captured.gm.graph.nodes:
            if n.op == "placeholder" and info(n).kind is NodeKind.CONSTANT:
                out[info(n).fqn or n.name] = self.captured.constants[n.name]
        return out

    def shard_state_dict(self, full: Mapping[str, torch.Tensor] | nn.Module, rank: int) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s module state dict (attribute -> shard) from the full model's
        tensors by FQN (a model's state dict, or the model itself)."""
        if isinstance(full, nn.Module):
            full = self.full_tensors(full)
        if not 0 <= rank < self.tp:
            raise InvalidInputError(f"rank must be in [0, {self.tp})", found=repr(rank))
        out = {}
        for p in self.layouts:
            names = (p.fqn,) + tuple(self._aliases.get(p.fqn, ()))
            tensor = next((full[k] for k in names if k in full), None)
            if tensor is None and p.kind is NodeKind.CONSTANT:  # e.g. the vocabulary's mask
                tensor = self.captured.constants.get(p.placeholder)
            if tensor is None:
                raise InvalidInputError(f"the full state dict has no {p.fqn!r}",
                                        expected=f"every parameter and buffer of the model ({len(self.layouts)})",
                                        fix="pass the model itself (non-persistent buffers are "
                                            "not in its state_dict)")
            if tuple(tensor.shape) not in (p.model_shape, p.full_shape):
                raise InvalidInputError(f"{p.fqn} has the wrong shape",
                                        expected=str(p.model_shape), found=str(tuple(tensor.shape)))
            out[p.attribute] = shard_tensor(p.to_program(tensor.detach()), p.placement, self.tp,
                                            rank, p.fqn)
        return out

    def gather_state_dict(self, local: Sequence[Mapping[str, torch.Tensor]],
                          *, check_replicas: bool = False, atol: float = 0.0) -> dict[str, torch.Tensor]:
        """The full model's tensors by FQN (tied names included) from every rank's state dict
        (or gradients, keyed the same way; keys absent on every rank are skipped), in rank
        order. ``check_replicas`` verifies that replicated tensors agree across ranks."""
        if len(local) != self.tp:
            raise InvalidInputError("gather_state_dict needs one state dict per rank",
                                    expected=f"{self.tp}", found=f"{len(local)}")
        out = {}
        for p in self.layouts:
            present = [p.attribute in sd for sd in local]
            if not any(present):  # e.g. buffers in a dict of gradients
                continue
            if not all(present):
                raise InvalidInputError(f"{p.attribute} ({p.fqn}) is missing on rank(s) "
                                        f"{[r for r, ok in enumerate(present) if not ok]}",
                                        expected="the same keys from every rank")
            pieces = [sd[p.attribute] for sd in local]
            if check_replicas and placement_str(p.placement) == "R":
                for r, t in enumerate(pieces[1:], 1):
                    if not torch.allclose(t, pieces[0], atol=atol, rtol=0):
                        raise ShardingError(f"replicated {p.fqn} differs between ranks 0 and {r}",
                                            found=f"max difference {(t - pieces[0]).abs().max().item():.3g}")
            full = p.to_model(unshard_tensors(pieces, p.placement))
            for name in (p.fqn,) + tuple(self._aliases.get(p.fqn, ())):
                out[name] = full
        return out

    def __repr__(self) -> str:
        sp = ", sequence_parallel" if self.sequence_parallel else ""
        return f"TPProgram(tp={self.tp}{sp}, {len(self.gemm_sharding)} GEMMs, {len(self.layouts)} tensors)"
