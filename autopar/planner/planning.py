"""Plan a zoo model (or family) on a cluster: capture, cost, search, and the plan document.

The plan document is the JSON ``autopar plan --json`` prints and ``--out`` writes; ``explain``
and ``simulate`` read it back. It holds the plan and its prediction (the fields of
:class:`autopar.plan_types.Plan` and :class:`autopar.plan_types.Prediction`), the search statistics, the
alternatives, and what ``simulate`` needs without re-capturing the model: the cluster and the
per-stage costs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from autopar.cluster import Cluster
from autopar.errors import InvalidInputError
from autopar.planner.cost_model import CostModel, Evaluation, ModelCosts, TrainingSetup
from autopar.planner.search import SearchResult, SearchSpace, search

__all__ = ["PlanReport", "capture_model_costs", "plan_model", "read_document", "DOCUMENT_VERSION"]

DOCUMENT_VERSION = 1
#: Blocks captured when a model is deeper (the rest are copies of the last one).
CAPTURE_BLOCKS = 2
#: A preset's vocabulary is padded to a multiple of this (Megatron-LM's
#: --make-vocab-size-divisible-by default), so that every tensor-parallel degree up to it
#: divides the embedding, the LM head and the loss. A vocabulary given with --vocab is kept.
VOCAB_MULTIPLE = 128


@dataclass
class PlanReport:
    model: dict[str, Any]
    cluster: Cluster
    setup: TrainingSetup
    result: SearchResult
    cost_model: CostModel
    capture_s: float
    total_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def best(self) -> Evaluation:
        return self.result.best

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
            "model": self.model,
            "training": {"global_batch": self.setup.global_batch, "seq": self.setup.seq,
                         "dtype": self.setup.dtype},
            "cluster": self.cluster.to_json(),
            "plan": plan,
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


def capture_model_costs(name: str, *, attention: str = "sdpa", **overrides: Any
                        ) -> tuple[ModelCosts, dict[str, Any], float]:
    """Capture a zoo preset or family on the meta device (at most CAPTURE_BLOCKS blocks; the
    costs are extended to the real depth) and build its cost templates."""
    from autopar.frontend import capture
    from autopar.models import build, resolve_spec

    start = time.perf_counter()
    spec = resolve_spec(name, **overrides)
    shallow = dict(overrides)
    shallow["layers"] = min(spec.layers, CAPTURE_BLOCKS)
    vocab = spec.vocab
    if overrides.get("vocab") is None and spec.vocab % VOCAB_MULTIPLE:
        vocab = -(-spec.vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        shallow["vocab"] = vocab
    zm = build(name, device="meta", attention=attention, **shallow)
    inputs, targets = zm.example_inputs(batch=2, seq=min(16, spec.seq))
    captured = capture(zm.model, inputs, zm.loss_fn, example_targets=targets)
    costs = ModelCosts(captured, name=spec.name or spec.family, depth=spec.layers)
    params = _full_params(costs, spec.layers)
    model = {"name": spec.name or spec.family, "family": spec.family, "layers": spec.layers,
             "hidden": spec.hidden, "heads": spec.heads, "kv_heads": spec.num_kv_heads,
             "ffn_hidden": spec.ffn, "vocab": vocab, "max_seq": spec.seq, "params": params,
             "overrides": {k: v for k, v in overrides.items() if v is not None},
             "attention": attention, "captured_blocks": min(spec.layers, CAPTURE_BLOCKS)}
    if vocab != spec.vocab:
        model["vocab_padded_from"] = spec.vocab
    return costs, model, time.perf_counter() - start


def _full_params(costs: ModelCosts, layers: int) -> int:
    seen: dict[Any, int] = {}
    for i, t in enumerate(costs.templates):
        for fqn, numel in t.params.items():
            seen[(i, fqn) if t.shared else fqn] = numel
    return int(sum(seen.values()))


def plan_model(name: str, cluster: Cluster, *, global_batch: int, seq: int | None = None,
               dtype: str | None = None, space: SearchSpace = SearchSpace(), top_k: int = 5,
               progress: bool | None = None, attention: str = "sdpa",
               model_costs: tuple[ModelCosts, dict[str, Any], float] | None = None,
               overrides: Mapping[str, Any] | None = None) -> PlanReport:
    """Search the best plan for a zoo model on ``cluster`` (all its devices); ``overrides``
    shape a preset or family (layers, hidden, heads, kv_heads, ffn_hidden, vocab, seq =
    positions)."""
    from autopar.models import resolve_spec

    start = time.perf_counter()
    # the inputs' own errors first: capturing a large model takes seconds
    max_seq = model_costs[1]["max_seq"] if model_costs else resolve_spec(
        name, **dict(overrides or {})).seq
    seq = seq or max_seq
    if seq > max_seq:
        raise InvalidInputError(f"sequence length {seq} exceeds the model's positions",
                                expected=f"--seq <= {max_seq}", found=str(seq),
                                fix="lower --seq or raise --max-seq")
    if global_batch < 1:
        raise InvalidInputError("the global batch must be positive", expected=">= 1",
                                found=str(global_batch), fix="pass --global-batch B")
    costs, model, capture_s = model_costs or capture_model_costs(name, attention=attention,
                                                                 **dict(overrides or {}))
    setup = TrainingSetup(global_batch, seq, dtype or cluster.device.default_dtype)
    cost_model = CostModel(costs, cluster, setup)
    result = search(cost_model, space, top_k=top_k, progress=progress)
    report = PlanReport(model=model, cluster=cluster, setup=setup, result=result,
                        cost_model=cost_model, capture_s=capture_s)
    report.total_s = time.perf_counter() - start
    return report


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
