"""Checkpoints: saved under one plan and world size, loaded under another, training continues as
if uninterrupted; loading another model's checkpoint is refused; nothing pickled is loaded.

The resharding test saves at world 4 as (dp, pp, tp) = (2, 2, 1) with ZeRO-2 and tiny buckets
(ZeRO shards cut parameters mid-row), then loads at world 2 as (1, 1, 2) ZeRO-0 and (2, 1, 1)
ZeRO-3, and at world 4 as (1, 2, 2) with twice the micro-batches, on the project's own GPT and
HF GPT-2 (fused c_attn: a strided tensor-parallel shard; its world-2 ZeRO-3 load is left to the
own GPT to save time). At world 4, GPT-2 resumes as a model built on the meta device handed
to ``parallelize(checkpoint=<the directory>)``: no weights anywhere but the checkpoint's, the
optimizer state and step count restored with them. Right after loading, every parameter
equals the saved one bit for bit (a load is a copy). After the remaining AdamW steps, losses and
parameters equal the uninterrupted single-process run within the tolerance of
tests/test_parallelize.py: 1e-5 (reduction order moves fp32 results by ~1e-7 per step; Adam's
epsilon 1e-5 keeps that from being magnified; a lost optimizer state or a misplaced block moves
parameters by O(lr) = 1e-3).
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import shutil

import pytest
import torch

import autopar
from autopar import InvalidInputError, PlanMismatchError
from autopar.runtime import checkpoint

import checkpoint_jobs as jobs
from parallelize_jobs import make_model, reference

MODELS = ("own_gpt", "gpt")
SAVE = dict(dp=2, pp=2, tp=1, schedule="1f1b", num_micro_batches=2, zero=2)
LOAD_WORLD2 = [dict(dp=1, pp=1, tp=2, num_micro_batches=1, zero=0),
               dict(dp=2, pp=1, tp=1, num_micro_batches=2, zero=3)]
LOAD_WORLD4 = dict(dp=1, pp=2, tp=2, schedule="1f1b", num_micro_batches=4, zero=1)


def _assert_resumed(result, saved, ref, what):
    ref_losses, ref_state = ref["losses"], ref["state"]
    for key, want in saved["state"].items():
        assert torch.equal(result["loaded"][key], want), f"{what}: {key} changed by save/load"
    assert result["steps"] == jobs.SAVED_AT, what
    assert result["losses"] == pytest.approx(ref_losses[jobs.SAVED_AT:], rel=1e-5), what
    for key, want in ref_state.items():
        if torch.is_floating_point(want) and key in result["final"]:
            torch.testing.assert_close(result["final"][key], want, rtol=0, atol=1e-5,
                                       msg=f"{what}: {key}")


@pytest.mark.distributed
def test_checkpoint_loads_under_another_plan_and_world_size(shared_pool4, shared_pool2, tmp_path):
    root = str(tmp_path)
    refs = {name: reference(name, steps=jobs.TOTAL) for name in MODELS}
    pool = shared_pool4
    saved = pool.run(jobs.train_and_save, [(n, SAVE) for n in MODELS], root)[0]
    # GPT-2 resumes as a model on meta: parallelize(checkpoint=) restores everything
    world4 = pool.run(jobs.load_and_continue,
                      [(n, LOAD_WORLD4, n == "gpt") for n in MODELS], root)[0]
    # GPT-2 skips the (2, 1, 1) ZeRO-3 load, which the own GPT covers (time: ~3 s)
    configs = [(n, pins) for n in MODELS for pins in LOAD_WORLD2][:3]
    world2 = shared_pool2.run(jobs.load_and_continue, configs, root)[0]
    for i, name in enumerate(MODELS):
        assert saved[i]["losses"] == pytest.approx(refs[name]["losses"][:jobs.SAVED_AT], rel=1e-5)
        _assert_resumed(world4[i], saved[i], refs[name], f"{name} -> world 4 {LOAD_WORLD4}")
    for (name, pins), result in zip(configs, world2):
        _assert_resumed(result, saved[MODELS.index(name)], refs[name], f"{name} -> {pins}")
    # the format: full shapes under the model's names, one set of blocks covering each tensor
    metadata = checkpoint.read_metadata(os.path.join(root, "gpt"))
    entries = metadata.state_dict_metadata
    weight = "model/transformer.h.0.attn.c_attn.weight"
    assert tuple(entries[weight].size) == (64, 192)
    assert tuple(entries["optim/exp_avg/transformer.h.0.attn.c_attn.weight"].size) == (64, 192)
    assert tuple(entries["optim/step/transformer.h.0.attn.c_attn.weight"].size) == ()
    tied = {"model/lm_head.weight", "model/transformer.wte.weight"}
    assert len(tied & set(entries)) == 1  # a tied weight is stored once


# -- one process: errors, safety, directories -------------------------------------------------
@pytest.fixture(scope="module")
def saved_own_gpt(tmp_path_factory):
    """A world-1 own-GPT ParallelModel trained one step and saved."""
    path = str(tmp_path_factory.mktemp("ckpt") / "own")
    pm = _single("own_gpt")
    pm.train_step(*jobs.batches("own_gpt", 1)[0])
    pm.save(path)
    yield pm, path
    pm.close()


def _single(name: str, **kwargs):
    model, loss_fn = make_model(name) if not kwargs else _own_gpt(**kwargs)
    data = jobs.batches(name, 1)
    return autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                               loss_fn=loss_fn, plan={"dp": 1, "tp": 1, "pp": 1,
                                                      "num_micro_batches": 1},
                               optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))


def _own_gpt(**overrides):
    from conftest import build_own_gpt

    return build_own_gpt(**overrides)


def test_loading_another_model_is_refused(saved_own_gpt, tmp_path):
    pm, path = saved_own_gpt
    other = _single("own_gpt", hidden=32)
    with pytest.raises(PlanMismatchError, match=r"another model[\s\S]*shapes differ: blocks.0."
                                                r"attn.proj.bias \(64,\) in the checkpoint, "
                                                r"\(32,\) here"):
        other.load(path)
    other.close()
    gpt2 = _single("gpt")
    with pytest.raises(PlanMismatchError, match="parameters not in the checkpoint: "
                                                r"\['transformer"):
        gpt2.load(path)
    gpt2.close()
    with pytest.raises(InvalidInputError, match="no checkpoint at"):
        pm.load(str(tmp_path / "nowhere"))
    # same names and shapes, another graph: refused unless strict=False
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    sidecar = json.loads((copy / checkpoint.SIDECAR).read_text())
    sidecar["model_fingerprint"] = "0" * 16
    (copy / checkpoint.SIDECAR).write_text(json.dumps(sidecar))
    with pytest.raises(PlanMismatchError, match="another model graph"):
        pm.load(str(copy))
    pm.load(str(copy), strict=False)
    (copy / checkpoint.COMPLETE).unlink()
    with pytest.raises(InvalidInputError, match="incomplete"):
        pm.load(str(copy))


def test_checkpoint_holds_no_pickled_objects(saved_own_gpt, tmp_path):
    """Non-tensor payloads are JSON; DCP's index is read with an allow-list unpickler, which
    refuses anything else (here, a pickle that would call os.system)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    pm, path = saved_own_gpt
    entries = checkpoint.read_metadata(path).state_dict_metadata
    assert entries and not any(isinstance(m, BytesStorageMetadata) for m in entries.values())
    assert json.loads(open(os.path.join(path, checkpoint.SIDECAR)).read())["steps"] == 1
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    pm.train_step(*jobs.batches("own_gpt", 2)[1])
    pm.load(path)  # through the safe reader, and back to the saved parameters
    assert pm.steps == 1
    assert all(torch.equal(pm.state_dict()[k], v) for k, v in before.items())

    class Exploit:
        def __reduce__(self):
            return (os.system, ("echo pwned > /dev/null",))

    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    (bad / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(InvalidInputError, match="outside DCP's metadata classes"):
        pm.load(str(bad))


def test_latest_skips_incomplete_checkpoints(saved_own_gpt, tmp_path):
    pm, path = saved_own_gpt
    root = tmp_path / "run"
    assert checkpoint.latest(str(root)) is None and pm.load_latest(str(root)) is None
    os.makedirs(root)
    shutil.copytree(path, checkpoint.step_dir(str(root), 1))
    os.makedirs(checkpoint.step_dir(str(root), 5))  # a save cut short: no marker
    assert checkpoint.latest(str(root)) == checkpoint.step_dir(str(root), 1)
    assert pm.load_latest(str(root)) == 1


def test_mixed_precision_saves_fp32_master_weights(tmp_path):
    model, loss_fn = make_model("own_gpt")
    data = jobs.batches("own_gpt", 1)
    pm = autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                             loss_fn=loss_fn, mixed_precision=True,
                             plan={"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 1, "zero": 1},
                             optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    pm.train_step(*data[0])
    pm.save(str(tmp_path / "mp"))
    entries = checkpoint.read_metadata(str(tmp_path / "mp")).state_dict_metadata
    assert {m.properties.dtype for k, m in entries.items() if k.startswith("model/")} == {
        torch.float32}
    pm.close()
