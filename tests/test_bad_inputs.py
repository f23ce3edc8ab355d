"""Bad input, each through the public API, each a named AutoparError saying expected / found / fix.

Cheap tier: no processes. Checks that fail before the capture (pins, plan files, cluster files)
cost nothing; the rest share a handful of world-1 ``parallelize`` calls. docs/reliability.md lists
every case with its error and the test that proves it; the multi-rank cases (a rank 0 planning
error on every rank, timeouts, a dead peer, verify, dropout across ranks) are in
tests/test_faults.py and tests/test_reliability_distributed.py.
"""

from __future__ import annotations

import functools
import json
import math
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
from autopar import (
    ClusterSpecError,
    InfeasiblePlanError,
    InvalidInputError,
    InvalidPlanError,
    PlanMismatchError,
    ShardingError,
    UnsupportedOpWarning,
    UntraceableModelError,
)
from autopar.sharding import REPLICATE
from autopar.tensor_parallel import tensor_parallelize
from conftest import build_tiny
from tp_helpers import TINY_COST

SGD = functools.partial(torch.optim.SGD, lr=0.1)


def _tiny(family="gpt", batch=4, seq=16, **overrides):
    zm = build_tiny(family, **overrides)
    inputs, targets = zm.example_inputs(batch=batch, seq=seq,
                                        generator=torch.Generator().manual_seed(3))
    return zm, inputs, targets


def _parallelize(zm, inputs, targets, plan, **kwargs):
    return autopar.parallelize(zm.model, example_inputs=inputs, example_targets=targets,
                               loss_fn=zm.loss_fn, optimizer=SGD, plan=plan, **kwargs)


def _explains(err: autopar.AutoparError) -> None:
    assert err.summary and (err.expected or err.found) and err.fix, str(err)


@pytest.fixture(scope="module")
def world1():
    """One world-1 ParallelModel (tiny GPT-2, 2 micro-batches) shared by the step-input cases."""
    zm, inputs, targets = _tiny()
    pm = _parallelize(zm, inputs, targets, {"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 2})
    yield pm, zm, inputs, targets
    pm.close()


# -- pins and plans: refused before any capture ---------------------------------------------------

@pytest.mark.parametrize("pins, error, match", [
    ({"tp": 1, "bogus": 2}, InvalidPlanError, r"unknown pin\(s\) \['bogus'\]"),
    ({"zero": 7}, InvalidPlanError, "pin zero=7 is not a ZeRO stage"),
    ({"schedule": "bogus"}, InvalidPlanError, "pin schedule='bogus' is not a valid ScheduleKind"),
    ({"recompute": "most"}, InvalidPlanError, "not a valid RecomputeKind"),
    ({"tp": 0}, InvalidPlanError, "pin tp=0 is not a positive integer"),
    ({"dp": "1"}, InvalidPlanError, "is not a positive integer"),
    ({"virtual_stages": 2, "schedule": "1f1b"}, InvalidPlanError, "needs the interleaved-1f1b"),
    ({"virtual_stages": 1, "schedule": "interleaved-1f1b"}, InvalidPlanError,
     "needs virtual_stages >= 2"),
    ({"sequence_parallel": True, "tp": 1}, InvalidPlanError, "sequence_parallel needs tp > 1"),
    ({"sequence_parallel": "yes"}, InvalidPlanError, "True or False"),
    ({"dp": 2, "tp": 1, "pp": 1}, PlanMismatchError, "pinned mesh does not match the world"),
    ({"tp": 2}, PlanMismatchError, "do not divide the world size"),
])
def test_bad_pins_are_named_before_any_work(pins, error, match):
    model = nn.Linear(2, 2)  # never captured: the pins fail first
    with pytest.raises(error, match=match) as err:
        autopar.parallelize(model, example_inputs=(torch.zeros(2, 2),), loss_fn=torch.sum,
                            optimizer=SGD, plan=pins)
    _explains(err.value)
    if error is InvalidPlanError:
        assert isinstance(err.value, (InvalidInputError, ValueError))


_LINEAR = nn.Linear(2, 2)


@pytest.mark.parametrize("optimizer, match", [
    (lambda params: None, "did not return an optimizer"),
    (lambda params: torch.optim.SGD(_LINEAR.parameters(), lr=0.1),  # closed over another model
     "tensors it was not given"),
    (lambda params: torch.optim.SGD(list(params)[:1], lr=0.1), "parameters left out"),
    (lambda params: torch.optim.AdamW(params, lr=-1.0), "failed on the model's parameters"),
    (torch.optim.SGD(_LINEAR.parameters(), lr=0.1), "already built"),
    (3, "unexpected form"),
])
def test_bad_optimizer_callables_are_named_before_any_work(optimizer, match):
    """An optimizer callable is tried once on stand-ins of the parameters, before the capture."""
    model = nn.Linear(2, 2)
    with pytest.raises(InvalidInputError, match=match) as err:
        autopar.parallelize(model, example_inputs=(torch.zeros(2, 2),), loss_fn=torch.sum,
                            optimizer=optimizer, plan={"dp": 1})
    _explains(err.value)


@pytest.mark.parametrize("kwargs, match", [
    (dict(zero=7), "zero must be 0, 1, 2 or 3"),
    (dict(schedule="bogus"), "'bogus' is not a valid ScheduleKind"),
    (dict(virtual_stages=2), "needs the interleaved-1f1b"),
])
def test_bad_plan_objects_are_named(kwargs, match):
    with pytest.raises(InvalidPlanError, match=match) as err:
        autopar.Plan(**kwargs)
    _explains(err.value)


def test_plan_files_of_another_version_or_malformed(tmp_path):
    model = nn.Linear(2, 2)

    def run(plan):
        autopar.parallelize(model, example_inputs=(torch.zeros(2, 2),), loss_fn=torch.sum,
                            optimizer=SGD, plan=plan)

    doc = autopar.Plan().to_json()
    (tmp_path / "old.json").write_text(json.dumps({**doc, "autopar_version": "0.0.3"}))
    with pytest.raises(PlanMismatchError, match="written by autopar 0.0.3"):
        run(str(tmp_path / "old.json"))
    (tmp_path / "v9.json").write_text(json.dumps({**doc, "format_version": 9}))
    with pytest.raises(PlanMismatchError, match="format version 9"):
        run(tmp_path / "v9.json")
    (tmp_path / "bad.yaml").write_text("dp: [1, 2\n")
    with pytest.raises(InvalidPlanError, match="not a valid plan file"):
        run(str(tmp_path / "bad.yaml"))
    (tmp_path / "field.json").write_text(json.dumps({**doc, "tensor": 2}))
    with pytest.raises(InvalidPlanError, match="unknown plan field"):
        run(str(tmp_path / "field.json"))
    with pytest.raises(InvalidInputError, match="unknown plan 'autp'"):
        run("autp")


@pytest.mark.parametrize("text, match", [
    ("nodes: 1\n", "lacks key"),
    ("{not: [valid", "cannot parse"),
    ("[1, 2]\n", "is not a mapping"),
])
def test_malformed_cluster_files(tmp_path, text, match):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(ClusterSpecError, match=match) as err:
        autopar.parallelize(nn.Linear(2, 2), str(path), example_inputs=(torch.zeros(2, 2),),
                            loss_fn=torch.sum, optimizer=SGD)
    _explains(err.value)


def test_contradictory_cluster_file(tmp_path):
    data = autopar.Cluster.load("cpu").to_json()
    data["device"]["memory_bytes"] = -1
    path = tmp_path / "negative.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ClusterSpecError) as err:
        autopar.Cluster.load(str(path))
    _explains(err.value)


# -- the model and its inputs --------------------------------------------------------------------

class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:  # a branch on a tensor's value
            h = h * 2
        return h


def test_data_dependent_control_flow():
    with pytest.raises(UntraceableModelError, match="depends on tensor values") as err:
        autopar.parallelize(_DataDependent(), example_inputs=(torch.randn(2, 4),),
                            loss_fn=lambda y: y.sum(), optimizer=SGD)
    assert "torch.cond" in err.value.fix


def test_missing_and_wrongly_shaped_example_inputs():
    zm, inputs, targets = _tiny()
    with pytest.raises(InvalidInputError, match="no tensor among the example inputs"):
        _parallelize(zm, (), (), "auto")
    with pytest.raises(InvalidInputError, match="parallelize needs a loss"):
        autopar.parallelize(zm.model, example_inputs=inputs, loss_fn=None, optimizer=SGD)
    with pytest.raises(InvalidInputError, match="disagree on the batch"):
        _parallelize(zm, inputs, (targets[0][:2],), "auto")
    # float token ids: no tracer can run the embedding; the error lists what each one said
    with pytest.raises(UntraceableModelError, match="could not capture") as err:
        _parallelize(zm, (inputs[0].float(),), targets, "auto")
    assert "indices" in str(err.value) or "Long" in str(err.value)


class _CumsumNet(nn.Module):
    """A float cumsum: an op with no sharding rule."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.cumsum(self.up(x), dim=-1))


def test_op_without_sharding_rule_runs_replicated_and_warns():
    model = _CumsumNet()
    x = torch.randn(4, 8, 16)
    captured = autopar.capture(model, (x,), lambda y: y.square().mean())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = tensor_parallelize(captured, 2, cost=TINY_COST)
    messages = [str(w.message) for w in caught if issubclass(w.category, UnsupportedOpWarning)]
    assert messages and "cumsum" in messages[0], messages
    cumsum = next(n for n in program.sharded.graph.nodes if "cumsum" in str(n.target))
    assert program.placements[cumsum.name] == REPLICATE


def test_heads_or_vocabulary_not_divisible_by_tp(tiny_models):
    captured = tiny_models["gpt"][4]  # 4 heads, vocabulary 128
    with pytest.raises(ShardingError, match="4 heads") as err:
        tensor_parallelize(captured, 3, cost=TINY_COST)
    assert "128 classes" in str(err.value) and "50304" in err.value.fix
    # strict=False runs the indivisible parts replicated
    program = tensor_parallelize(captured, 3, cost=TINY_COST, strict=False)
    assert program.tp == 3
    with pytest.raises(ShardingError, match="sequence length divisible by tp=3"):
        tensor_parallelize(captured, 3, sequence_parallel=True, sizes={"b": 2, "s": 16},
                           strict=False)


def test_sequence_parallelism_of_a_model_without_a_sequence_is_named():
    """A ViT's inputs are images: no sequence to split (parallelize's sequence length is 1, not
    dim 1 of the pixels, its channels), and a pinned sequence_parallel says so."""
    import families_jobs

    from autopar.api import _seq_len

    model, loss_fn = families_jobs.make_model("vit")
    (pixels,), (labels,) = families_jobs.batches("vit", 1)[0]
    assert _seq_len((pixels,)) == 1 and _seq_len((torch.zeros(2, 7, dtype=torch.long),)) == 7
    captured = autopar.capture(model, (pixels,), loss_fn, example_targets=(labels,))
    with pytest.raises(ShardingError, match="no sequence: images") as err:
        tensor_parallelize(captured, 2, cost=TINY_COST, sequence_parallel=True,
                           sizes={"b": 2, "s": 1})
    assert "sequence_parallel=False" in err.value.fix
    # the planner says the same of a pinned cp or SP (it said "divisible by 4 (seq=1)")
    for pins, what in (({"cp": 2}, "cp=2"), ({"tp": 2, "sequence_parallel": True},
                                              "sequence parallelism")):
        with pytest.raises(InfeasiblePlanError) as err:
            autopar.plan(model, "cpu", devices=2, example_inputs=(pixels,), loss_fn=loss_fn,
                         example_targets=(labels,), global_batch=4, **pins)
        assert f"{what} splits the sequence, and the model's inputs hold no sequence dim" \
            in err.value.found, err.value.found


def test_model_too_large_for_the_cluster():
    zm, inputs, targets = _tiny(batch=8)
    data = autopar.Cluster.load("cpu").to_json()
    data["device"]["memory_bytes"] = 2e5  # 200 kB: the tiny model's weights alone do not fit
    small = autopar.Cluster.from_json(data)
    with pytest.raises(InfeasiblePlanError, match="no plan fits in memory") as err:
        autopar.parallelize(zm.model, small, example_inputs=inputs, example_targets=targets,
                            loss_fn=zm.loss_fn, optimizer=SGD)
    for word in ("leanest", "weights", "activations", "usable"):
        assert word in err.value.found
    assert "0.0 GiB" not in err.value.found  # small memories in their own unit
    # the fewest devices whose memory holds the model's weights and gradients once (fp32:
    # 4 + 4 bytes a parameter; plain SGD keeps no state, and it could be offloaded), counted
    # from the model's own parameters
    params = sum(p.numel() for p in zm.model.parameters())
    fewest = math.ceil(params * 8 / small.device.usable_memory_bytes)
    assert fewest > 1
    assert f"use at least {fewest} devices of this kind" in err.value.fix, err.value.fix
    assert f"{params:,} parameters x 8 B at fp32" in err.value.fix, err.value.fix


def test_global_batch_not_divisible_through_parallelize():
    zm, inputs, targets = _tiny(batch=8)
    with pytest.raises(InvalidInputError, match="does not split as pinned") as err:
        _parallelize(zm, inputs, targets, {"dp": 1, "tp": 1, "pp": 1, "micro_batch_size": 3})
    assert "multiple of dp x micro_batch_size = 3" in err.value.expected
    plan = autopar.Plan(micro_batch_size=2, num_micro_batches=2)  # global batch 4, not 8
    with pytest.raises(InvalidInputError, match="another global batch"):
        _parallelize(zm, inputs, targets, plan)


class _PythonIntBatch(nn.Module):
    """Reads its batch size as a Python int: export fixes the batch to the example's."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        n = int(x.shape[0])
        return self.out(torch.relu(self.lin(x)) + torch.ones(n, 1))


def test_a_static_batch_is_captured_again_at_the_micro_batch():
    """A graph the symbolic batch does not survive is traced at the example batch (8 rows), with
    a warning; the plan's micro-batches are 2 rows, so parallelize captures it again at 2: the
    training step equals one process (SGD; fp32, the same sums in micro-batch order: 1e-6)."""
    torch.manual_seed(0)
    model, ref = _PythonIntBatch(), _PythonIntBatch()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    loss_fn = nn.functional.cross_entropy
    with pytest.warns(UserWarning, match=r"fixes the size of batch"), warnings.catch_warnings():
        pm = autopar.parallelize(model, example_inputs=(x,), example_targets=(y,), loss_fn=loss_fn,
                                 optimizer=SGD, plan={"dp": 1, "tp": 1, "pp": 1,
                                                      "num_micro_batches": 4})
    losses = [pm.train_step((x,), (y,)) for _ in range(2)]
    opt = SGD(ref.parameters())
    want = []
    for _ in range(2):
        opt.zero_grad()
        loss = loss_fn(ref(x), y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    assert losses == pytest.approx(want, rel=1e-6)
    state = pm.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=1e-6)
    pm.close()


def test_step_inputs_of_the_wrong_form(world1):
    pm, zm, inputs, targets = world1
    tokens, labels = inputs[0], targets[0]
    with pytest.raises(InvalidInputError, match="split into the plan's micro-batches"):
        pm.train_step((tokens[:3],), (labels[:3],))  # 3 rows, 2 micro-batches
    with pytest.raises(InvalidInputError, match="wrong number of inputs"):
        pm.train_step((tokens,), ())
    with pytest.raises(InvalidInputError, match="dtype float32"):
        pm.train_step((tokens.float(),), (labels,))
    with pytest.raises(InvalidInputError, match="1 dims"):
        pm.eval_step((tokens[0],), (labels,))
    assert pm.steps == 0  # nothing ran
    loss = pm.eval_step(inputs, targets)  # the right form still works
    assert loss == pytest.approx(zm.loss_fn(zm.model(*inputs), *targets).item(), rel=1e-5)


def test_integer_buffers_bert_position_ids():
    """BERT keeps position (and token type) ids as int64 buffers: they are neither trained nor
    cast, and pass through to every stage that reads them."""
    zm, inputs, targets = _tiny("bert")
    assert any(not b.is_floating_point() for b in zm.model.buffers())
    pm = _parallelize(zm, inputs, targets, {"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 2},
                      verify=True)
    before = {k: v.clone() for k, v in pm.executor.buffers.items()}
    losses = [pm.train_step(inputs, targets) for _ in range(2)]
    assert losses[1] < losses[0]
    for key, value in pm.executor.buffers.items():
        assert torch.equal(value, before[key]) and value.dtype == before[key].dtype
    pm.close()


# -- plan files and fingerprints ------------------------------------------------------------------

LLAMA = dict(hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab=128, seq=32)


def test_plan_file_from_autopar_plan_checks_the_model(tmp_path):
    """`autopar plan --out` fingerprints a 2-block meta-device capture at the real depth (4); a
    real 4-layer model accepts the file, a 2-layer one is refused naming both fingerprints."""
    from autopar.cli import main

    path = tmp_path / "plan.json"
    assert main(["plan", "llama", "--layers", "4", "--hidden", "64", "--heads", "4",
                 "--kv-heads", "2", "--ffn-hidden", "96", "--vocab", "128", "--max-seq", "32",
                 "--cluster", "cpu", "--gpus", "1", "--global-batch", "4", "--seq", "16",
                 "--out", str(path)]) == 0
    made_for = json.loads(path.read_text())["plan"]["model_fingerprint"]
    assert made_for.startswith(autopar.__version__.rsplit(".", 1)[0] + ":")

    zm, inputs, targets = _tiny("llama", layers=4, **LLAMA)
    pm = _parallelize(zm, inputs, targets, str(path))
    assert pm.plan.model_fingerprint == made_for
    pm.close()

    other, inputs, targets = _tiny("llama", layers=2, **LLAMA)
    with pytest.raises(PlanMismatchError, match="made for another model") as err:
        _parallelize(other, inputs, targets, str(path))
    assert made_for in err.value.found and autopar.plan_fingerprint(
        autopar.capture(other.model, inputs, other.loss_fn, example_targets=targets)
    ) in err.value.expected


def test_fingerprint_ignores_batch_and_device_and_sees_shapes(tiny_models):
    model, loss_fn, inputs, targets, captured = tiny_models["gpt"]
    fp = autopar.plan_fingerprint(captured)
    for batch in (3, 8):  # another batch and sequence length; a batch equal to the length
        tokens = torch.randint(0, 128, (batch, 9))
        again = autopar.capture(model, (tokens[:, :-1],), loss_fn,
                                example_targets=(tokens[:, 1:],))
        assert again.fingerprint() == fp, again.example_sizes
    assert tiny_models["own_gpt"][4].fingerprint() != fp
    assert captured.fingerprint(depth=5) != fp
    with pytest.raises(InvalidInputError, match="cannot fingerprint 1 blocks"):
        captured.fingerprint(depth=1)


# -- dropout masks (no processes; across ranks: tests/test_reliability_distributed.py) ------------

def test_dropout_masks_keep_one_minus_p_and_slice_consistently():
    from autopar.runtime.rng import DropoutRNG
    from autopar.runtime.tp import TPGroup

    rng = DropoutRNG(seed=7)
    rng.set_rows(16, 4)
    p, shape = 0.1, (4, 64, 32)  # 4 samples of the micro-batch starting at global row 16
    keep = rng.keep_mask("dropout_3", shape, 0, p, torch.device("cpu"))
    n = keep.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(keep.float().mean().item() - (1 - p)) < 5 * sigma
    assert torch.equal(keep, rng.keep_mask("dropout_3", shape, 0, p, torch.device("cpu")))
    assert not torch.equal(keep, rng.keep_mask("dropout_4", shape, 0, p, torch.device("cpu")))
    # sample g's mask does not depend on the micro-batch it travels in
    rng.set_rows(17, 1)
    assert torch.equal(keep[1:2], rng.keep_mask("dropout_3", (1, 64, 32), 0, p,
                                                torch.device("cpu")))
    # a tensor-parallel rank holding Shard(1) keeps its chunk of the same full mask
    rng.set_rows(16, 4)
    x = torch.ones(4, 64, 32)
    full = TPGroup(rng=rng).dropout(x, p, site="dropout_3")
    for r in range(2):
        fake = TPGroup(rng=rng)
        fake.rank, fake.size = r, 2
        piece = fake.dropout(x[:, 32 * r:32 * (r + 1)], p, site="dropout_3", shard_dim=1)
        assert torch.equal(piece, full[:, 32 * r:32 * (r + 1)])
    rng.step += 1
    assert not torch.equal(full, TPGroup(rng=rng).dropout(x, p, site="dropout_3"))
    rng.training = False
    assert TPGroup(rng=rng).dropout(x, p, site="dropout_3") is x


def test_verify_report_world1(world1):
    """The report on one process: every layer compared, printable as a rich table."""
    from rich.console import Console

    pm, zm, inputs, targets = world1
    report = pm.verify(inputs, targets)
    assert report.ok and report.micro_batch_size == 2
    assert [c.layer for c in report.layers] == [layer.name for layer in pm.captured.layers] + [
        "loss"]
    assert all(c.tensors >= 1 and c.max_rel <= 1e-6 for c in report.layers)
    console = Console(record=True, width=120)
    console.print(report.table())
    text = console.export_text()
    assert "transformer.h.1" in text and "relative: ok" in text


def test_a_checkpoint_that_cannot_be_written_is_named_and_leaves_nothing(world1, tmp_path,
                                                                         monkeypatch):
    """`save` and `save_pretrained` to a path under a file, or onto a file: a CheckpointError
    saying what the OS said, never the raw OSError. A disk that fills up mid-write: the same,
    and nothing at the path loads as a checkpoint (`save` writes its completion marker last;
    `save_pretrained` renames its directory into place at the end)."""
    import errno

    from autopar.runtime import checkpoint, hf_checkpoint

    pm = world1[0]
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    with pytest.raises(autopar.InvalidInputError, match="exists and is not an empty directory"):
        pm.save_pretrained(str(afile))  # refused before any write
    for path, save in ((afile, pm.save), (afile / "under", pm.save),
                       (afile / "under", pm.save_pretrained)):
        with pytest.raises(autopar.CheckpointError, match="cannot write") as err:
            save(str(path))
        assert "Error" in err.value.found and "writable directory" in err.value.fix
    assert afile.read_text() == "not a directory"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write_atomically", full)
    with pytest.raises(autopar.CheckpointError, match="No space left"):
        pm.save(str(tmp_path / "dcp"))
    with pytest.raises(autopar.InvalidInputError, match="is incomplete"):
        pm.load(str(tmp_path / "dcp"))  # no marker: never loaded as a checkpoint
    monkeypatch.setattr(hf_checkpoint.SafetensorsWriter, "write", full)
    with pytest.raises(autopar.CheckpointError, match="No space left"):
        pm.save_pretrained(str(tmp_path / "hf"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "dcp"]  # no hidden partial


def test_a_sequence_beyond_the_models_positions_is_refused_before_the_step():
    """GPT-2's positions are computed (``arange(s)`` into its position table): a sequence
    longer than the table fails one process's lookup with IndexError. autopar refuses it before
    the step by name, with the longest sequence that fits (passes/index_checks.size_bounds),
    and the model stays usable: the next good step's loss is one process's."""
    from autopar.passes.index_checks import size_bounds

    zm, inputs, targets = _tiny(batch=4)
    positions = zm.model.config.n_positions
    long = torch.randint(0, 128, (4, positions + 8))
    with pytest.raises(IndexError):
        zm.loss_fn(zm.model(long), long)
    with torch.no_grad():
        expected = float(zm.loss_fn(zm.model(*inputs), *targets))
    edge = torch.randint(0, 128, (4, positions))  # exactly the table: fits
    zm.loss_fn(zm.model(edge), edge)
    pm = _parallelize(zm, inputs, targets, {"dp": 1, "tp": 1, "pp": 1})
    try:
        (bound,) = size_bounds(pm.captured)
        assert bound.rows == positions and bound.longest("s") == positions
        assert bound.outside({"s": positions}) is None
        assert bound.outside({"s": positions + 8}) == (0, positions + 7)
        with pytest.raises(autopar.InvalidInputError, match="transformer.wpe") as err:
            pm.train_step((long,), (long,))
        _explains(err.value)
        assert f"at most {positions} tokens" in err.value.expected
        assert f"s={positions + 8}" in str(err.value)
        loss = pm.train_step(inputs, targets)  # the model was left as it was
        assert abs(float(loss) - expected) < 1e-5, (float(loss), expected)
    finally:
        pm.close()


class _MaskPositions(nn.Module):
    """OPT's positions: a cumsum of the attention mask, which size_bounds does not follow (its
    range depends on the mask's values)."""

    def __init__(self, vocab=128, positions=8, hidden=16):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(positions, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids, mask):
        where = torch.cumsum(mask, dim=1) * mask - 1
        return self.head(self.tokens(ids) + self.positions(where.clamp(min=0)))


def _token_loss(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _masked_loss(logits, targets):
    """Padding (id 0) left out of the loss by a computed target: where, not a view."""
    return _token_loss(logits, torch.where(targets == 0, -100, targets))


def test_an_index_computed_from_the_batchs_values_is_refused_before_the_step():
    """Positions from a cumsum of the mask, and targets masked by ``where``: the part of the
    graph that computes each runs on every micro-batch before the step
    (passes/index_checks.computed_bounds). A mask of 2s, or a sequence longer than the
    positions, fails one process's lookup; a target of 200 fails its loss: autopar refuses each
    by name before the step, and the model stays usable (2 micro-batches: the bad one is the
    second; then a good step's loss and parameters equal one process's, to 1e-5 in fp32)."""
    from autopar.passes.index_checks import computed_bounds, size_bounds

    torch.manual_seed(0)
    model = _MaskPositions()
    reference = _MaskPositions()
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(1, 128, (4, 8))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    pm = autopar.parallelize(model, example_inputs=(ids, mask), example_targets=(ids.clone(),),
                             loss_fn=_masked_loss, optimizer=SGD,
                             plan={"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 2})
    try:
        assert size_bounds(pm.captured) == []
        bounds = computed_bounds(pm.captured)
        assert sorted((b.table, b.rows, b.ignore) for b in bounds) == [
            ("the classes of cross_entropy_loss", 128, -100),
            ("the embedding positions.weight", 8, None)]
        twos = mask.clone()
        twos[3, 5] = 2  # micro-batch 1 (rows 2-3)
        long = torch.randint(1, 128, (4, 12))
        bad_target = ids.clone()
        bad_target[2, 1] = 200
        cases = (((ids, twos), ids, "positions.weight", "2 index(es) outside in micro-batch 1, from 8 to 13"),
                 ((long, torch.ones_like(long)), long, "positions.weight", "from 8 to 11"),
                 ((ids, mask), bad_target, "classes of cross_entropy_loss", "from 200 to 200"))
        messages = []
        for batch, targets, table, found in cases:
            with pytest.raises((IndexError, RuntimeError)):  # one process's lookup or loss
                _masked_loss(reference(*batch), targets)
            with pytest.raises(autopar.InvalidInputError, match=table) as err:
                pm.train_step(batch, (targets,))
            _explains(err.value)
            assert found in err.value.found, err.value.found
            messages.append(str(err.value))
        assert "computes from input 1 (cumsum, mul, sub, clamp)" in messages[0], messages[0]
        assert "computes from target 0 (eq, where" in messages[2], messages[2]
        optimizer = SGD(reference.parameters())  # the module's SGD, lr 0.1
        for _ in range(2):
            loss = float(pm.train_step((ids, mask), (ids,)))
            optimizer.zero_grad()
            want = _masked_loss(reference(ids, mask), ids)
            want.backward()
            optimizer.step()
            assert abs(loss - want.item()) < 1e-5, (loss, want.item())
        state = pm.state_dict()
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        pm.close()


class _OffsetPositions(nn.Module):
    """Positions offset by a buffer (``arange(s) + self.start``): an index that reads the
    model's state, which the checks before the step leave to the stage's lookup."""

    def __init__(self, vocab=128, positions=8, hidden=16):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(positions, hidden)
        self.head = nn.Linear(hidden, vocab)
        self.register_buffer("start", torch.tensor(0))

    def forward(self, ids):
        where = torch.arange(ids.shape[1]) + self.start
        return self.head(self.tokens(ids) + self.positions(where))


def test_an_index_beyond_a_table_inside_a_stage_is_the_inputs_fault():
    """An index the pre-step checks do not follow (positions offset by a buffer) fails inside
    the stage: named as the batch's fault (InvalidInputError naming the lookup), not as an
    autopar fault (StageExecutionError)."""
    from autopar.passes.index_checks import computed_bounds, size_bounds

    torch.manual_seed(0)
    model = _OffsetPositions()
    ids = torch.randint(0, 128, (4, 8))
    long = torch.randint(0, 128, (4, 12))
    with pytest.raises(IndexError):
        _token_loss(model(long), long)
    pm = autopar.parallelize(model, example_inputs=(ids,), example_targets=(ids.clone(),),
                             loss_fn=_token_loss, optimizer=SGD,
                             plan={"dp": 1, "tp": 1, "pp": 1})
    try:
        assert size_bounds(pm.captured) == [] and computed_bounds(pm.captured) == []
        with pytest.raises(autopar.InvalidInputError, match="indexes beyond a table") as err:
            pm.train_step((long,), (long,))
        assert "embedding" in str(err.value) and "parallelized again" in err.value.fix
    finally:
        pm.close()


class _ShortAndBounded(nn.Module):
    """Drops its first two tokens (``ids[:, 2:]``: traced for s >= 4) and mixes the rest
    through a causal mask sliced from a 32-row buffer (traced for s - 2 <= 31)."""

    def __init__(self, vocab=64, hidden=16, window=32):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab)
        self.register_buffer("causal", torch.tril(torch.ones(window, window)) / window)

    def forward(self, ids):
        h = self.tokens(ids[:, 2:])
        n = h.shape[1]
        return self.head(self.causal[:n, :n] @ h)


def _dropped_loss(logits, targets):
    return _token_loss(logits, targets[:, 2:])


def test_a_size_outside_what_the_graph_was_captured_for_is_refused_before_the_step():
    """The capture keeps s symbolic for 4 to 33 (tests/test_capture.py): s = 3 and s = 34 are
    refused by name before the step (a graph traced for other sizes would run), with the range;
    the model stays usable: steps at s = 4 and s = 33, the range's ends, equal one process's
    (loss to 1e-5, fp32, SGD), then every parameter."""
    from autopar.ir import SEQ

    torch.manual_seed(0)
    model = _ShortAndBounded()
    reference = _ShortAndBounded()
    reference.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (2, 16), generator=gen)
    pm = autopar.parallelize(model, example_inputs=(ids,), example_targets=(ids.clone(),),
                             loss_fn=_dropped_loss, optimizer=SGD,
                             plan={"dp": 1, "tp": 1, "pp": 1})
    try:
        assert pm.captured.size_ranges == {SEQ: (4, 33)}
        for s in (3, 34):
            bad = torch.randint(0, 64, (2, s), generator=gen)
            with pytest.raises(autopar.InvalidInputError, match=f"s={s} lies outside") as err:
                pm.train_step((bad,), (bad,))
            _explains(err.value)
            assert err.value.expected == "s from 4 to 33", err.value.expected
        optimizer = SGD(reference.parameters())
        for s in (4, 33):
            batch = torch.randint(0, 64, (2, s), generator=gen)
            loss = float(pm.train_step((batch,), (batch,)))
            optimizer.zero_grad()
            want = _dropped_loss(reference(batch), batch)
            want.backward()
            optimizer.step()
            assert abs(loss - want.item()) < 1e-5, (s, loss, want.item())
        state = pm.state_dict()
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        pm.close()


def test_a_plan_for_a_length_the_graph_was_not_captured_for_is_refused():
    """``parallelize(seq=40)`` for the model traced for s from 4 to 33: refused before the
    plan, with the range (every step at that length would be refused)."""
    model = _ShortAndBounded()
    ids = torch.randint(0, 64, (2, 16))
    with pytest.raises(autopar.InvalidInputError, match="seq=40 lies outside") as err:
        autopar.parallelize(model, example_inputs=(ids,), example_targets=(ids.clone(),),
                            loss_fn=_dropped_loss, optimizer=SGD, seq=40,
                            plan={"dp": 1, "tp": 1, "pp": 1})
    _explains(err.value)
    assert err.value.expected == "s from 4 to 33"
