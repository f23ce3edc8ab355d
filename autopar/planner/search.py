"""Joint plan search: the fastest plan that fits, its prediction, and the next best.

The space (every axis can be pinned):

- mesh: ``dp x tp x pp = N``, ``tp`` dividing the devices per node (tensor parallel stays on
  NVLink), ``pp * v <= layers``;
- micro-batch size ``b`` dividing ``B / dp`` (so ``m = B / (dp b)`` micro-batches), up to
  ``max_micro_batch``;
- schedule: GPipe, 1F1B, interleaved 1F1B with ``v = 2..max_virtual_stages`` (``m`` divisible
  by ``pp``), ZB-H1; with ``pp = 1`` only 1F1B (plain gradient accumulation);
- recompute none / selective / full; ZeRO 0-3 (only 0 when ``dp = 1``: nothing to shard);
  sequence parallel when ``tp > 1``.

Each candidate's tensor-parallel layout is the sharding search's for its (tp, sp) (solved once
per pair on the captured graph, :mod:`autopar.planner.tp_layout`), and it is priced by
:class:`CostModel` in two passes:

1. **First pass** (every candidate, :meth:`CostModel.evaluate`): the min-max contiguous stage
   split and the closed-form pipeline time. Candidates that do not fit memory are kept with the
   reason. Exact branch and bound: candidates are grouped by (tp, pp, dp, micro-batch, sp); a
   group's lower bound is its compute alone spread evenly over the pipeline
   (``m * sum(F + B + W) / pp``; no bubble, communication or recompute can make a step
   shorter). Groups are visited by increasing bound and skipped once the bound reaches the
   ``k``-th best step found, so the top ``k`` equal those of exhaustive enumeration
   (``exhaustive=True``, which the tests compare against). A large space is priced on a forked
   process per core, each taking every n-th group in that order and pruning against its own
   ``k``-th best (never better than the union's: still exact; and independent of the other
   processes' timing, so the result is the same on every run).
2. **Finalists** (the first pass's top ``refine``, :meth:`CostModel.refine`): the stage ILP
   cuts the stages (its objective and LP bound go into the prediction), the runtime's simulator
   runs the executor's action lists, and the finalists are re-ranked by that price. A finalist
   whose stages fit no cut under the ILP's memory model drops out and the next one is refined.

Ties break on the candidate's key, so the result is deterministic.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from autopar.errors import InfeasiblePlanError, InvalidInputError
from autopar.ir import graphs_read_only
from autopar.plan_types import MOMENT_BYTES, RecomputeKind, ScheduleKind
from autopar.runtime.schedules import SCHEDULES
from autopar.planner.candidates import OFFLOAD_ORDER
from autopar.planner.memory import STATE_BYTES
from autopar.units import fmt_bytes
from autopar.planner.cost_model import (COMPONENTS, Candidate, CostModel, Evaluation,
                                        lower_bound_step)

__all__ = ["SearchSpace", "SearchResult", "search", "enumerate_candidates"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """Axes of the search; a non-None field pins that axis."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    virtual_stages: int | None = None
    micro_batch_size: int | None = None
    schedule: ScheduleKind | None = None
    recompute: RecomputeKind | None = None
    zero: int | None = None
    sequence_parallel: bool | None = None
    cp_innermost: bool | None = None
    cp_attention: str | None = None
    #: Expert parallelism (searched over the divisors of dp that divide the experts).
    ep: int | None = None
    #: ZeRO-3 candidates: reshard after forward (True), keep gathered (False), or both (None).
    reshard_after_forward: bool | None = None
    #: Where the optimizer state lives; None: "none", and where a candidate does not fit in
    #: memory, the first of ``offload_choices`` that makes it fit.
    offload: str | None = None
    #: What the search may offload to when memory requires it (``parallelize`` drops "disk"
    #: without an offload directory).
    offload_choices: tuple[str, ...] = ("optimizer", "disk")
    max_virtual_stages: int = 8
    max_micro_batch: int = 32

    def __post_init__(self) -> None:
        if self.schedule is not None:
            object.__setattr__(self, "schedule", ScheduleKind(self.schedule))
        if self.recompute is not None:
            object.__setattr__(self, "recompute", RecomputeKind(self.recompute))
        for name in ("dp", "tp", "pp", "cp", "ep", "virtual_stages", "micro_batch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.zero is not None and self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.max_virtual_stages < 1 or self.max_micro_batch < 1:
            raise ValueError("max_virtual_stages and max_micro_batch must be >= 1")

    def pins(self) -> dict[str, object]:
        out = {}
        for name in ("dp", "tp", "pp", "cp", "virtual_stages", "micro_batch_size", "schedule",
                     "recompute", "zero", "sequence_parallel", "cp_innermost", "cp_attention",
                     "ep", "reshard_after_forward", "offload"):
            value = getattr(self, name)
            if value is not None:
                out[name] = getattr(value, "value", value)
        return out


@dataclass(frozen=True)
class SearchResult:
    best: Evaluation
    #: The next best feasible candidates, best first.
    alternatives: tuple[Evaluation, ...]
    #: Best feasible candidate of each (dp, tp, pp) mesh that was priced.
    best_per_mesh: tuple[Evaluation, ...]
    candidates: int  # in the space
    evaluated: int  # priced by the cost model
    pruned: Mapping[str, int]  # reason -> count (structure, memory, bound)
    infeasible_examples: tuple[tuple[str, str], ...]
    time_s: float
    components: Mapping[str, str] = field(default_factory=dict)
    #: Processes that priced the first pass. ``evaluated`` and ``pruned["bound"]`` depend on it
    #: (each prunes against its own k-th best); the plan and its alternatives do not.
    processes: int = 1

    def to_json(self) -> dict[str, object]:
        return {"time_s": round(self.time_s, 3), "candidates": self.candidates,
                "processes": self.processes,
                "candidates_evaluated": self.evaluated, "pruned": dict(self.pruned),
                "infeasible_examples": [{"candidate": c, "reason": r}
                                        for c, r in self.infeasible_examples],
                "components": dict(self.components)}


def enumerate_candidates(cm: CostModel, space: SearchSpace = SearchSpace()) -> list[Candidate]:
    """Every candidate of the space, in a deterministic order."""
    n = cm.cluster.num_devices
    batch = cm.setup.global_batch
    out: list[Candidate] = []
    pin = space
    for tp in _divisors(n):
        if pin.tp is not None and tp != pin.tp:
            continue
        for pp in _divisors(n // tp):
            if pin.pp is not None and pp != pin.pp:
                continue
            if pin.tp is None and cm.cluster.devices_per_node % tp:
                break  # tensor parallelism stays inside a node (pin it to see why not)
            for cp in _divisors(n // (tp * pp)):
                if pin.cp is not None and cp != pin.cp:
                    continue
                if cp > 1 and pin.cp is None and (cm.setup.seq % (2 * cp)
                                                  or cm.model.cp_problem() is not None):
                    continue  # the sequence does not split (pin cp to see why not)
                dp = n // (tp * pp * cp)
                if pin.dp is not None and dp != pin.dp:
                    continue
                if batch % dp:
                    continue
                out.extend(_rest(cm, space, dp, tp, pp, cp))
    return out


def _rest(cm: CostModel, space: SearchSpace, dp: int, tp: int, pp: int, cp: int
          ) -> list[Candidate]:
    """The candidates of one mesh: micro-batch, schedule, recompute, ZeRO, sequence parallel."""
    batch = cm.setup.global_batch
    layers = cm.model.num_layers
    pin = space
    out: list[Candidate] = []
    # which inner axis gets adjacent ranks (runtime/mesh.py); one layout unless both are > 1
    inners = (False, True) if cp > 1 and tp > 1 else (False,)
    if pin.cp_innermost is not None:
        inners = (pin.cp_innermost and cp > 1,)
    eps = _expert_degrees(cm, dp, cp, pin.ep)
    mbs_options = [b for b in _divisors(batch // dp) if b <= space.max_micro_batch]
    if pin.micro_batch_size is not None:
        mbs_options = [pin.micro_batch_size]
    for mbs in mbs_options:
        schedules: list[tuple[ScheduleKind, int]] = []
        if pp == 1:  # no pipeline: every schedule is the same single stage
            schedules = [(ScheduleKind.ONE_F_ONE_B, 1)]
        else:
            top = min(space.max_virtual_stages, layers // pp)
            if pin.virtual_stages is not None:
                top = max(top, pin.virtual_stages)
            schedules = [(kind, v) for kind, spec in SCHEDULES.items()
                         for v in spec.virtual_stage_choices(top)]
        for sched, v in schedules:
            if pin.schedule is not None and sched is not pin.schedule:
                continue
            if pin.virtual_stages is not None and v != pin.virtual_stages:
                continue
            for rec in RecomputeKind:
                if pin.recompute is not None and rec is not pin.recompute:
                    continue
                zeros = (0, 1, 2, 3) if dp * cp > 1 else (0,)
                if pin.zero is not None:
                    zeros = (pin.zero,)
                for zero in zeros:
                    sps = (False, True) if tp > 1 else (False,)
                    if pin.sequence_parallel is not None:
                        sps = (pin.sequence_parallel,)
                    for sp in sps:
                        for inner in inners:
                            for ep in eps:
                                for reshard in _reshard_options(zero, pin):
                                    out.append(Candidate(dp, tp, pp, v, mbs, sched, rec, zero,
                                                         sp, cp, inner, pin.cp_attention, ep,
                                                         reshard, pin.offload or "none"))
    return out


def _offloaded(cm: CostModel, c: Candidate, ev: Evaluation,
               choices: Sequence[str]) -> Evaluation:
    """A candidate that does not fit in memory, with its optimizer state offloaded to the
    first of ``choices`` the cluster has and that makes it fit (``ev`` when none does):
    offloading only costs time, so the search tries it only where memory requires it."""
    if "peak_memory_bytes" not in ev.extra:  # infeasible for another reason than memory
        return ev
    # offload removes at most the optimizer state: skip the candidates it cannot bring under
    # the device's memory (most of them; pricing each again would double the search)
    if ev.extra["least_without_optimizer_bytes"] > cm.cluster.device.usable_memory_bytes:
        return ev
    for where in OFFLOAD_ORDER[1:]:
        if where in choices and cm.offload_problem(where) is None:
            alt = cm.evaluate(c._replace(offload=where), memory_first=True)
            if alt.feasible:
                return alt
    return ev


def _reshard_options(zero: int, pin: SearchSpace) -> tuple[bool, ...]:
    """ZeRO-3 may keep each layer gathered from its forward to its backward; below it there is
    nothing to reshard."""
    if zero < 3:
        return (True,)
    if pin.reshard_after_forward is not None:
        return (pin.reshard_after_forward,)
    return (True, False)


def _expert_degrees(cm: CostModel, dp: int, cp: int, pin: int | None) -> list[int]:
    """The ep of one mesh: divisors of dp dividing every block's experts (1 without experts,
    or with context parallelism)."""
    experts = cm.model.num_experts
    if pin is not None:
        return [pin] if dp % pin == 0 and (experts % pin == 0 if experts else pin == 1) else []
    if not experts or cp > 1:
        return [1]
    return [e for e in _divisors(dp) if experts % e == 0]


def _peak(ev: Evaluation) -> float:
    return ev.extra["peak_memory_bytes"]


def _rank_key(ev: Evaluation) -> tuple:
    return (ev.step_time_s, ev.candidate.key())


@contextlib.contextmanager
def few_collections() -> Iterator[None]:
    """Python's cyclic garbage collector run rarely: planning allocates millions of small
    objects that live until it ends, and each young-generation collection walks them (on GPT-3
    175B / 1024 GPUs the collector took 1.5 s of 9 s; mypy sets its thresholds for the same
    reason). Garbage is still collected, later."""
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], 100_000), max(old[1], 50), max(old[2], 100))
    try:
        yield
    finally:
        gc.set_threshold(*old)


def search(cm: CostModel, space: SearchSpace = SearchSpace(), *, top_k: int = 5,
           exhaustive: bool = False, refine: int | None = None, progress: bool | None = None,
           workers: int | None = None) -> SearchResult:
    """The best feasible plan of ``space`` (see the module docstring); ``refine`` finalists
    (default ``top_k``; 0: first pass only) are priced with the stage ILP and the simulator.
    ``workers``: processes pricing the first pass (default: one per core available when the
    space has :data:`PARALLEL_MIN_CANDIDATES` or more, else 1; ``$AUTOPAR_SEARCH_WORKERS``
    overrides the default)."""
    with few_collections(), graphs_read_only():
        return _search(cm, space, top_k=top_k, exhaustive=exhaustive, refine=refine,
                       progress=progress, workers=workers)


def _search(cm: CostModel, space: SearchSpace, *, top_k: int, exhaustive: bool,
            refine: int | None, progress: bool | None, workers: int | None) -> SearchResult:
    refine = top_k if refine is None else refine
    start = time.perf_counter()
    candidates = enumerate_candidates(cm, space)
    pruned = {"structure": 0, "memory": 0, "bound": 0}
    examples: list[tuple[str, str]] = []
    groups: dict[tuple, list[Candidate]] = {}
    workers = _workers(workers, len(candidates))
    _prepare_layouts(cm, candidates, workers)
    for c in candidates:
        problem = cm.check(c)
        if problem:
            pruned["structure"] += 1
            if len(examples) < 4:
                examples.append((c.label(), problem))
            continue
        groups.setdefault((c.tp, c.pp, c.dp, c.micro_batch_size, c.sequence_parallel, c.cp,
                           c.cp_innermost), []).append(c)
    bounds = {g: lower_bound_step(cm, cs[0]) for g, cs in groups.items()}
    order = sorted(groups, key=lambda g: (bounds[g], g))
    k = max(top_k, refine, 1)
    pricing = _Pricing(cm, space, groups, order, bounds, k, exhaustive)
    workers = max(1, min(workers, len(order)))
    show = progress if progress is not None else (len(candidates) > 20000 and sys.stderr.isatty())
    found = (pricing.parallel(workers, show) if workers > 1
             else pricing.share(0, 1, _progress(len(order)) if show else None))
    pruned["memory"] += found.memory
    pruned["bound"] += found.bound
    examples.extend(found.examples)
    if not found.top:
        raise _nothing_fits(cm, candidates, pruned, examples, found.leanest)
    ranked = list(found.top)
    if refine:
        ranked = _refine(cm, ranked, refine, pruned, examples, workers)
    meshes = sorted(found.best_mesh.values(), key=_rank_key)
    ranked[0] = cm.with_sharding(ranked[0])
    return SearchResult(best=ranked[0], alternatives=tuple(ranked[1:top_k]),
                        best_per_mesh=tuple(meshes), candidates=len(candidates),
                        evaluated=found.evaluated, pruned=pruned,
                        infeasible_examples=tuple(examples),
                        time_s=time.perf_counter() - start, components=dict(COMPONENTS),
                        processes=workers)


#: The smallest space (candidates) searched on several processes by default: below it, forking
#: and sending the results back cost more than they save.
PARALLEL_MIN_CANDIDATES = 4000


def _workers(requested: int | None, size: int) -> int:
    """How many processes price the first pass: ``requested``, else ``$AUTOPAR_SEARCH_WORKERS``,
    else one per core this process may use once the space is large; 1 where processes cannot
    be forked (the workers inherit the cost model instead of receiving it pickled)."""
    if "fork" not in multiprocessing.get_all_start_methods() or _cores() == 1:
        return 1
    if requested is None:
        env = os.environ.get("AUTOPAR_SEARCH_WORKERS")
        if env:
            if not env.isdigit() or int(env) < 1:
                raise InvalidInputError("$AUTOPAR_SEARCH_WORKERS is not a process count",
                                        expected="a positive integer", found=repr(env),
                                        fix="set it to 1 (one process) or the cores to use, "
                                            "or unset it")
            requested = int(env)
        elif size >= PARALLEL_MIN_CANDIDATES:
            requested = _cores()
        else:
            requested = 1
    return max(1, min(requested, size))


@dataclass
class _Found:
    """What one share of the first pass found: the ``k`` best feasible evaluations (best
    first), the best of each mesh, the counts pruned by memory and by bound, up to 8 memory
    examples, and the leanest candidate that did not fit."""

    top: list[Evaluation]
    best_mesh: dict[tuple, Evaluation]
    evaluated: int = 0
    memory: int = 0
    bound: int = 0
    examples: list[tuple[str, str]] = field(default_factory=list)
    leanest: Evaluation | None = None

    @staticmethod
    def merge(parts: Sequence["_Found"], k: int) -> "_Found":
        """The shares together: the ``k`` best of their bests, each mesh's best; exact, since a
        share prunes only against its own ``k``-th best, never better than the union's."""
        out = _Found(sorted((ev for p in parts for ev in p.top), key=_rank_key)[:k], {})
        for p in parts:
            for mesh, ev in p.best_mesh.items():
                if mesh not in out.best_mesh or _rank_key(ev) < _rank_key(out.best_mesh[mesh]):
                    out.best_mesh[mesh] = ev
            out.evaluated += p.evaluated
            out.memory += p.memory
            out.bound += p.bound
            out.examples.extend(p.examples)
            if p.leanest is not None and (out.leanest is None
                                          or _peak(p.leanest) < _peak(out.leanest)):
                out.leanest = p.leanest
        out.examples = out.examples[:8]
        return out


@dataclass
class _Pricing:
    """The first pass over the well-formed candidates, ``groups`` visited in ``order`` of their
    ``bounds`` (module docstring), by one process or by several forked ones, each taking every
    ``workers``-th group (so each share mixes cheap and dear groups)."""

    cm: CostModel
    space: SearchSpace
    groups: Mapping[tuple, list[Candidate]]
    order: Sequence[tuple]
    bounds: Mapping[tuple, float]
    k: int
    exhaustive: bool

    def share(self, index: int, workers: int, bar=None, done=None) -> _Found:
        """Price groups ``index``, ``index + workers``, ... (``bar``: a progress bar to
        advance; ``done``: a shared counter of the groups visited, for the parent's bar). A
        share prunes against its own ``k``-th best, never better than the union's, so pruning
        stays exact; and it sees no other share's, so what it prices does not depend on their
        timing (the plan document's best per mesh is the same on every run)."""
        cm, k, space = self.cm, self.k, self.space
        top: list[tuple] = []  # max-heap of the k best: (-time, negated key, evaluation)
        found = _Found([], {})
        limit = math.inf  # the k-th best time found
        try:
            for g in self.order[index::workers]:
                if bar:
                    bar[0].advance(bar[1])
                if done is not None:
                    with done.get_lock():
                        done.value += 1
                if not self.exhaustive and self.bounds[g] > limit:
                    found.bound += len(self.groups[g])
                    continue
                for c in self.groups[g]:
                    if not self.exhaustive and cm.lower_bound(c) > limit:
                        found.bound += 1
                        continue
                    if not self.exhaustive and self._over_memory(c, found):
                        found.memory += 1
                        continue
                    ev = cm.evaluate(c, memory_first=True)
                    found.evaluated += 1
                    if not ev.feasible and space.offload is None:
                        ev = _offloaded(cm, c, ev, space.offload_choices)
                    if not ev.feasible:
                        found.memory += 1
                        if "peak_memory_bytes" in ev.extra and (
                                found.leanest is None or _peak(ev) < _peak(found.leanest)):
                            found.leanest = ev
                        if len(found.examples) < 8:
                            found.examples.append((c.label(), ev.infeasible or ""))
                        continue
                    mesh = (c.dp, c.tp, c.pp, c.cp, c.cp_innermost, c.ep)
                    best = found.best_mesh.get(mesh)
                    if best is None or _rank_key(ev) < _rank_key(best):
                        found.best_mesh[mesh] = ev
                    item = (-ev.step_time_s, _neg(c.key()), ev)
                    if len(top) < k:
                        heapq.heappush(top, item)
                    elif item[:2] > top[0][:2]:
                        heapq.heapreplace(top, item)
                    else:
                        continue
                    if len(top) >= k:
                        limit = -top[0][0]
        finally:
            if bar:
                bar[0].stop()
        found.top = sorted((item[2] for item in top), key=_rank_key)
        return found

    def _over_memory(self, c: Candidate, found: _Found) -> bool:
        """Whether ``c`` is out of memory by :meth:`CostModel.memory_floor`, before its stages
        are cut (most of a large space does not fit: 11,000 of GPT-3 175B's 15,000 priced
        candidates on 1024 A100), with the offloads :func:`_offloaded` would try out of memory
        too. Only once what the share reports of such candidates is settled: its 8 examples,
        and a leanest candidate this one's floor cannot undercut; so the search's answer is
        the same as pricing it (tests/test_search.py)."""
        leanest = found.leanest
        if len(found.examples) < 8 or leanest is None:
            return False
        cm = self.cm
        usable = cm.cluster.device.usable_memory_bytes
        floor = cm.memory_floor(c)
        if floor <= usable or floor < _peak(leanest):
            return False
        if self.space.offload is None:
            for where in OFFLOAD_ORDER[1:]:
                if where in self.space.offload_choices and cm.offload_problem(where) is None:
                    if cm.memory_floor(c._replace(offload=where)) <= usable:
                        return False
        return True

    def parallel(self, workers: int, show: bool) -> _Found:
        """The shares priced by ``workers`` forked processes (:func:`_forked_map`)."""
        done = multiprocessing.get_context("fork").Value("i", 0)
        bar = None

        def tick() -> None:  # the bar starts after the fork: rich runs a thread
            nonlocal bar
            if show and bar is None:
                bar = _progress(len(self.order))
            if bar:
                bar[0].update(bar[1], completed=done.value)

        try:
            parts = _forked_map(_price_share, (self, done, workers), range(workers), workers,
                                tick)
        finally:
            if bar:
                bar[0].stop()
        return _Found.merge(parts, self.k)


def _price_share(state: tuple[_Pricing, Any, int], index: int) -> _Found:
    pricing, done, workers = state
    return pricing.share(index, workers, done=done)


def _prepare_layouts(cm: CostModel, candidates: Sequence[Candidate], workers: int) -> None:
    """Every tensor-parallel layout the candidates need, one (tp, SP) family per task: on
    ``workers`` forked processes when the search runs on several (each family's layouts come
    back pickled), else on a thread per core (HiGHS releases the interpreter while it solves,
    so one family's solve overlaps another's Python). GPT-3 175B's 30 layouts: 2.6 s on one
    thread, 1.7 s on two, 1.8-2.1 s on two processes where two threads took 2.8 s the same
    day (benchmarks/README.md, "Planning time")."""
    sizes: dict[tuple[int, bool], set[int]] = {}
    for c in candidates:
        if c.tp > 1 and cm.well_formed_but_for_layout(c):
            sizes.setdefault((c.tp, c.sequence_parallel), set()).add(c.micro_batch_size)
    families = [(tp, sp, sorted(mbs)) for (tp, sp), mbs in sorted(sizes.items())]
    threads = min(len(families), _cores())
    if threads <= 1:
        for tp, sp, mbs in families:
            cm.prepare_layouts(tp, sp, mbs)
        return
    workers = min(len(families), workers)
    if workers > 1:  # _workers says fork is available
        for solved in _forked_map(_solve_family, cm, families, workers):
            cm.model.adopt_layouts(solved)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="autopar-layouts") as pool:
        for done in [pool.submit(cm.prepare_layouts, tp, sp, mbs) for tp, sp, mbs in families]:
            done.result()


def _solve_family(cm: CostModel, family: tuple[int, bool, list[int]]) -> dict[tuple, Any]:
    """The layouts ``cm.prepare_layouts(*family)`` solves (in a forked process)."""
    before = cm.model.solved_layouts()
    cm.prepare_layouts(*family)
    return {k: v for k, v in cm.model.solved_layouts().items() if k not in before}


#: What the processes :func:`_forked_map` forks inherit (set only while they run).
_INHERITED: Any = None


def _forked_map(fn: Callable[[Any, Any], Any], state: Any, items: Iterable[Any], workers: int,
                tick: Callable[[], None] | None = None) -> list[Any]:
    """``[fn(state, item) for item in items]`` on ``workers`` forked processes: they inherit
    ``state`` (the cost model, its caches and graphs: nothing is pickled on the way out, only
    each answer on the way back). ``tick`` is called while waiting, after every process has
    been forked (a progress bar). A process that dies is an error, not a hang."""
    global _INHERITED
    _INHERITED = state
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                 initializer=_one_thread) as pool:
            futures = [pool.submit(_call_inherited, fn, item) for item in items]
            pending = set(futures)
            while pending:
                _, pending = wait(pending, timeout=0.2)
                if tick is not None:
                    tick()
            return [f.result() for f in futures]
    finally:
        _INHERITED = None


def _one_thread() -> None:
    """A forked worker runs torch's CPU ops on its own thread. The parent's OpenMP threads, once
    started (any parallel op: a GEMM, a large ``arange``), are not in the child, and GNU OpenMP
    is not fork-safe: the child's first parallel region waited on them forever (padding a
    50257-entry vocabulary while solving a layout: ``torch.arange(50304) >= 50257``, so
    ``autopar plan`` of a GPT-2 config hung after any multi-threaded op in its process). One
    thread runs ``at::parallel_for`` inline; the workers are one per core anyway."""
    torch.set_num_threads(1)


def _call_inherited(fn: Callable[[Any, Any], Any], item: Any) -> Any:
    return fn(_INHERITED, item)


def _cores() -> int:
    """The cores this process may use to fork workers on (1 in a daemonic process, which may
    not have children: a LocalPool rank)."""
    if multiprocessing.current_process().daemon:
        return 1
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _refine(cm: CostModel, ranked: list[Evaluation], count: int, pruned: dict[str, int],
            examples: list[tuple[str, str]], workers: int = 1) -> list[Evaluation]:
    """The first ``count`` of ``ranked`` that the stage ILP can cut, priced by
    :meth:`CostModel.refine` and re-ranked ahead of the rest (first-pass prices); with
    ``workers`` > 1 the finalists are refined on as many forked processes (a stage ILP of 80
    stages can run to its time limit: GPT-3 175B at pp 10 x v 8)."""
    refined: list[Evaluation] = []
    done = 0
    while done < len(ranked) and len(refined) < count:
        batch = ranked[done:done + count - len(refined)]
        done += len(batch)
        for ev, better in zip(batch, _refined(cm, batch, workers)):
            if better.feasible:
                refined.append(better)
            else:
                pruned["memory"] += 1
                examples.append((ev.candidate.label(), better.infeasible or ""))
    rest = ranked[done:]
    if not refined:  # the ILP's memory model is stricter than the first pass's: keep those
        return ranked
    return sorted(refined, key=_rank_key) + rest


def _refined(cm: CostModel, evs: Sequence[Evaluation], workers: int) -> list[Evaluation]:
    """:meth:`CostModel.refine` of each of ``evs``, on up to ``workers`` forked processes (their
    answers kept in ``cm``'s cache as if refined here)."""
    workers = min(workers, len(evs))
    if workers <= 1:
        return [cm.refine(ev) for ev in evs]
    out = _forked_map(CostModel.refine, cm, evs, workers)
    for ev in out:
        cm.adopt_refined(ev)
    return out


class _neg(tuple):
    """A tuple ordered backwards (so the heap keeps the smallest key among equal times)."""

    def __lt__(self, other):  # type: ignore[override]
        return tuple.__gt__(self, other)

    def __gt__(self, other):  # type: ignore[override]
        return tuple.__lt__(self, other)


def _progress(total: int):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("searching plans"), BarColumn(), TextColumn("{task.completed}/"
                   "{task.total} meshes"), TimeElapsedColumn(), transient=True,
                   console=__import__("rich.console").console.Console(stderr=True))
    bar.start()
    return bar, bar.add_task("search", total=total)


def _nothing_fits(cm: CostModel, candidates: Sequence[Candidate], pruned: Mapping[str, int],
                  examples: Sequence[tuple[str, str]], leanest: Evaluation | None
                  ) -> InfeasiblePlanError:
    n = cm.cluster.num_devices
    if not candidates:
        return InfeasiblePlanError(
            "no candidate plan matches the pinned choices",
            expected=f"dp x tp x pp = {n} devices with the global batch "
                     f"({cm.setup.global_batch}) divisible by dp x micro-batch",
            found="an empty search space",
            fix="drop or change a pinned flag (--tp/--pp/--dp/--micro-batch)")
    if leanest is None:
        reasons = "; ".join(f"{c}: {r}" for c, r in examples[:3])
        return InfeasiblePlanError(
            f"none of the {len(candidates)} candidate plans is well formed",
            expected="a mesh and micro-batch the model and cluster allow",
            found=reasons, fix="change the pinned flags, the device count or the batch")
    usable = float(leanest.extra["memory_limit_bytes"])
    return InfeasiblePlanError(
        f"no plan fits in memory ({pruned['memory']} candidates priced, none fits)",
        expected=f"a plan within {fmt_bytes(usable)} per device",
        found=f"the leanest, {leanest.candidate.label()}, {leanest.infeasible}",
        fix=_fewest_devices(cm, candidates, usable))


def _fewest_devices(cm: CostModel, candidates: Sequence[Candidate], usable: float) -> str:
    """What to do when nothing fits: how many devices the model's states alone need, sharded
    over every device without a copy (ZeRO-3), whatever the plan (a lower bound), when more
    than these; else what shrinks the rest."""
    dtype = cm.setup.dtype
    w, g, o = STATE_BYTES[dtype]
    offloads = any(c.offload != "none" for c in candidates)
    # the optimizer's state beyond Adam's moments: as profiled; offloaded, it leaves the device
    o = 0.0 if offloads else o - MOMENT_BYTES + cm.setup.optimizer.state_bytes
    states = cm.model.total_params * (w + g + o)
    fewest = math.ceil(states / max(usable, 1.0))
    held = "weights and gradients" if offloads else "weights, gradients and optimizer state"
    if fewest > cm.cluster.num_devices:
        return (f"use at least {fewest} devices of this kind: the model's {held} alone come "
                f"to {fmt_bytes(states)} ({cm.model.total_params:,} parameters x "
                f"{w + g + o:g} B at {dtype}), sharded over every device with ZeRO-3 "
                f"(activations need more); or devices with more memory")
    return (f"its {held} fit {cm.cluster.num_devices} devices when sharded with ZeRO-3 "
            f"({fmt_bytes(states / cm.cluster.num_devices)} each): shrink the rest with a "
            f"smaller micro-batch or sequence and full recompute, or use more devices or "
            f"devices with more memory")
