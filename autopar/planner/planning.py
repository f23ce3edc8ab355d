"""Plan a model on a cluster: capture, cost, search, and the plan document.

:func:`plan` is the Python entry (``autopar.plan``: no process group, a meta model welcome);
:func:`plan_model` plans what a ``MODEL`` string names (a zoo preset or family, a transformers
config, ``file.py:function``: :mod:`autopar.models.workload`) for ``autopar plan``. Both go
through :func:`plan_workload`.

The plan document is the JSON ``autopar plan --json`` prints, ``--out`` and
:meth:`PlanReport.save` write, and ``parallelize(plan=path)``, ``explain`` and ``simulate`` read
back. It holds the plan and its prediction (the fields of :class:`autopar.plan_types.Plan` and
:class:`autopar.plan_types.Prediction`), the search statistics, the alternatives, and what
``simulate`` needs without re-capturing the model: the cluster and the per-stage costs.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from autopar.cluster import Cluster
from autopar.errors import InvalidInputError
from autopar.models.workload import Workload
from autopar.planner.cost_model import CostModel, Evaluation, ModelCosts, TrainingSetup
from autopar.planner.search import SearchResult, SearchSpace, few_collections, search
from autopar.plan_types import OptimizerProfile, Plan, Prediction

__all__ = ["PlanReport", "plan", "plan_workload", "capture_workload_costs", "plan_model",
           "read_document", "DOCUMENT_VERSION"]

DOCUMENT_VERSION = 1


@dataclass
class PlanReport:
    model: dict[str, Any]
    cluster: Cluster
    setup: TrainingSetup
    result: SearchResult
    cost_model: CostModel
    capture_s: float
    #: Repeated blocks of the real model when a shallower copy was captured (None: as captured).
    depth: int | None = None
    total_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def best(self) -> Evaluation:
        return self.result.best

    @property
    def plan(self) -> Plan:
        """The fastest plan that fits, with its stage cuts and the model's fingerprint
        (``parallelize(plan=...)`` refuses it for another model)."""
        return self.best.plan.replace(model_fingerprint=self.fingerprint)

    @property
    def prediction(self) -> Prediction:
        return self.best.prediction

    @property
    def alternatives(self) -> list[tuple[Plan, Prediction]]:
        """The next best plans (fastest first) with their predictions."""
        return [(ev.plan, ev.prediction) for ev in self.result.alternatives]

    @property
    def fingerprint(self) -> str:
        """The model's fingerprint at its real depth."""
        return self.cost_model.model.captured.fingerprint(depth=self.depth)

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan document (what ``autopar plan --out`` writes); ``parallelize(plan=
        path)`` runs it."""
        with open(path, "w") as fh:
            json.dump(self.document(), fh, indent=1)

    def document(self) -> dict[str, Any]:
        """The plan document (JSON-ready)."""
        best = self.best
        names = self.cost_model.model.layer_names
        layout = self.cost_model.layout(best.plan.tp, best.plan.sequence_parallel,
                                        best.plan.micro_batch_size)
        plan = best.plan.to_json()
        rank_mem = {r.pp_rank: r.total for r in best.ranks}
        for st, row in zip(best.stages, plan["stages"]):
            row.update({"names": [names[st.layers[0]], names[st.layers[1]]],
                        "forward_s": st.forward_s, "backward_s": st.backward_s + st.weight_s,
                        "rank_memory_bytes": int(rank_mem[st.pp_rank])})
        return {
            "autopar_plan_document": DOCUMENT_VERSION,
            "model": {**self.model, **({"experts": self.cost_model.model.num_experts}
                                        if self.cost_model.model.num_experts else {})},
            "training": {"global_batch": self.setup.global_batch, "seq": self.setup.seq,
                         "dtype": self.setup.dtype,
                         **({"optimizer": self.setup.optimizer.document()}
                            if self.setup.optimizer != OptimizerProfile() else {}),
                         **({"moe_imbalance": self.setup.moe_imbalance}
                            if self.cost_model.model.num_experts else {})},
            "cluster": self.cluster.to_json(),
            "plan": {**plan, "model_fingerprint": self.fingerprint},
            "prediction": {**best.prediction.to_json(), **_extra(best)},
            "search": {**self.result.to_json(), "time_s": round(self.total_s, 3),
                       "search_s": round(self.result.time_s, 3),
                       "capture_s": round(self.capture_s, 3)},
            "memory_per_rank": [r.to_json() | {"pp_rank": r.pp_rank} for r in best.ranks],
            "stage_costs": [st.to_json() for st in best.stages],
            "tp_placement": self.cost_model.model.tp_placement(layout),
            "tp_unruled_ops": list(layout.unruled) if layout is not None else [],
            "alternatives": [_summary(ev, best) for ev in self.result.alternatives],
            "best_per_mesh": [_summary(ev, best) for ev in self.result.best_per_mesh],
        }


def _extra(ev: Evaluation) -> dict[str, float]:
    return {k: ev.extra[k] for k in ("hfu", "hardware_tflops_per_gpu", "tokens_per_s_per_gpu",
                                     "stage_ilp_solve_s") if k in ev.extra}


def _summary(ev: Evaluation, best: Evaluation) -> dict[str, Any]:
    plan = {k: v for k, v in ev.plan.to_json().items()
            if k not in ("stages", "gemm_sharding", "model_fingerprint", "format_version")}
    pred = ev.prediction.to_json()
    return {"plan": plan, "label": ev.candidate.label(),
            "prediction": {**{k: pred[k] for k in ("step_time_s", "tokens_per_s",
                                                  "tflops_per_gpu", "mfu", "peak_memory_bytes",
                                                  "breakdown")}, **_extra(ev)},
            "slower_than_best": ev.prediction.step_time_s / best.prediction.step_time_s - 1}


def capture_workload_costs(work: Workload) -> tuple[ModelCosts, dict[str, Any], float]:
    """Capture a workload on its device (meta: shapes only) and build its cost templates,
    extended to ``work.depth`` blocks when a shallower copy was built."""
    from autopar.frontend import capture

    start = time.perf_counter()
    captured = capture(work.model, work.example_inputs, work.loss_fn,
                       example_targets=work.example_targets)
    from autopar.ir import LayerKind
    from autopar.models.workload import CAPTURE_BLOCKS

    blocks = sum(1 for layer in captured.layers if layer.kind is LayerKind.BLOCK)
    depth = work.depth
    if depth is not None and blocks != min(depth, CAPTURE_BLOCKS):
        depth = None  # the capture did not find the blocks the config has: plan as captured
    costs = ModelCosts(captured, name=work.name, depth=depth)
    info = {**work.info, "params": _full_params(costs), "captured_blocks": blocks,
            "capture_method": captured.method.value}
    if depth is None and work.depth is not None:
        info["layers_captured_as"] = blocks
    return costs, info, time.perf_counter() - start


def capture_model_costs(name: str, *, attention: str = "sdpa", **overrides: Any
                        ) -> tuple[ModelCosts, dict[str, Any], float]:
    """:func:`capture_workload_costs` of what ``name`` names (a zoo preset or family shaped by
    ``overrides``, a transformers config, ``file.py:function``)."""
    from autopar.models.workload import load_workload

    return capture_workload_costs(load_workload(name, attention=attention, overrides=overrides,
                                                pad_vocab=True))


def _full_params(costs: ModelCosts) -> int:
    seen: dict[Any, int] = {}
    for i, t in enumerate(costs.templates):
        for fqn, numel in t.params.items():
            seen[t.param_key(i, fqn)] = numel
    return int(sum(seen.values()))


def plan_workload(work: Workload, cluster: Cluster, *, global_batch: int,
                  seq: int | None = None, dtype: str | None = None,
                  space: SearchSpace = SearchSpace(), top_k: int = 5,
                  progress: bool | None = None,
                  model_costs: tuple[ModelCosts, dict[str, Any], float] | None = None,
                  moe_imbalance: float = 1.0,
                  optimizer: OptimizerProfile = OptimizerProfile()) -> PlanReport:
    """Search the best plan for ``work`` on ``cluster`` (all its devices); ``moe_imbalance``:
    the routing assumption of a mixture-of-experts model, ``optimizer`` what is priced of the
    optimizer (TrainingSetup)."""
    start = time.perf_counter()
    # the inputs' own errors first: capturing a large model takes seconds
    if global_batch < 1:
        raise InvalidInputError("the global batch must be positive", expected=">= 1",
                                found=str(global_batch), fix="pass --global-batch B")
    max_seq = work.max_seq
    if seq is not None and max_seq is not None and seq > max_seq:
        raise InvalidInputError(f"sequence length {seq} exceeds the model's positions",
                                expected=f"--seq <= {max_seq}", found=str(seq),
                                fix="lower --seq or raise --max-seq")
    costs, info, capture_s = model_costs or capture_workload_costs(work)
    if seq is None:
        from autopar.ir import SEQ

        # the positions it learns, else the context it was configured for (a rotary model's
        # max_position_embeddings), else the capture's own length
        configured = work.info.get("max_seq") if work.info else None
        seq = max_seq or (configured if isinstance(configured, int) and configured > 0
                          else None) or costs.captured.example_sizes.get(SEQ, 1)
    try:
        setup = TrainingSetup(global_batch, seq, dtype or cluster.device.default_dtype,
                              moe_imbalance=moe_imbalance, optimizer=optimizer)
    except ValueError as exc:
        raise InvalidInputError(str(exc), fix="pass --moe-imbalance >= 1") from None
    cost_model = CostModel(costs, cluster, setup)
    result = search(cost_model, space, top_k=top_k, progress=progress)
    from autopar.ir import LayerKind

    depth = sum(k is LayerKind.BLOCK for k in costs.kinds) if costs.extended else None
    report = PlanReport(model=info, cluster=cluster, setup=setup, result=result,
                        cost_model=cost_model, capture_s=capture_s, depth=depth)
    report.total_s = time.perf_counter() - start
    return report


def plan_model(name: str, cluster: Cluster, *, global_batch: int, seq: int | None = None,
               dtype: str | None = None, space: SearchSpace = SearchSpace(), top_k: int = 5,
               progress: bool | None = None, attention: str = "sdpa",
               model_costs: tuple[ModelCosts, dict[str, Any], float] | None = None,
               overrides: Mapping[str, Any] | None = None,
               moe_imbalance: float = 1.0,
               optimizer: OptimizerProfile = OptimizerProfile()) -> PlanReport:
    """Search the best plan for what ``name`` names (a zoo preset or family, a transformers
    config file or directory, ``file.py:function``) on ``cluster``; ``overrides`` shape a
    preset, family or config (layers, hidden, heads, kv_heads, ffn_hidden, vocab, seq =
    positions)."""
    from autopar.models.workload import load_workload

    with few_collections():  # building and capturing the model allocate as much
        work = load_workload(name, seq=seq, attention=attention, overrides=overrides,
                             pad_vocab=True)
        return plan_workload(work, cluster, global_batch=global_batch, seq=seq, dtype=dtype,
                             space=space, top_k=top_k, progress=progress,
                             model_costs=model_costs, moe_imbalance=moe_imbalance,
                             optimizer=optimizer)


def plan(model: Any, cluster: Cluster | str, *, example_inputs: Any, loss_fn: Any,
         global_batch: int, example_targets: Any = (), seq: int | None = None,
         dtype: str | None = None, devices: int | None = None,
         devices_per_node: int | None = None, top_k: int = 5, progress: bool = False,
         optimizer: Any = None, **pins: Any) -> PlanReport:
    """Plan ``model`` for ``cluster`` without running it: no process group, and a model on the
    meta device is welcome (shapes are all planning needs).

    Args:
        model: the single-device ``nn.Module`` (on meta or not).
        cluster: a :class:`autopar.Cluster`, or a preset name or file; ``devices`` (and
            ``devices_per_node``) resize it.
        example_inputs / example_targets / loss_fn: as for :func:`autopar.parallelize`; their
            batch and sequence sizes only need to be small (they are symbolic in the graph).
        global_batch: samples per optimizer step; ``seq``: the sequence length to plan for
            (default: the example inputs').
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (default: the cluster's).
        optimizer: the optimizer training will use, as ``parallelize`` takes it (a torch
            optimizer class, ``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)``, a
            callable taking the parameters), profiled on probes for the cluster's device (its
            kernel, state and step: ``OptimizerFactory.profile``); or an
            :class:`autopar.OptimizerProfile` given whole (``OptimizerProfile(kernel="fused")``);
            default: AdamW on torch's default kernel.
        pins: dp, tp, pp, virtual_stages, micro_batch_size, schedule, recompute, zero,
            sequence_parallel: fixed; the rest is searched.

    Returns a :class:`PlanReport`: ``.plan`` (an :class:`autopar.Plan` with its stage cuts),
    ``.prediction``, ``.alternatives``, ``.document()`` (the JSON of ``autopar plan --json``)
    and ``.save(path)`` (loadable by ``parallelize(plan=path)``).
    """
    if isinstance(cluster, str):
        cluster = Cluster.load(cluster)
    elif not isinstance(cluster, Cluster):
        raise InvalidInputError("cluster has an unexpected type",
                                expected="an autopar.Cluster, or a preset name or file",
                                found=type(cluster).__name__)
    if devices is not None:
        cluster = cluster.with_devices(devices, devices_per_node)
    try:
        space = SearchSpace(**pins)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"bad pinned choice: {exc}",
                                expected="pins among dp, tp, pp, virtual_stages, "
                                         "micro_batch_size, schedule, recompute, zero, "
                                         "sequence_parallel",
                                found=str(sorted(pins)), fix="see help(autopar.plan)") from None
    work = Workload(type(model).__name__, model, example_inputs, loss_fn, example_targets,
                    info={"name": type(model).__name__, "family": type(model).__name__})
    if optimizer is None:
        profile = OptimizerProfile()
    elif isinstance(optimizer, OptimizerProfile):
        profile = optimizer
    else:
        from autopar.runtime.optim import OptimizerFactory

        profile = OptimizerFactory.of(optimizer, model.named_parameters()).profile(
            gpu=cluster.gpu)
    return plan_workload(work, cluster, global_batch=global_batch, seq=seq, dtype=dtype,
                         space=space, top_k=top_k, progress=progress, optimizer=profile)


def read_document(path: str) -> Mapping[str, Any]:
    """A plan document written by ``autopar plan --out`` (clear errors otherwise)."""
    import json

    from autopar.errors import PlanMismatchError

    try:
        with open(path) as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        raise InvalidInputError(f"no plan file {path!r}", expected="a file written by "
                                "`autopar plan --out plan.json`", found="nothing at that path",
                                fix="run autopar plan ... --out plan.json first") from None
    except ValueError as exc:
        raise InvalidInputError(f"{path} is not JSON", expected="a plan document",
                                found=str(exc), fix="regenerate it with autopar plan --out")
    if not isinstance(doc, dict) or doc.get("autopar_plan_document") != DOCUMENT_VERSION:
        raise PlanMismatchError(f"{path} is not an autopar plan document of version "
                                f"{DOCUMENT_VERSION}",
                                expected="the output of `autopar plan --out`",
                                found=f"keys {sorted(doc)[:6] if isinstance(doc, dict) else type(doc).__name__}",
                                fix="regenerate it with this version of autopar")
    return doc
