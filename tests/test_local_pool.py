"""The local process pool: one process group, many jobs, errors and hangs reported, not hung."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from autopar.errors import CommunicationTimeoutError
from autopar.runtime.local_pool import LocalPool, RemoteError
from autopar.runtime.mesh import ParallelMesh, coordinates

pytestmark = pytest.mark.distributed


def _all_reduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _mesh_coordinates(dp, pp, tp):
    mesh = ParallelMesh(dp, pp, tp, timeout=timedelta(seconds=7))
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.tp_group)
    # the groups are the DeviceMesh's, each with the mesh's timeout (not torch's 30 minutes)
    groups = [(getattr(mesh, f"{axis}_group"), axis) for axis in ("dp", "pp", "tp")]
    same = all(g is mesh.device_mesh.get_group(axis) for g, axis in groups if g is not None)
    timeouts = {g._get_backend(torch.device("cpu")).options._timeout for g, _ in groups
                if g is not None}
    return (mesh.dp_rank, mesh.pp_rank, mesh.tp_rank, mesh.ranks("tp"), t.item(), same,
            timeouts, mesh.pp_group is None)


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one says no")
    dist.barrier()  # the others wait for it: must not hang the test


def _hang():
    if dist.get_rank() == 0:
        time.sleep(60)
    return dist.get_rank()


def _environment(name):
    return os.environ.get(name), torch.get_num_threads()


def _unsendable():
    return lambda: dist.get_rank()  # not picklable by name


def test_a_result_that_cannot_be_sent_back_is_an_error_not_a_wait():
    """A result the queue cannot pickle (here a lambda; in the plan sweep, thousands of
    tensors shared by file descriptor: "Too many open files") was dropped by the queue's
    feeder thread, and the parent waited for its timeout (60 s here). It is pickled in the job
    now: a RemoteError naming it, at once, and the pool runs the next job."""
    with LocalPool(2, timeout_s=60) as pool:
        start = time.perf_counter()
        with pytest.raises(RemoteError, match="could not be sent back"):
            pool.run(_unsendable)
        assert time.perf_counter() - start < 10.0
        assert pool.run(_all_reduce_rank) == [1.0, 1.0]


def test_pools_start_in_a_blink_and_see_the_parents_environment_of_their_start(monkeypatch):
    """Workers are forked from a server that imported torch and autopar once: a pool of 4
    starts and closes in well under a second once the server runs (spawned interpreters took
    ~6 s on two cores). Each sees the parent's environment as it was when its pool started,
    not the server's (started earlier, under other variables)."""
    with LocalPool(2, timeout_s=60) as pool:  # the server is running from here on
        pool.run(_environment, "HOME")
    monkeypatch.setenv("AUTOPAR_POOL_PROBE", "one")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    start = time.perf_counter()
    with LocalPool(4, timeout_s=60) as pool:
        seen = pool.run(_environment, "AUTOPAR_POOL_PROBE")
    assert time.perf_counter() - start < 3.0  # generous: ~0.1 s measured, 6.3 s spawned
    assert seen == [("one", 1)] * 4  # one thread each, whatever OMP_NUM_THREADS says
    monkeypatch.delenv("AUTOPAR_POOL_PROBE")
    with LocalPool(2, timeout_s=60) as pool:
        assert pool.run(_environment, "AUTOPAR_POOL_PROBE") == [(None, 1)] * 2


def _imported(names):
    import sys

    return [name in sys.modules for name in names]


def test_workers_fork_with_the_preloaded_modules_imported():
    """The forkserver imports PRELOAD (dynamo and export: every capture needs them) and what
    $AUTOPAR_POOL_PRELOAD names (tests/conftest.py: transformers' GPT-2, LLaMA and BERT, ~1.5 s
    of CPU per worker each pool would repeat), so a job finds them imported."""
    from autopar.runtime import local_pool

    names = ["torch._dynamo", "transformers.models.gpt2.modeling_gpt2"]
    assert names[1] in os.environ[local_pool.PRELOAD_ENV].split(",")
    assert all(n in local_pool.PRELOAD for n in ("torch._dynamo", "torch.export"))
    with LocalPool(2, timeout_s=60) as pool:
        assert pool.run(_imported, names) == [[True, True]] * 2


def test_jobs_share_one_group():
    with LocalPool(2, timeout_s=60) as pool:
        assert pool.run(_all_reduce_rank) == [1.0, 1.0]
        pids = pool._procs[0].pid
        assert pool.run(_all_reduce_rank) == [1.0, 1.0]
        assert pool._procs[0].pid == pids


def test_mesh_layout_tp_innermost():
    with LocalPool(4, timeout_s=60) as pool:
        out = pool.run(_mesh_coordinates, 2, 1, 2)
    for rank, (d, p, t, tp_ranks, reduced, same, timeouts, no_pp) in enumerate(out):
        assert (d, p, t) == coordinates(rank, 2, 1, 2)
        assert tp_ranks == (rank - rank % 2, rank - rank % 2 + 1)
        assert reduced == 2.0
        assert same and timeouts == {timedelta(seconds=7)} and no_pp


def test_failure_on_one_rank_is_reported_not_hung():
    pool = LocalPool(2, timeout_s=60, collective_timeout_s=20)
    start = time.monotonic()
    with pytest.raises(RemoteError, match="rank one says no"):
        pool.run(_fail_on_rank_one)
    assert time.monotonic() - start < 45
    assert pool.run(_all_reduce_rank) == [1.0, 1.0]  # restarted
    pool.close()


def test_hang_becomes_timeout_error():
    pool = LocalPool(2, timeout_s=60)
    pool.start()
    with pytest.raises(CommunicationTimeoutError, match="silent"):
        pool.run(_hang, timeout_s=5)
    pool.close()
