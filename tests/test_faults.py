"""Faults on real gloo processes: a planning error on rank 0 reaches every rank as itself, a rank
that stops answering or dies makes the others raise CommunicationTimeoutError naming this rank,
its (dp, pp, tp) coordinates, what it was doing and the collective, within the timeout. Never a
hang: every job has a timeout, and the pool reports what the survivors saw."""

from __future__ import annotations

from datetime import timedelta

import pytest

from autopar.runtime import comm
from autopar.runtime.local_pool import LocalPool, RemoteError

import reliability_jobs as jobs

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

#: Collective timeout of the faulty jobs (parallelize(timeout_s=...)): short, but far above
#: what a tiny model's collective takes on a loaded 2-core runner.
TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def pool2():
    pool = LocalPool(2, timeout_s=180, death_grace_s=10)
    yield pool
    pool.close()


def test_rank0_planning_error_is_raised_on_every_rank_as_itself(pool2):
    # global batch 8 does not split into micro-batches of 3: found on rank 0, while planning
    out = pool2.run(jobs.planning_error_everywhere,
                    {"dp": 1, "tp": 1, "pp": 2, "micro_batch_size": 3})
    assert out[0] == out[1], out
    assert out[0][0] == "InvalidInputError" and "does not split as pinned" in out[0][1]


def test_a_rank_that_fails_to_build_its_program_stops_every_rank_at_once(pool2):
    """pp=2: rank 1's compile fails (injected). Every rank learns it before the mesh's
    collectives: rank 1 raises its own error, rank 0 the same class and message naming rank 1,
    both in seconds, where rank 0 used to wait the whole collective timeout (30 s here) for a
    peer that had given up and then report a timeout."""
    out = pool2.run(jobs.construction_error, {"dp": 1, "tp": 1, "pp": 2}, 1, 30.0)
    (kind0, seconds0, message0), (kind1, _, message1) = out
    assert kind0 == kind1 == "PassError", out
    assert message0.startswith("rank 1 failed building its program and shards: injected"), out
    assert message1.startswith("injected") and "fix:" in message0, out
    assert seconds0 < 15, out  # the capture and compile only; the timeout is 30 s


@pytest.mark.parametrize("culprit", [0, 1])
def test_a_rank_that_fails_before_the_plan_stops_every_rank_at_once(culprit):
    """pp=2: one rank's capture fails (injected), before the plan. Rank 1 failing leaves rank 0
    planning and then waiting in the plan's broadcast; rank 0 failing leaves rank 1 waiting for
    the plan. The waiting rank stops within seconds naming the culprit's error, where it had
    waited the whole collective timeout (30 s here). Its default process group now holds the
    broadcast it gave up on, which the next model's first collective would pair with (gloo
    aborted the process on the size mismatch): the next parallelize refuses by name there,
    and the culprit, waiting for it, stops within seconds, by the announcement or because the
    stale operation's gloo pair ended the refusing process. A pool of its own (two fresh
    processes): these leave their group unusable."""
    with LocalPool(2, timeout_s=180, death_grace_s=10) as pool:
        out = pool.run(jobs.capture_error, {"dp": 1, "tp": 1, "pp": 2}, culprit, 30.0)
        waiting = out[1 - culprit]
        assert out[culprit][0] == "UntraceableModelError", out
        assert waiting[0] == "CommunicationTimeoutError", out
        assert "a peer failed" in waiting[2] and f"rank {culprit}" in waiting[2], out
        assert "injected: this rank's model does not trace" in waiting[2], out
        assert waiting[1] < 15, out  # the capture only; the timeout is 30 s
        again = pool.run(jobs.parallelize_once, {"dp": 1, "tp": 1, "pp": 2}, 30.0)
    assert again[1 - culprit][0] == "CommunicationTimeoutError", again
    assert "cannot start another model" in again[1 - culprit][2], again
    assert "the broadcast of rank 0's plan" in again[1 - culprit][2], again
    assert again[culprit][0] == "CommunicationTimeoutError", again
    assert ("a peer failed" in again[culprit][2] or "lost a peer" in again[culprit][2]) \
        and again[culprit][1] < 15, again


def test_an_offload_directory_one_rank_cannot_write_stops_every_rank_at_once(pool2, tmp_path):
    """dp=2 with the optimizer state on disk: rank 1's directory cannot be created (one node's
    disk). It is checked with the program, before the mesh: rank 1 raises its OffloadError,
    rank 0 the same naming rank 1, in seconds rather than at the collective timeout (30 s)."""
    out = pool2.run(jobs.offload_dir_fails_on_one_rank,
                    {"dp": 2, "tp": 1, "pp": 1, "zero": 1, "offload": "disk"}, 1, 30.0,
                    str(tmp_path))
    (kind0, seconds0, message0), (kind1, _, message1) = out
    assert kind0 == kind1 == "OffloadError", out
    assert message0.startswith("rank 1 failed building its program and shards: the offload "
                               "directory cannot be written"), out
    assert "a-file" in message1 and "offload_dir" in message0, out
    assert seconds0 < 15, out
    assert not list((tmp_path / "state").iterdir())  # rank 0's probe left nothing behind


def test_a_rank_that_stops_answering_times_out_the_others(pool2):
    """tp=2: rank 1 sleeps before its second step; rank 0 waits in a tensor-parallel collective
    and must give up after TIMEOUT_S, naming itself and the collective."""
    # (the timed-out collective was on that job's own tensor-parallel group: the pool's world
    # group stays usable for the next job)
    out = pool2.run(jobs.stop_answering, {"dp": 1, "tp": 2, "pp": 1, "num_micro_batches": 1},
                    1, TIMEOUT_S, TIMEOUT_S + 3)
    kind, seconds, message = out[0]
    assert kind == "CommunicationTimeoutError", out
    assert TIMEOUT_S - 0.1 <= seconds < TIMEOUT_S + 2.5, seconds
    assert "rank 0 (dp 0, pp 0, tp 0) timed out on tensor-parallel" in message
    assert "pipeline stage 0 forward of micro-batch 0" in message and "fix:" in message
    assert out[1][0] == "slept"


def test_a_rank_that_stops_answering_times_out_the_others_under_stream_waits(pool2):
    """The same under NCCL's way of waiting (runtime/comm.py: ``work.wait()`` with no timeout,
    so the host never blocks on a collective): the deadline is then the groups' own timeout,
    which every group the mesh creates carries, and the error is still named."""
    out = pool2.run(jobs.stop_answering, {"dp": 1, "tp": 2, "pp": 1, "num_micro_batches": 1},
                    1, TIMEOUT_S, TIMEOUT_S + 3, True)
    kind, seconds, message = out[0]
    assert kind == "CommunicationTimeoutError", out
    assert TIMEOUT_S - 0.1 <= seconds < TIMEOUT_S + 2.5, seconds
    assert "rank 0 (dp 0, pp 0, tp 0) timed out on tensor-parallel" in message, message


@pytest.mark.parametrize("pins", [{"dp": 2, "tp": 1, "pp": 1, "num_micro_batches": 1},
                                  {"dp": 1, "tp": 2, "pp": 1, "num_micro_batches": 1}],
                         ids=["dp2", "tp2"])
def test_a_rank_that_fails_alone_stops_its_peers_at_once(pool2, pins):
    """Rank 1's stage raises (injected) while its process lives on, so gloo keeps its
    connections open and nothing closes under rank 0, which waits on the gradient reduction
    (dp=2) or on a tensor-parallel all-reduce (tp=2). Rank 1 announces its failure through the
    job's store; rank 0, looking between one-second slices of its wait, stops in seconds with
    rank 1's error named, where it used to wait the whole timeout (12 s here)."""
    out = pool2.run(jobs.fail_alone, pins, 1, 12.0)
    (kind0, seconds0, message0), (kind1, _, message1) = out
    assert kind1 == "StageExecutionError" and "injected" in message1, out
    assert kind0 == "CommunicationTimeoutError", out
    assert message0.startswith("rank 0 (dp 0, pp 0, tp 0) stopped waiting on"), message0
    assert "a peer failed" in message0 and "fix:" in message0, message0
    assert "rank 1 (dp " in message0 and "StageExecutionError" in message0, message0
    assert "(found: RuntimeError: injected" in message0, message0
    assert seconds0 < 6, out


def test_a_rank_that_fails_creating_its_engine_stops_its_peers_at_once(pool2):
    """dp=2: rank 1 runs out of memory (injected) creating its data-parallel engine, after the
    mesh is made; rank 0, in the collective that follows, stops in seconds with rank 1's
    error named, where it used to wait the whole timeout (20 s here)."""
    out = pool2.run(jobs.engine_error, {"dp": 2, "tp": 1, "pp": 1}, 1, 20.0)
    (kind0, seconds0, message0), (kind1, seconds1, message1) = out
    assert kind1 == "OutOfMemoryError" and "injected" in message1, out
    assert kind0 == "CommunicationTimeoutError" and "a peer failed" in message0, out
    assert "rank 1 (dp 1, pp 0, tp 0) failed" in message0 and "OutOfMemoryError" in message0, out
    assert seconds0 - seconds1 < 5, out  # a second after rank 1 raised (6.6 and 5.6 s)


def test_indexes_beyond_the_vocabulary_are_refused_before_the_step(pool2):
    """Token ids (above and below the vocabulary) and targets outside it: one process raises
    (an embedding's IndexError, the loss's out-of-bounds target); under tp=2 the
    vocabulary-parallel lookup and loss mask every row a rank does not hold and the padded
    vocabulary (128 -> 256 rows) has rows beyond the model's, where such ids read zeros
    silently. Every rank refuses the batch by name before the step, and the model stays
    usable: a good step's loss then equals one process's (fp32, the first step: 1e-5)."""
    for rank, (out, good, want) in enumerate(pool2.run(jobs.indexes_out_of_range,
                                                       {"dp": 1, "tp": 2, "pp": 1})):
        assert set(out) == {"token", "target", "negative token"}
        for case, (reference, kind, message) in out.items():
            assert reference != "no error", (rank, case)
            assert kind == "InvalidInputError", (rank, case, kind, message)
            assert "indexes outside" in message and "(128 rows)" in message, message
            assert "fix:" in message
        assert abs(good - want) < 1e-5, (good, want)


class _RecordedWork:
    """A collective's work object that records how it was waited."""

    def __init__(self) -> None:
        self.waits: list[tuple] = []

    def wait(self, *args: object) -> bool:
        self.waits.append(args)
        return True


@pytest.mark.timeout(10)
def test_waits_block_the_host_with_a_deadline_unless_waited_on_the_stream():
    """gloo's collectives run on the host: waited with the deadline. NCCL's are waited on the
    stream (no timeout given: a timeout would make torch block the host until the collective
    finished, pytorch/pytorch#100162)."""
    before = comm.stream_waits()
    try:
        comm.set_stream_waits(False)
        work = _RecordedWork()
        comm.wait_work(work, "an all-reduce", 7.0)
        # in slices: between them it looks for a peer's announced failure
        assert work.waits == [(timedelta(seconds=comm.FAILURE_POLL_S),)]
        comm.set_stream_waits(True)
        work = _RecordedWork()
        comm.wait_work(work, "an all-reduce", 7.0)
        assert work.waits == [()]
    finally:
        comm.set_stream_waits(before)


def test_a_rank_that_dies_makes_the_others_exit_with_a_named_error(pool2):
    """dp=2: rank 1 exits abruptly; rank 0's gradient reduction loses its peer and raises."""
    with pytest.raises(RemoteError) as err:
        pool2.run(jobs.die, {"dp": 2, "tp": 1, "pp": 1, "num_micro_batches": 1}, 1, TIMEOUT_S,
                  timeout_s=120)
    text = str(err.value)
    assert "rank(s) [1] died" in text
    assert "CommunicationTimeoutError: rank 0 (dp 0, pp 0, tp 0) lost a peer on" in text


@pytest.mark.timeout(10)
def test_a_failure_is_announced_once_per_scope(monkeypatch):
    """The first failure a scope announces is the one named (later ones, its echoes, are not
    written over it); a new scope (the ranks agreeing on their groups for the next model) reads
    none of the old ones."""
    import torch.distributed as dist

    store = dist.HashStore()
    monkeypatch.setattr(comm, "_store", lambda: store)
    comm.new_failure_scope()
    assert comm.announced_failure() is None
    with comm.activity("pipeline stage 0 forward of micro-batch 0"):
        comm.announce_failure(RuntimeError("out of memory\n  found: 2 GiB asked"))
    comm.announce_failure(RuntimeError("its echo"))
    text = comm.announced_failure()
    assert text is not None and text.endswith(
        "failed during pipeline stage 0 forward of micro-batch 0: RuntimeError: out of memory "
        "(found: 2 GiB asked)"), text
    comm.new_failure_scope()
    assert comm.announced_failure() is None


@pytest.mark.timeout(10)
def test_a_call_without_an_async_form_fails_by_name():
    """torch's object collectives and new_group wait inside torch with the group's timeout: a
    failure there is the same named error as a waited collective's, never torch's own."""
    from autopar.errors import CommunicationTimeoutError

    with pytest.raises(CommunicationTimeoutError, match="lost a peer on the exchange of") as err:
        with comm.blocking("the exchange of the tied parameters' layout", 5.0):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    assert "fix:" in str(err.value)
    with pytest.raises(CommunicationTimeoutError, match="timed out on the creation of"):
        with comm.blocking("the creation of the p2p process groups", 5.0):
            raise RuntimeError("Timed out waiting 5000ms for send operation to complete")
