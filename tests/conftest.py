"""Shared fixtures. Captured graphs are session-scoped: capture once, test many times."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # examples/ is not installed; tests import it from the checkout
    sys.path.insert(0, ROOT)

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# every LocalPool's workers fork with the model libraries the tests build already imported
# (~1.5 s of CPU per worker otherwise, 3-4 s per pool of 4 on two cores)
os.environ.setdefault("AUTOPAR_POOL_PRELOAD", ",".join(
    ["transformers", "transformers.masking_utils"]
    + [f"transformers.models.{m}.modeling_{m}" for m in ("gpt2", "llama", "bert")]))
warnings.filterwarnings("ignore", message=".*bos_token_id.*")
torch.set_num_threads(1)

#: Tiny shapes shared by every test that needs a real (allocated) model.
TINY = {
    "gpt": dict(layers=2, hidden=64, heads=4, vocab=128, seq=32),
    "bert": dict(layers=2, hidden=64, heads=4, vocab=128, seq=32),
    "llama": dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab=128, seq=32),
}


def build_tiny(family: str, **overrides):
    from autopar import models

    return models.build(family, **{"dropout": 0.0, "seed": 0, **TINY[family], **overrides})


def train_one_process(model, loss_fn, optimizer, data, micro_batches: int = 1):
    """The reference of a parallel run: ``model`` trained in this process on ``data`` (a list of
    ``(inputs, targets)`` tuples) with ``optimizer``; the losses and the final state. With
    ``micro_batches`` k, each batch runs as k equal chunks in order (rows split along dim 0),
    their gradients accumulated (each chunk's mean loss weighted 1/k), as a parallel run that
    splits the batch into k micro-batches over its replicas: what a BatchNorm sees."""
    losses = []
    for inputs, targets in data:
        optimizer.zero_grad()
        total = 0.0
        chunks = zip(zip(*(t.chunk(micro_batches) for t in inputs)),
                     zip(*(t.chunk(micro_batches) for t in targets)))
        for xs, ys in chunks:
            loss = loss_fn(model(*xs), *ys) / micro_batches
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def build_own_gpt(**overrides):
    from examples.gpt import GPT, GPTConfig, gpt_loss

    torch.manual_seed(0)
    config = {**dict(layers=2, hidden=64, heads=4, vocab=128, seq=32), **overrides}
    return GPT(GPTConfig(**config)), gpt_loss


@pytest.fixture(scope="session")
def tiny_models():
    """family -> (ZooModel-like (model, loss_fn), inputs, targets, CapturedGraph)."""
    from autopar import capture

    out = {}
    gen = torch.Generator().manual_seed(1)
    for family in TINY:
        zm = build_tiny(family)
        inputs, targets = zm.example_inputs(batch=2, seq=16, generator=gen)
        out[family] = (zm.model, zm.loss_fn, inputs, targets,
                       capture(zm.model, inputs, zm.loss_fn, example_targets=targets))
    model, loss_fn = build_own_gpt()
    tokens = torch.randint(0, 128, (2, 17), generator=gen)
    inputs, targets = (tokens[:, :-1],), (tokens[:, 1:],)
    out["own_gpt"] = (model, loss_fn, inputs, targets,
                      capture(model, inputs, loss_fn, example_targets=targets))
    return out


#: Published shapes for the sharding search at full size: (preset, overrides, real depth).
#: Two blocks are captured (as `autopar plan` does) and the search is told the real depth.
#: Positions are 4096 for all three, so planning-like sequence lengths fit every model (as
#: `autopar plan gpt2-small --max-seq 4096` would build it); the vocabularies are Megatron-LM's
#: padded ones (GPT-2 50257 -> 50304, BERT 30522 -> 30528), divisible by every tp tested.
FULL_SIZE = {
    "gpt2-small": (dict(vocab=50304, seq=4096), 12),
    "bert-base": (dict(vocab=30528, seq=4096), 12),
    "llama-7b": (dict(kv_heads=8, seq=4096), 32),
}


@pytest.fixture(scope="session")
def full_size():
    """name -> CapturedGraph of FULL_SIZE's two-block meta-device models (no weights)."""
    from autopar import capture, models

    out = {}
    for name, (over, _) in FULL_SIZE.items():
        zm = models.build(name, device="meta", layers=2, **over)
        inputs, targets = zm.example_inputs(batch=2, seq=16)
        out[name] = capture(zm.model, inputs, zm.loss_fn, example_targets=targets)
    return out


#: Fixtures that start processes: a test using one is a distributed test, marked or not.
POOL_FIXTURES = {"shared_pool2", "shared_pool4", "quick_calibration"}


@pytest.hookimpl(tryfirst=True)  # before -m selects on the markers
def pytest_collection_modifyitems(items):
    for item in items:
        if POOL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.distributed)


@pytest.fixture(autouse=True)
def _no_processes_beside_other_tests(request, monkeypatch):
    """Under ``./dev test``'s parallel run (an xdist worker) a test that starts a LocalPool
    lacks the ``distributed`` marker: its processes would share the cores with the other
    workers' tests (and its timeouts with their load). Say so instead of running it there."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None or \
            request.node.get_closest_marker("distributed") is not None:
        return
    from autopar.runtime.local_pool import LocalPool

    def refuse(self, *args, **kwargs):
        raise RuntimeError(f"{request.node.nodeid} starts a LocalPool: mark it "
                           "@pytest.mark.distributed (./dev test runs those alone)")

    monkeypatch.setattr(LocalPool, "__init__", refuse)


@pytest.fixture(scope="session")
def shared_pool4():
    """One LocalPool(4) for every test that trains on 4 ranks and neither measures its
    processes' memory, counts the groups they created, nor breaks them on purpose: started
    once, and each model captured once per worker (tests/parallelize_jobs.shared_captures), where
    a pool per test spent 3-5 s starting and capturing again. A job that fails restarts it."""
    from autopar.runtime.local_pool import LocalPool

    with LocalPool(4, timeout_s=900) as pool:
        yield pool


@pytest.fixture(scope="session")
def shared_pool2():
    """The same for 2 ranks."""
    from autopar.runtime.local_pool import LocalPool

    with LocalPool(2, timeout_s=600) as pool:
        yield pool


@pytest.fixture(scope="session")
def quick_calibration(tmp_path_factory):
    """``autopar calibrate --quick --world 2`` run once (about a minute on 2 cores): the cluster
    file's path, its raw measurements beside it (``.raw.json``). The calibration test checks
    it; the demo's test reuses it as this host's cached calibration."""
    from autopar.cli import main

    out = tmp_path_factory.mktemp("calibration") / "me.json"
    assert main(["calibrate", "--quick", "--world", "2", "--out", str(out),
                 "--raw", str(out.with_suffix(".raw.json"))]) == 0
    return out
