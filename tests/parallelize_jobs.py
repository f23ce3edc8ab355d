"""Jobs for tests/test_parallelize.py: run on every rank of a LocalPool (importable by name),
and the single-process references they are compared with."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import time
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

import autopar
from conftest import build_own_gpt, build_tiny
from tp_helpers import TINY_COST

LR = 1e-3
#: LLaMA's published Adam epsilon; with torch's 1e-8, Adam magnifies reduction-order noise in
#: near-zero gradients past fp32 comparison tolerances (see tests/dp_harness.py).
EPS = 1e-5


def _vocab(name: str) -> int:
    """The vocabulary of a model name: ``<name>:<vocab>`` overrides the tiny models' 128."""
    return int((name.split(":") + [""])[1] or 128)


def _layers(name: str) -> dict[str, int]:
    """``<name>:<vocab>:<layers>`` overrides the tiny models' block count."""
    parts = name.split(":")
    return {"layers": int(parts[2])} if len(parts) > 2 and parts[2] else {}


def make_model(name: str, device: str = "cpu"):
    """``own_gpt``, a zoo family (``gpt``, ``llama``, ``bert``: fused attention), or a family
    with ``_eager`` appended (explicit softmax attention: what selective recompute recomputes),
    optionally with ``:<vocab>`` appended (another vocabulary size, e.g. ``gpt:101``, which
    every tp pads); on ``device`` ("meta": no weights allocated)."""
    name, vocab, layers = name.partition(":")[0], _vocab(name), _layers(name)
    if name == "own_gpt":
        with torch.device(device):
            model, loss_fn = build_own_gpt(vocab=vocab, **layers)
        return model, loss_fn
    family, _, attention = name.partition("_")
    zm = build_tiny(family, attention=attention or "sdpa", device=device, vocab=vocab, **layers)
    return zm.model, zm.loss_fn


#: This process's captures by (model name, device, mixed precision, example shapes): a rank
#: runs many plans of the same few tiny models, and torch.export was ~70% of each parallelize.
_CAPTURES: dict[tuple, Any] = {}


@contextlib.contextmanager
def shared_captures(name: str, device: str) -> Iterator[None]:
    """``parallelize`` inside reuses this process's capture of the same model (built by
    :func:`make_model` the same way, so the same graph), bound to the model it is given now: a
    capture is a value no phase mutates (autopar/captured.py), and a plan that wrote into one
    or read another model's weights through it would fail the comparison with one process."""
    import autopar.api as api

    original = api._capture

    def capture(model, example_inputs, loss_fn, example_targets, mixed_precision):
        shapes = tuple(tuple(t.shape) for t in (*example_inputs, *example_targets)
                       if isinstance(t, torch.Tensor))
        key = (name, device, bool(mixed_precision), shapes)
        hit = _CAPTURES.get(key)
        if hit is None:
            hit = _CAPTURES[key] = original(model, example_inputs, loss_fn, example_targets,
                                            mixed_precision)
            # the kept captures are long-lived: out of the collector's way (gc.freeze), so the
            # full collection each parallelize makes stays cheap (0.64 s each on a rank that
            # had kept five, 11 s of a 17-plan job)
            gc.collect()
            gc.freeze()
            return hit
        return dataclasses.replace(hit, model=model)

    api._capture = capture
    try:
        yield
    finally:
        api._capture = original


def recomputed_regions(pm) -> int:
    """Attention cores this rank's stages recompute in backward (selective recompute)."""
    from autopar.runtime.recompute import RecomputedRegion

    return sum(isinstance(m, RecomputedRegion) for s in pm.executor.stage_modules
               for m in pm.split.stages[s].gm.children())


def compiled_regions(pm) -> int:
    """Regions of this rank's stages compiled on their own (``layer_regions`` under compile)."""
    return sum(isinstance(m, torch._dynamo.eval_frame.OptimizedModule)
               for s in pm.executor.stage_modules.values() for m in s._graph.children())


def checkpointed_blocks(pm) -> int:
    """Blocks this rank's stages checkpoint one by one (full recompute)."""
    from autopar.runtime.layer_recompute import checkpointed

    return sum(n.target is checkpointed for m in pm.executor.stage_modules.values()
               for n in m._graph.graph.nodes)


@contextlib.contextmanager
def counting_checkpoint_runs() -> Iterator[list[int]]:
    """Inside: ``torch.utils.checkpoint.checkpoint`` counts the runs of its function (the
    forward and each recompute) in the list's one entry."""
    count = [0]
    checkpoint = torch.utils.checkpoint.checkpoint

    def counting(fn, *args, **kwargs):
        def run(*xs):
            count[0] += 1
            return fn(*xs)
        return checkpoint(run, *args, **kwargs)

    torch.utils.checkpoint.checkpoint = counting
    try:
        yield count
    finally:
        torch.utils.checkpoint.checkpoint = checkpoint


def batches(name: str, steps: int, batch: int = 8, seq: int = 16):
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, _vocab(name), (batch, seq + 1), generator=gen)
        out.append(((tokens[:, :-1].contiguous(),), (tokens[:, 1:].contiguous(),)))
    return out


def recipe(params):
    """The LLM recipe's optimizer as users write it: a function of the parameters that puts
    biases and norms (``ndim < 2``) in a group without weight decay. The default decay is 0.1,
    so a parameter that lost its group would move by ~lr x 0.1 x |w| per step (1e-4 on a norm's
    weights of 1): ten times the comparison tolerance."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                             lr=LR, eps=EPS, weight_decay=0.1)


def warmup(step: int) -> float:
    """An LR schedule (torch.optim.lr_scheduler.LambdaLR): a linear warm-up over 3 steps."""
    return (step + 1) / 3


def reference(name: str, steps: int = 3, max_grad_norm: float | None = None,
              use_recipe: bool = False):
    """Single-process fp32 run: losses, final parameters, the loss of the first batch after
    training (what eval_step must give) and, when clipping, the gradient norms before clipping
    (torch.nn.utils.clip_grad_norm_). ``use_recipe``: :func:`recipe`'s optimizer under the
    :func:`warmup` LR schedule."""
    torch.manual_seed(0)
    model, loss_fn = make_model(name)
    if use_recipe:
        opt = recipe(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, norms = [], []
    data = batches(name, steps)
    for inputs, targets in data:
        opt.zero_grad()
        loss = loss_fn(model(*inputs), *targets)
        loss.backward()
        if max_grad_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item())
        opt.step()
        if use_recipe:
            scheduler.step()
        losses.append(loss.item())
    with torch.no_grad():
        eval_loss = loss_fn(model(*data[0][0]), *data[0][1]).item()
    return dict(losses=losses, state={k: v.detach().clone() for k, v in model.state_dict().items()},
                eval_loss=eval_loss, norms=norms)


def reference_mixed(name: str, micro_batches: int, steps: int = 3):
    """Single-process mixed precision (tests/dp_harness.py's SingleProcess: bf16 compute copy,
    fp32 master weights updated by AdamW, micro-batch gradients accumulated in fp32), run on the
    same ``micro_batches`` micro-batches (dp x m) the parallel run computes one by one."""
    from dp_harness import SingleProcess
    from autopar.runtime.optim import OptimizerFactory

    model, loss_fn = make_model(name)
    run = SingleProcess(model, loss_fn, OptimizerFactory(torch.optim.AdamW, {"lr": LR, "eps": EPS}),
                        mp=True)
    init = {k: v.detach().clone().float() for k, v in run.parameters().items()}
    for inputs, targets in batches(name, steps):
        run.step(inputs[0], targets[0], micro_batches=micro_batches)
    return dict(losses=run.losses, state=run.parameters(), init=init)


def train(configs, steps: int = 3):
    """For each ``(model name, pins)`` or ``(model name, pins, options)``: parallelize, train
    ``steps`` steps and return losses, the full state dict (rank 0 only, to keep the results
    small), the per-rank memory and local parameter count.

    Options: ``recipe`` (the optimizer is :func:`recipe`, a plain function, stepped with the
    :func:`warmup` LR schedule on ``pm.optimizer``), ``mixed_precision``, ``max_grad_norm``,
    ``checkpoint`` (passed to parallelize; with
    ``checkpoint`` the model is built on the meta device); ``compile`` (a torch.compile backend:
    the result then counts the stages' regions compiled on their own, ``compiled_regions``); ``save_pretrained`` (a directory: after
    training, the first batch's eval loss and ``pm.save_pretrained`` there); ``local`` (feed each
    data-parallel rank only its share, ``pm.local_batch``); ``probe`` (after training: the
    first batch's loss through ``pm(...)`` and ``eval_step``, and every rank's
    ``generated_code`` compiled)."""
    out = []
    for config in configs:
        name, pins = config[0], config[1]
        options: Mapping[str, Any] = config[2] if len(config) > 2 else {}
        start = time.perf_counter()
        checkpoint = options.get("checkpoint")
        # with a checkpoint, built on meta: every weight comes from the checkpoint
        model, loss_fn = make_model(name, "meta" if checkpoint is not None else "cpu")
        data = batches(name, steps)
        with shared_captures(name, "meta" if checkpoint is not None else "cpu"):
            pm = autopar.parallelize(model, example_inputs=data[0][0],
                                     example_targets=data[0][1], loss_fn=loss_fn,
                                     plan=dict(pins), tp_cost=TINY_COST,
                                     optimizer=recipe if options.get("recipe") else
                                     functools.partial(torch.optim.AdamW, lr=LR, eps=EPS),
                                     mixed_precision=options.get("mixed_precision", False),
                                     max_grad_norm=options.get("max_grad_norm"),
                                     checkpoint=checkpoint,
                                     compile=options.get("compile", False))
        # what this rank allocated for its stages' tensors, against what its program says it holds
        held_bytes = (pm.program.held_bytes(),
                      sum(t.numel() * t.element_size() for t in
                          (*pm.executor.params.values(), *pm.executor.buffers.values())))
        scheduler = (torch.optim.lr_scheduler.LambdaLR(pm.optimizer, warmup)
                     if options.get("recipe") else None)
        losses = []
        for inputs, targets in data:
            # under recompute, the last step's checkpointed runs (blocks or attention cores)
            with (counting_checkpoint_runs() if pins.get("recompute") in ("full", "selective")
                  else contextlib.nullcontext([0])) as runs:
                if options.get("local"):
                    losses.append(pm.train_step([pm.local_batch(t) for t in inputs],
                                                [pm.local_batch(t) for t in targets],
                                                local=True))
                else:
                    losses.append(pm.train_step(inputs, targets))
            if scheduler is not None:
                scheduler.step()
        result: dict[str, Any] = dict(losses=losses)
        if options.get("probe"):
            inputs, targets = data[0]
            result["call_loss"] = pm(inputs, targets)
            result["eval_loss"] = pm.eval_step(inputs, targets)
            sources = [pm.generated_code(r) for r in range(pm.plan.world_size)]
            for r, source in enumerate(sources):
                compile(source, f"<autopar rank {r}>", "exec")
            result["code_lines"] = [len(s.splitlines()) for s in sources]
        if options.get("save_pretrained"):  # collective; rank 0 writes
            result["eval_loss"] = pm.eval_step(*data[0])
            pm.save_pretrained(options["save_pretrained"], max_shard_size="30KB")
        state = pm.state_dict()
        result.update(
            state=state if dist.get_rank() == 0 else None, memory=pm.memory_bytes(),
            # trained parameters this rank holds (its stages' tp shards; ZeRO-3 included)
            local_params=sum(slot.numel for b in pm.data_parallel.buckets if b.requires_grad
                             for slot in b.slots),
            coordinates=(pm.mesh.dp_rank, pm.mesh.pp_rank, pm.mesh.tp_rank),
            regions=recomputed_regions(pm), plan=pm.plan.to_json(),
            block_runs=(runs[0], checkpointed_blocks(pm)), peak_held=pm.executor.peak_held,
            shard_size=pm.data_parallel.groups.shard_size, held_bytes=held_bytes,
            compiled_regions=compiled_regions(pm),
            vocab=(pm.tp_program.vocab_padding.vocab, pm.tp_program.vocab_padding.padded),
            param_dtypes=sorted({str(p.dtype) for p in pm.executor.params.values()}))
        pm.close()
        result["seconds"] = time.perf_counter() - start
        out.append(result)
    return out


def _init_of(name: str):
    """The initializer a test passes: the project's own GPT's ``_init``; None (the model's own:
    transformers' ``init_weights``) for the transformers families."""
    if name == "own_gpt":
        from examples.gpt import GPT

        return GPT._init
    return None


def init_states(configs):
    """For each ``(model name, pins)``: seed 0, build on meta, parallelize with ``init=`` (no
    weights anywhere); rank 0's full state dict, and what each rank allocated against what its
    RankProgram says it holds."""
    out = []
    for name, pins in configs:
        torch.manual_seed(0)
        model, loss_fn = make_model(name, "meta")
        data = batches(name, 1)
        pm = autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                                 loss_fn=loss_fn, plan=dict(pins), tp_cost=TINY_COST,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=LR),
                                 init=_init_of(name))
        held = (pm.program.held_bytes(),
                sum(t.numel() * t.element_size() for t in
                    (*pm.executor.params.values(), *pm.executor.buffers.values())))
        state = pm.state_dict()
        out.append(dict(state=state if dist.get_rank() == 0 else None, held_bytes=held,
                        zero=pm.plan.zero, rng=torch.get_rng_state()))
        pm.close()
    return out


def reference_init(name: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One device: seed 0, build on meta, materialize, initialize. transformers models take
    transformers' own meta flow (``to_empty`` then ``init_weights``, which ties the LM head
    back); the own GPT is materialized with its tie kept and initialized by
    ``model.apply(GPT._init)``. Returns the state dict and the CPU random state after."""
    torch.manual_seed(0)
    model, _ = make_model(name, "meta")
    if name == "own_gpt":
        real: dict[int, torch.nn.Parameter] = {}
        for module in model.modules():
            for key, p in list(module._parameters.items()):
                if p is not None:
                    real.setdefault(id(p), torch.nn.Parameter(torch.empty_like(p, device="cpu")))
                    module._parameters[key] = real[id(p)]
        model.apply(_init_of(name))
    else:
        model.to_empty(device="cpu")
        model.init_weights()
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            torch.get_rng_state())


#: A model whose fp32 weights (~170 MB) are several times what one of 4 ranks holds under
#: tp 2 x pp 2 or pp 4 (~40-50 MB).
LARGE = dict(layers=12, hidden=512, heads=8, vocab=8192, seq=64)


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def load_large(checkpoint: str, pins: Mapping[str, Any]):
    """Build LARGE on meta and parallelize it from ``checkpoint``: this rank's held parameter
    bytes (its RankProgram's statement and what the executor allocated) and the growth of its
    peak resident memory across parallelize (the kernel's high-water mark, reset first)."""
    from autopar import models

    # the same path once on a tiny model first, so the modules it imports and their caches
    # are not counted as the large model's
    tiny = models.build("gpt", device="meta", dropout=0.0, layers=2, hidden=64, heads=4,
                        vocab=128, seq=LARGE["seq"])
    tokens = torch.randint(0, 128, (4, LARGE["seq"] + 1))
    autopar.parallelize(tiny.model, example_inputs=(tokens[:, :-1],),
                        example_targets=(tokens[:, 1:],), loss_fn=tiny.loss_fn, plan=dict(pins),
                        tp_cost=TINY_COST, optimizer=functools.partial(torch.optim.AdamW, lr=LR),
                        checkpoint=checkpoint + "-tiny").close()
    zm = models.build("gpt", device="meta", dropout=0.0, **LARGE)
    tokens = torch.randint(0, LARGE["vocab"], (4, LARGE["seq"] + 1))
    inputs, targets = (tokens[:, :-1],), (tokens[:, 1:],)
    with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark to now
        f.write("5")
    before = _rss_bytes()
    pm = autopar.parallelize(zm.model, example_inputs=inputs, example_targets=targets,
                             loss_fn=zm.loss_fn, plan=dict(pins), tp_cost=TINY_COST,
                             optimizer=functools.partial(torch.optim.AdamW, lr=LR),
                             checkpoint=checkpoint)
    growth = _peak_rss_bytes() - before
    params = sum(t.numel() * t.element_size() for t in pm.executor.params.values())
    largest = max(int(torch.tensor(p.full_shape).prod()) * 4 for p in pm.program.held)
    held = sum(int(torch.tensor(p.local_shape).prod()) * 4 for p in pm.program.held
               if p.fqn in pm.executor.params)
    memory = pm.memory_bytes()
    # the planner's weight memory for this plan (a pinned plan is not priced by parallelize)
    from autopar.planner.memory import model_state_bytes

    predicted = model_state_bytes(sum(p.numel() for p in zm.model.parameters()), pm.plan.dp,
                                  pm.plan.zero, "fp32").weights / pm.plan.pp / pm.plan.tp
    pm.close()
    return dict(growth=growth, params=params, held=held, memory=memory, largest=largest,
                predicted_weights=predicted,
                coordinates=(pm.mesh.dp_rank, pm.mesh.pp_rank, pm.mesh.tp_rank))


def zero_memory(blocks: int, pins: Mapping[str, Any], bucket_mb: float = 25.0,
                compile: str | bool = False) -> dict[str, Any]:
    """One ZeRO training step of the own GPT with ``blocks`` blocks, traced: the most parameter
    elements this rank held gathered at once (whole buckets, a prefetch in flight included) and
    the most full (unsharded) gradient elements, against its stages' parameters and its layers'.
    Sampled after every gather, prefetch, free, accumulation and reduction of every bucket; the
    loss is returned to compare with another run."""
    from autopar.ir import info

    with torch.device("cpu"):
        model, loss_fn = build_own_gpt(layers=blocks)
    data = batches("own_gpt", 1)
    pm = autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                             loss_fn=loss_fn, plan=dict(pins), tp_cost=TINY_COST,
                             optimizer=functools.partial(torch.optim.AdamW, lr=LR, eps=EPS),
                             bucket_mb=bucket_mb, compile=compile)
    buckets = pm.data_parallel.buckets
    peak = {"gathered": 0, "full_grads": 0}
    gathers = [0]

    def sample() -> None:
        gathered = sum(b.padded_numel for b in buckets if b.gathered or b.prefetching)
        full = sum(b.local_grad.numel() for b in buckets if b.local_grad is not None)
        peak["gathered"] = max(peak["gathered"], gathered)
        peak["full_grads"] = max(peak["full_grads"], full)

    for b in buckets:
        for method in ("gather", "start_gather", "free", "accumulate", "launch_reduce",
                       "wait_reduce"):
            def traced(*args, _f=getattr(b, method), _b=b, _m=method, **kwargs):
                if _m == "start_gather" and not (_b.gathered or _b.prefetching):
                    gathers[0] += 1  # an all-gather starts
                out = _f(*args, **kwargs)
                sample()
                return out
            setattr(b, method, traced)
    loss = pm.train_step(*data[0])
    layer_params: dict[str, int] = {}
    for s in pm.executor.stage_modules:
        gm = pm.split.stages[s].gm
        fqn_of = {ph.name: ph.key for ph in pm.split.stages[s].placeholders
                  if str(getattr(ph.kind, "value", ph.kind)) == "parameter"}
        for n in gm.graph.nodes:
            for a in n.all_input_nodes:
                if a.name in fqn_of and n.op != "output":
                    layer_params.setdefault(info(n).layer, set()).add(fqn_of[a.name])
    sizes = {fqn: p.numel() for fqn, p in model.named_parameters(remove_duplicate=False)}
    return dict(peak=peak["gathered"], full_grads=peak["full_grads"], loss=loss,
                gathers=gathers[0], compiled=compiled_regions(pm),
                units=len(pm.data_parallel.units), buckets=len(buckets),
                stage=sum(sizes[f] for f in {f for fs in layer_params.values() for f in fs}),
                layers={k: sum(sizes[f] for f in v) for k, v in layer_params.items()})


def whole_tensor_optimizer(name: str, plans: Sequence[Any], steps: int = 2):
    """Adafactor (its update reads a matrix's row and column statistics: not element-wise)
    under each plan: the largest parameter difference from one process's Adafactor after
    ``steps`` steps and the plan taken, or the error's class and text."""
    torch.manual_seed(0)
    model, loss_fn = make_model(name)
    ref = copy.deepcopy(model)
    opt = torch.optim.Adafactor(ref.parameters(), lr=1e-2)
    data = batches(name, steps)
    for inputs, targets in data:
        opt.zero_grad()
        loss_fn(ref(*inputs), *targets).backward()
        opt.step()
    want = ref.state_dict()
    out = []
    for plan in plans:
        try:
            pm = autopar.parallelize(copy.deepcopy(model), example_inputs=data[0][0],
                                     example_targets=data[0][1], loss_fn=loss_fn, plan=plan,
                                     tp_cost=TINY_COST,
                                     optimizer=functools.partial(torch.optim.Adafactor, lr=1e-2))
        except autopar.AutoparError as exc:
            out.append((type(exc).__name__, str(exc)))
            continue
        for inputs, targets in data:
            pm.train_step(inputs, targets)
        state = pm.state_dict()
        diff = max(((state[k] - v).abs().max().item(), k) for k, v in want.items()
                   if v.is_floating_point())
        out.append((pm.plan.to_json(), diff))
        pm.close()
    return out
