"""Regression plans: the plan and prediction for fixed GPT and BERT presets on a few clusters.

A change shows as a readable diff of the fixture. After an intended change of the cost model or
search, regenerate with::

    AUTOPAR_REGEN_PLANS=1 .venv/bin/python -m pytest tests/test_search_regression.py
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

import pytest

from autopar import Cluster
from autopar.planner.planning import capture_model_costs, plan_model

FIXTURES = Path(__file__).parent / "fixtures" / "plans"
REGEN = os.environ.get("AUTOPAR_REGEN_PLANS") == "1"

CASES = [
    # (model, cluster, devices, global batch, sequence)
    ("gpt2-small", "a100-80g", 8, 64, 1024),
    ("gpt3-1.3b", "a100-80g", 64, 512, 2048),
    ("gpt3-13b", "a100-80g", 256, 1024, 2048),
    ("gpt3-13b", "h100-80g", 64, 512, 2048),
    ("bert-base", "a100-80g", 8, 256, 512),
    ("bert-large", "h200", 32, 1024, 512),
]


def _round(x, digits=4):
    if isinstance(x, float):
        return float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {k: _round(v, digits) for k, v in x.items()}
    if isinstance(x, list):
        return [_round(v, digits) for v in x]
    return x


def summary(doc) -> dict:
    plan = doc["plan"]
    pred = doc["prediction"]
    return _round({
        "plan": {**{k: plan[k] for k in ("dp", "tp", "pp", "virtual_stages", "micro_batch_size",
                                         "num_micro_batches", "schedule", "recompute", "zero",
                                         "sequence_parallel")},
                 "reshard_after_forward": plan.get("reshard_after_forward", True),
                 "stages": [s["layers"] for s in plan["stages"]]},
        "prediction": {k: pred[k] for k in ("step_time_s", "tokens_per_s", "tflops_per_gpu",
                                            "mfu", "hfu", "peak_memory_bytes", "breakdown")},
        "alternatives": [[a["label"], a["prediction"]["step_time_s"]]
                         for a in doc["alternatives"]],
        "search": {"candidates": doc["search"]["candidates"],
                   "candidates_evaluated": doc["search"]["candidates_evaluated"],
                   "pruned": doc["search"]["pruned"]},
    })


_COSTS: dict[str, tuple] = {}


@pytest.fixture(autouse=True)
def _one_search_process(monkeypatch):
    """The search's counts (candidates priced, pruned by bound) depend on how many processes
    price the space: each prunes against its own k-th best (the plan does not; test_search
    checks that several processes find what one finds). The fixtures are one process's, so they
    hold on a machine with any number of cores."""
    monkeypatch.setenv("AUTOPAR_SEARCH_WORKERS", "1")


@pytest.mark.parametrize("model, cluster, n, batch, seq", CASES,
                         ids=[f"{m}-{c}-{n}" for m, c, n, _, _ in CASES])
def test_regression_plan(model, cluster, n, batch, seq):
    if model not in _COSTS:
        _COSTS[model] = capture_model_costs(model)
    report = plan_model(model, Cluster.load(cluster).with_devices(n), global_batch=batch,
                        seq=seq, top_k=4, model_costs=_COSTS[model])
    got = json.dumps(summary(report.document()), indent=1, sort_keys=True) + "\n"
    path = FIXTURES / f"{model}_{cluster}_{n}.json"
    if REGEN or not path.exists():
        if not REGEN:
            pytest.fail(f"missing fixture {path.name}; create it with AUTOPAR_REGEN_PLANS=1")
        path.write_text(got)
        return
    want = path.read_text()
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True),
                                            f"{path.name} (fixture)", "now"))
        pytest.fail(f"the plan for {model} on {n} x {cluster} changed:\n{diff}\n"
                    f"If intended, regenerate: AUTOPAR_REGEN_PLANS=1 pytest {__file__}",
                    pytrace=False)
