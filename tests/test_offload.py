"""Optimizer state offloaded (``Plan.offload``): to host memory ("optimizer", ZeRO-Offload) or to
files ("disk", ZeRO-Infinity's NVMe path; runtime/offload.py).

The reference is the same plan without offload: the same element-wise update on the same values
(bucket by bucket instead of all at once, from a separate host copy of the master weights), so
losses and every parameter must be equal bit for bit, at each ZeRO stage, with and without mixed
precision, and through a pipeline. The memory the state takes is counted from the tensors: with
"disk", between steps only the master weights stay in memory (Adam's two fp32 moments, 8 bytes
per parameter, are in the files), and the files are gone after ``close``. Bad storage is an
OffloadError before training (a directory that cannot be created) or at the failing step (a disk
too small, a write that fails), with nothing half-written left.
"""

from __future__ import annotations

import errno
import functools

import pytest
import torch

import autopar
from autopar import InvalidInputError, OffloadError, OptimizerProfile
from autopar.runtime.local_pool import LocalPool

import offload_jobs as jobs
from parallelize_jobs import EPS, LR, batches, make_model

#: (dp, pp, zero, mixed precision): every ZeRO stage, both precisions, and a pipeline.
SHAPES = [(2, 1, 0, False), (2, 1, 1, True), (2, 1, 2, False), (2, 1, 3, True), (1, 2, 0, False)]


@pytest.mark.distributed
def test_offloaded_training_equals_the_step_in_memory(tmp_path):
    # "optimizer" on a CPU process is the in-memory state (the device is the host) stepped as
    # an offloaded one is, bucket by bucket after the reductions (DataParallel._host_step): at
    # every shape, the master weights a tensor of their own under mixed precision
    configs, compared = [], []
    for dp, pp, zero, mixed in SHAPES:
        modes = ("none", "disk", "optimizer")
        base = len(configs)
        for offload in modes:
            pins = dict(dp=dp, pp=pp, tp=1, num_micro_batches=2, zero=zero, offload=offload)
            configs.append(("gpt", pins, mixed))
        compared += [(base, base + j, offload) for j, offload in enumerate(modes) if j]
    with LocalPool(2, timeout_s=300) as pool:
        per_rank = pool.run(jobs.train, configs, str(tmp_path), timeout_s=600)
    assert {offload for _, _, offload in compared} == {"disk", "optimizer"}
    for i, k, offload in compared:
        base = per_rank[0][i]
        what = (configs[k][1], configs[k][2])
        got = per_rank[0][k]
        assert got["losses"] == base["losses"], what
        for key, want in base["state"].items():
            assert torch.equal(got["state"][key], want), (what, key)
        for r, rank in enumerate(per_rank):
            result = rank[k]
            # a master copy of its own under mixed precision; in fp32 on a CPU (the device
            # is the host) the optimizer updates the parameters' own storage, as without
            # offload
            assert result["separate"] == configs[k][2], what
            masters = result["masters"] if result["separate"] else 0
            assert result["gone"], what  # close removed this rank's files
            if offload == "disk":
                # in memory: the master weights (and Adam's step counts); on disk: two fp32
                # moments per master element, one file per bucket with parameters
                assert result["memory"]["disk"] == 2 * result["masters"], (what, r)
                assert masters <= result["memory"]["optimizer"] < masters + 4096, (what, r)
                assert len(result["files"]) == result["buckets"] > 1, (what, r)
            else:
                assert "disk" not in result["memory"], what
                # the master and two moments in (host) memory
                assert result["memory"]["optimizer"] >= masters + 2 * result["masters"], \
                    (what, r)


def _single(tmp_path, offload: str, **kwargs):
    model, loss_fn = make_model("gpt")
    data = batches("gpt", 1)
    pins = {"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 1, "offload": offload}
    return autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                               loss_fn=loss_fn, plan=pins, bucket_mb=0.05,
                               optimizer=functools.partial(torch.optim.AdamW, lr=LR, eps=EPS),
                               **kwargs)


def test_a_checkpoint_of_offloaded_state_resumes_exactly(tmp_path):
    """Saved after 2 steps with the state on disk, loaded into a fresh disk-offloaded model,
    2 more steps: the losses and parameters of 4 uninterrupted steps without offload."""
    data = batches("gpt", 4)
    plain = _single(tmp_path, "none")
    want = [plain.train_step(x, y) for x, y in data]
    want_state = plain.state_dict()
    plain.close()
    first = _single(tmp_path, "disk", offload_dir=tmp_path / "a")
    got = [first.train_step(x, y) for x, y in data[:2]]
    first.save(str(tmp_path / "ckpt"))
    first.close()
    second = _single(tmp_path, "disk", offload_dir=tmp_path / "b")
    second.load(str(tmp_path / "ckpt"))
    assert second.memory_bytes()["disk"] > 0  # the loaded state went back to the files
    got += [second.train_step(x, y) for x, y in data[2:]]
    assert got == want
    for key, value in second.state_dict().items():
        assert torch.equal(value, want_state[key]), key
    second.close()


def test_bad_offload_storage_is_named(tmp_path, monkeypatch):
    from autopar.runtime import offload

    with pytest.raises(InvalidInputError, match="offload_dir"):
        _single(tmp_path, "disk")  # no directory given
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(OffloadError, match="cannot be written") as err:
        _single(tmp_path, "disk", offload_dir=blocker / "state")  # before any training
    assert "offload_dir" in err.value.fix
    data = batches("gpt", 1)[0]
    # a disk too small: refused at the first step, before anything is written
    pm = _single(tmp_path, "disk", offload_dir=tmp_path / "small")
    monkeypatch.setattr(offload.shutil, "disk_usage",
                        lambda path: type("U", (), {"free": 1000})())
    with pytest.raises(OffloadError, match="too small"):
        pm.train_step(*data)
    assert not list(pm.data_parallel.pager.root.glob("*.bin"))
    pm.close()
    monkeypatch.undo()
    # a write that fails (the disk filled up meanwhile): at that step, the partial file removed

    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).endswith(".bin"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    pm = _single(tmp_path, "disk", offload_dir=tmp_path / "fills")
    monkeypatch.setattr(offload, "open", full_disk, raising=False)
    with pytest.raises(OffloadError, match="full"):
        pm.train_step(*data)
    assert not list(pm.data_parallel.pager.root.glob("*.bin"))
    monkeypatch.undo()
    pm.close()
    assert not (tmp_path / "fills").exists() or not any((tmp_path / "fills").rglob("*.bin"))


# -- the cost model and the search ------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_costs():
    from autopar import capture, models
    from autopar.planner.cost_model import ModelCosts

    zm = models.build("gpt2-small", device="meta", vocab=50304, seq=1024)
    inputs, targets = zm.example_inputs(batch=2, seq=64)
    captured = capture(zm.model, inputs, zm.loss_fn, example_targets=targets)
    return zm, ModelCosts(captured)


def _candidate(dp, zero, offload, recompute="full"):
    from autopar.plan_types import RecomputeKind, ScheduleKind
    from autopar.planner.candidates import Candidate

    return Candidate(dp, 1, 1, 1, 1, ScheduleKind.ONE_F_ONE_B, RecomputeKind(recompute), zero,
                     False, offload=offload)


def _pipelined(down, step, up, buckets):
    """Three stages over ``buckets`` equal items, each stage taking them in order."""
    stages = (down, step, up)
    return sum(stages) / buckets + (buckets - 1) / buckets * max(stages)


@pytest.mark.parametrize("zero", [0, 3])
def test_offloaded_state_and_step_are_priced_from_the_cluster(gpt2_costs, zero):
    """Device memory: ZeRO's model states (Rajbhandari et al. 2020) less what offload moves to
    the host: on a GPU all optimizer bytes (12 per parameter in mixed precision). Step: the
    closed form of what the runtime does, from the preset's PCIe, host-memory and disk
    bandwidths: fp32 gradients out and bf16 weights back over PCIe, 84 bytes of host memory
    traffic per parameter (torch's for-loop AdamW: 8 ops over fp32 arrays) shared by the node's
    8 GPUs, and with "disk" the two fp32 moments read and written at the node's disk bandwidth,
    overlapped with the host step; the copies down, the steps and the copies up pipelined over
    the rank's 25 MiB gradient buckets (ceil(P / 6.55M) of them)."""
    import math

    from autopar.planner.memory import BUCKET_ELEMENTS
    from autopar.planner.cost_model import CostModel, TrainingSetup

    zm, costs = gpt2_costs
    cl = autopar.Cluster.load("a100-80g").with_devices(8)
    cm = CostModel(costs, cl, TrainingSetup(64, 1024))
    P = sum(p.numel() for p in zm.model.parameters())
    local = P / 8 if zero else P
    base = cm.evaluate(_candidate(8, zero, "none"))
    for offload in ("optimizer", "disk"):
        ev = cm.evaluate(_candidate(8, zero, offload))
        rank, ref = ev.ranks[0], base.ranks[0]
        assert ref.optimizer == pytest.approx(12 * local, rel=1e-9)
        assert rank.optimizer == 0 and rank.weights == ref.weights
        host = 84 * local * 8 / 409.6e9
        if offload == "disk":
            host = max(host, 2 * 8 * local * 8 / 15.2e9)
        buckets = math.ceil(P / BUCKET_ELEMENTS)
        want = _pipelined(local * 4 / 25e9, host, local * 2 / 25e9, buckets)
        assert buckets == 19  # GPT-2 small's 124M parameters
        assert ev.prediction.breakdown["optimizer_s"] == pytest.approx(want, rel=1e-9)
        assert ev.step_time_s > base.step_time_s


def test_a_measured_host_optimizer_prices_the_offloaded_step(gpt2_costs):
    """With the host's AdamW measured (``host_optimizer_s_per_param`` and ``_per_tensor``, as
    ``autopar calibrate --device cuda`` writes them), the host step is the longer of the memory
    traffic and the measured time, the node's 8 devices stepping one after another: in closed
    form, 8 x (P x per_param + T x per_tensor) for a rank's P parameters in T tensors, in the
    pipeline of the copies over its buckets. The fused kernel (``AdamW(fused=True)``, not
    measured) at its 28 bytes per parameter."""
    import dataclasses

    from autopar.planner.cost_model import CostModel, TrainingSetup

    zm, costs = gpt2_costs
    preset = autopar.Cluster.load("a100-80g").with_devices(8)
    P = sum(p.numel() for p in zm.model.parameters())
    T = len(list(zm.model.parameters()))
    for per_param, per_tensor, host in ((3.6e-9, 1e-4, 8 * (3.6e-9 * P + 1e-4 * T)),
                                        (1e-12, 0.0, 84 * P * 8 / 409.6e9)):  # memory-bound
        cl = dataclasses.replace(preset, host_optimizer_s_per_param=per_param,
                                 host_optimizer_s_per_tensor=per_tensor)
        cm = CostModel(costs, cl, TrainingSetup(64, 1024))
        ev = cm.evaluate(_candidate(8, 0, "optimizer"))
        want = _pipelined(P * 4 / 25e9, host, P * 2 / 25e9, 19)
        assert ev.prediction.breakdown["optimizer_s"] == pytest.approx(want, rel=1e-9)
    # torch's fused AdamW on the host (not measured: its 28 bytes per parameter)
    cm = CostModel(costs, preset, TrainingSetup(64, 1024, optimizer=OptimizerProfile("fused")))
    ev = cm.evaluate(_candidate(8, 0, "optimizer"))
    want = _pipelined(P * 4 / 25e9, 28 * P * 8 / 409.6e9, P * 2 / 25e9, 19)
    assert ev.prediction.breakdown["optimizer_s"] == pytest.approx(want, rel=1e-9)


def test_the_search_offloads_only_where_memory_requires_it(gpt2_costs):
    """GPT-2 small in fp32 on 8 processes of a host whose memory holds its weights and gradients
    but not its Adam moments as well: without offload nothing fits at dp 8 and ZeRO-0 (pinned),
    so the search puts the moments on disk (the only offload that saves memory where the device
    is the host); given room, it does not offload; without "disk" among the choices it finds
    nothing."""
    from autopar.errors import InfeasiblePlanError
    from autopar.planner.cost_model import CostModel, TrainingSetup
    from autopar.planner.search import SearchSpace, search

    zm, costs = gpt2_costs
    P = sum(p.numel() for p in zm.model.parameters())
    roomy = autopar.Cluster.load("cpu").with_devices(8)
    pins = dict(dp=8, tp=1, pp=1, zero=0, recompute="full", micro_batch_size=1)
    setup = TrainingSetup(8, 256, "fp32")
    plain = CostModel(costs, roomy, setup).evaluate(_candidate(8, 0, "none"))
    # fp32 Adam: 16 bytes per parameter in memory; with the moments on disk, 8: a device 2
    # bytes per parameter short of the plain plan
    data = autopar.Cluster.load("cpu").to_json()
    data["device"]["memory_bytes"] = plain.prediction.peak_memory_bytes - 2 * P
    tight = autopar.Cluster.from_json(data).with_devices(8)
    best = search(CostModel(costs, tight, setup), SearchSpace(**pins), top_k=1, refine=0).best
    assert best.candidate.offload == "disk" and best.plan.offload == "disk"
    assert search(CostModel(costs, roomy, setup), SearchSpace(**pins), top_k=1,
                  refine=0).best.candidate.offload == "none"
    with pytest.raises(InfeasiblePlanError):
        search(CostModel(costs, tight, setup),
               SearchSpace(**pins, offload_choices=("optimizer",)), top_k=1, refine=0)


def test_the_plan_field_and_pin():
    from autopar import InvalidPlanError, Plan
    from autopar.agreement import validate_pins

    assert Plan.from_json(Plan(offload="disk").to_json()).offload == "disk"
    assert "offload" not in Plan().to_json()  # the default is not written
    with pytest.raises(InvalidPlanError, match="offload"):
        Plan(offload="tape")
    with pytest.raises(InvalidPlanError, match="offload"):
        validate_pins({"offload": "nvme"}, 2)
