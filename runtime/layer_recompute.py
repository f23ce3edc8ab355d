"""Full activation recompute one layer at a time inside a stage graph.

Megatron-LM's full recompute (``--recompute-granularity full --recompute-num-layers 1``) keeps
each transformer block's input and re-runs one block's forward inside that block's backward, so
a rank holds its blocks' inputs plus one block's activations. Checkpointing a whole stage call
instead (``torch.utils.checkpoint`` around the stage) keeps one input per stage but
re-materializes every layer of the stage at once in its backward: with one stage of 26 layers
its peak equals no recompute's (measured on an H200, ``benchmarks/gpu_memory.py``).

:func:`recompute_per_layer` rewrites a stage graph so that each run of consecutive nodes of one
repeated block (``meta["autopar"].layer``) becomes a submodule (``torch.fx.passes.split_module``)
called through :func:`checkpointed`, which checkpoints it (non-reentrant) while the executor is
in a training forward with recompute (:func:`recompute_region`) and calls it plainly otherwise
(inference, the plain runtime). The layers before and after the blocks (embeddings, the head and
the loss) run as they are, as the cost model prices them. A recomputed block first calls the
executor's announcement of its micro-batch (the stage's ``before_forward`` hook), so the block's
dropout masks are its micro-batch's also when the backward that re-runs it comes after other
micro-batches' forwards.

torch's checkpoint saves and restores the global RNG state of every CUDA tensor argument
(``preserve_rng_state``: for a block, its activations and each of its weights, ~26 per GPT-2
block) so that a recomputed dropout draws the same mask. autopar's dropouts do not draw from the
global RNG: the generated program draws every mask from a generator seeded by (step, site,
sample) (runtime/rng.py), which replays itself. A block with no other random op is therefore
checkpointed with ``preserve_rng_state=False``; one that still calls a random aten op keeps it.
The per-tensor metadata check (``determinism_check``) is off too: the block is a captured graph
of static shapes, recomputed with the same inputs. On an H100 these per-tensor Python calls made
a fully recomputed GPT-2 medium step host-bound (benchmarks/README.md).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from autopar.ir import has_info, info, op_name
from autopar.runtime.rng import TORCH_RANDOM_OPS
from autopar.runtime.running_stats import eager_in_compiled_code, replaying

__all__ = ["recompute_per_layer", "layer_regions", "checkpointed", "recompute_region"]

#: While a training forward with recompute runs: the call that re-announces its micro-batch.
_REGION: contextvars.ContextVar[tuple[Callable[[], None] | None] | None] = \
    contextvars.ContextVar("autopar_layer_recompute", default=None)


@contextlib.contextmanager
def recompute_region(announce: Callable[[], None] | None) -> Iterator[None]:
    """Checkpoint the block calls of the stage graphs run inside (``announce``: called first
    by each block, in its forward and in its recompute)."""
    token = _REGION.set((announce,))
    try:
        yield
    finally:
        _REGION.reset(token)


def checkpointed(block: Callable[..., Any], global_rng: bool, *args: Any) -> Any:
    """``block(*args)``, checkpointed inside :func:`recompute_region`; ``global_rng``: the block
    draws from torch's global RNG, whose state the recompute must restore."""
    region = _REGION.get()
    if region is None or not torch.is_grad_enabled():
        return block(*args)
    announce = region[0]

    # the graph's forward itself: torch's early stop ends a recompute by raising through it,
    # and a GraphModule's __call__ extracts the traceback of every exception it passes on (a
    # compiled region is called as it is: its forward is the uncompiled one)
    forward = block if isinstance(block, torch._dynamo.eval_frame.OptimizedModule) else \
        getattr(block, "forward", block)

    def run(*inputs: Any) -> Any:
        if announce is not None:
            announce()
        return forward(*inputs)

    return torch.utils.checkpoint.checkpoint(replaying(run), *args, use_reentrant=False,
                                             preserve_rng_state=global_rng,
                                             determinism_check="default" if global_rng
                                             else "none")


def draws_global_rng(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` calls a random op of torch (:data:`~autopar.runtime.rng.TORCH_RANDOM_OPS`)
    rather than autopar's plan-independent dropout (``autopar.runtime``), which seeds its own."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        module = getattr(node.target, "__module__", "") or ""
        name = op_name(node)
        if name not in TORCH_RANDOM_OPS or module.startswith("autopar.runtime"):
            continue
        if name in _DROPOUTS:  # (input, p, train): p = 0 or train = False draws nothing
            p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
            train = node.args[2] if len(node.args) > 2 else node.kwargs.get(
                "train", node.kwargs.get("training", True))  # aten's name, F.dropout's
            if (isinstance(p, (int, float)) and p == 0) or train is False:
                continue
        return True
    return False


_DROPOUTS = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout"})


def recompute_per_layer(gm: torch.fx.GraphModule, blocks: frozenset[str]
                        ) -> tuple[torch.fx.GraphModule, int]:
    """``gm`` with each run of consecutive nodes of a layer in ``blocks`` called through
    :func:`checkpointed`, and the number of such runs (0: ``gm`` itself, unchanged)."""
    return layer_regions(gm, checkpoint=blocks)


def layer_regions(gm: torch.fx.GraphModule, *, checkpoint: frozenset[str] = frozenset(),
                  compile_backend: str | None = None) -> tuple[torch.fx.GraphModule, int]:
    """``gm`` with each run of consecutive nodes of one captured layer made a submodule
    (``split_module``), and the number of runs checkpointed (0 with nothing to change: ``gm``
    itself).

    - A run of a layer in ``checkpoint`` is called through :func:`checkpointed`.
    - With ``compile_backend``, every layer's run goes through ``torch.compile`` on its own
      (regional compilation, as torchtitan compiles each transformer block): what lies between
      the runs, ZeRO-3's gather and free calls (``runtime/layer_units.py``), runs eagerly
      outside the compiled code, and a checkpointed run recomputes its compiled forward. Runs
      of equal blocks are equal graphs (weights are inputs), which the compiler's caches share.
    """
    part: dict[str, int] = {}
    wrapped: dict[int, bool] = {}  # run -> checkpointed
    run, previous = -1, object()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        layer = info(node).layer if has_info(node) else ""
        label = layer if layer in checkpoint or (compile_backend is not None and layer) \
            else None
        if label != previous:
            run, previous = run + 1, label
            if label is not None:
                wrapped[run] = label in checkpoint
        part[node.name] = run
    if not wrapped:
        return gm, 0
    split = split_module(gm, gm, lambda n: part[n.name], keep_original_order=True)
    graph = split.graph
    for node in list(graph.nodes):
        if node.op != "call_module" or not node.target.startswith("submod_"):
            continue
        index = int(node.target.rsplit("_", 1)[1])
        if index not in wrapped:
            continue
        region = getattr(split, node.target)
        if compile_backend is not None:
            setattr(split, node.target, torch.compile(eager_in_compiled_code(region),
                                                      backend=compile_backend, dynamic=False))
        if not wrapped[index]:
            continue
        global_rng = draws_global_rng(region)
        with graph.inserting_before(node):
            block = graph.get_attr(node.target)
            call = graph.call_function(checkpointed, (block, global_rng, *node.args),
                                       dict(node.kwargs))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    graph.lint()
    split.recompile()
    return split, sum(wrapped.values())
