"""Process groups are created once per layout in a process and reused by its next models
(runtime/groups.py): a process that parallelizes model after model holds a bounded set of groups
and threads, two live models of one layout train as one process does, and a failure seen by one
rank alone makes every rank create its groups anew, together; a live model whose shared group a
failed model closed refuses its next step by name."""

from __future__ import annotations

import pytest

import groups_jobs
import parallelize_jobs as jobs
from autopar.runtime.local_pool import LocalPool
from test_parallelize import _compare

#: dp 2 x pp 2 on a tied GPT: a DeviceMesh (three dims), the pipeline's point-to-point groups and
#: the data-parallel engine's tie groups (embedding and LM head on two stages); 4 gloo groups and
#: 12 threads per closed model before the groups were shared.
PINS = dict(dp=2, pp=2, tp=1, num_micro_batches=2)


@pytest.mark.distributed
def test_models_one_after_another_share_their_groups_and_train_as_one_process():
    reference = jobs.reference("gpt")
    with LocalPool(4, timeout_s=300) as pool:
        per_rank = pool.run(groups_jobs.models_in_turn, "gpt", PINS, timeout_s=300)
    for rank, out in enumerate(per_rank):
        # the first model creates the groups; the next adds none, and no thread
        assert out["threads"][1] == out["threads"][2], (rank, out["threads"])
        assert out["groups"][1] == out["groups"][2], (rank, out["groups"])
        assert out["threads"][1] > out["threads"][0]  # the counts see the groups' threads
        assert out["same_mesh"] and out["keys_kept"], rank
        assert "closed by another model of the same layout" in out["second_after_failure"], \
            (rank, out["second_after_failure"])
        assert out["rebuilt_after_all"], rank
        assert out["rebuilt"], rank  # rank 0's failure made every rank create anew
    # fp32, the same reduction order as test_parallelize's comparisons: 1e-5
    for which, result in enumerate(per_rank[0]["two_alive"]):
        _compare(result, reference, f"live model {which}")
    _compare(per_rank[0]["after_failure"], reference, "the model after the failure")
