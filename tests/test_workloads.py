"""Any model, planned: transformers configs and ``file.py:function`` on the command line, and
``autopar.plan`` in Python (no process group, a meta model).

Independent references: a deep config captured with two blocks and extended to its depth is
priced exactly as the same config captured whole (the blocks are one computation repeated);
``autopar.plan`` on a meta model chooses and predicts what ``autopar plan`` does for the same
model; the saved plan runs under ``parallelize`` and trains as one process does.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import textwrap

import pytest
import torch
import torch.nn as nn

import autopar
from autopar import InvalidInputError
from autopar.cli import main
from autopar.models.workload import CAPTURE_BLOCKS, load_workload
from autopar.planner.planning import plan_workload
from autopar.planner.search import SearchSpace


def _cli(argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """transformers configs as save_pretrained writes them: a decoder (Mistral, 6 layers), an
    image classifier (ViT) and an encoder-decoder (T5)."""
    from transformers import MistralConfig, T5Config, ViTConfig

    root = tmp_path_factory.mktemp("configs")
    MistralConfig(num_hidden_layers=6, hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                  max_position_embeddings=128,
                  architectures=["MistralForCausalLM"]).save_pretrained(root / "mistral")
    ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
              num_attention_heads=4, intermediate_size=64, num_labels=10,
              architectures=["ViTForImageClassification"]).save_pretrained(root / "vit")
    T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=128,
             architectures=["T5ForConditionalGeneration"]).save_pretrained(root / "t5")
    return root


def test_a_deep_config_is_captured_shallow_and_priced_as_the_whole(configs):
    """Mistral with 6 layers: two blocks captured, extended to six; the same plan priced on
    the whole capture: the same step time and memory (to float rounding)."""
    shallow = load_workload(str(configs / "mistral"))
    whole = load_workload(str(configs / "mistral" / "config.json"), shallow=False)
    assert shallow.depth == 6 and whole.depth is None
    assert shallow.model.config.num_hidden_layers == CAPTURE_BLOCKS
    assert shallow.info["family"] == "mistral" and shallow.info["layers"] == 6
    cluster = autopar.Cluster.load("a100-80g").with_devices(4)
    space = SearchSpace(dp=1, tp=2, pp=2, micro_batch_size=2, schedule="1f1b", recompute="none",
                        zero=0, sequence_parallel=False)
    reports = [plan_workload(w, cluster, global_batch=8, seq=128, space=space, top_k=1)
               for w in (shallow, whole)]
    a, b = (r.best for r in reports)
    assert [s.layers for s in a.plan.stages] == [s.layers for s in b.plan.stages]
    assert a.prediction.step_time_s == pytest.approx(b.prediction.step_time_s, rel=1e-9)
    assert a.prediction.peak_memory_bytes == pytest.approx(b.prediction.peak_memory_bytes,
                                                           rel=1e-9)
    assert reports[0].fingerprint == reports[1].fingerprint  # the model at its real depth
    assert reports[0].model["params"] == sum(p.numel() for p in whole.model.parameters())


@pytest.mark.parametrize("family", ["convnext", "swin"])
def test_a_config_whose_layers_are_stages_is_captured_whole(tmp_path, family):
    """ConvNeXt's and Swin's ``num_hidden_layers`` name their stages (a width per stage): cut
    to two, the last stage's norm met the second stage's width (``autopar plan`` of
    transformers' default ConvNeXt config raised). Such a config is captured at its full
    depth and planned: the plan counts every parameter of the model built from it."""
    from transformers import AutoModelForImageClassification, ConvNextConfig, SwinConfig

    if family == "convnext":
        config = ConvNextConfig(depths=[1, 1, 1, 1], hidden_sizes=[8, 16, 32, 64],
                                image_size=32, num_labels=4,
                                architectures=["ConvNextForImageClassification"])
    else:
        config = SwinConfig(image_size=32, patch_size=2, embed_dim=8, depths=[1, 1, 1, 1],
                            num_heads=[1, 2, 2, 4], window_size=2, num_labels=4,
                            architectures=["SwinForImageClassification"])
    assert config.num_hidden_layers == 4 > CAPTURE_BLOCKS
    config.save_pretrained(tmp_path / family)
    work = load_workload(str(tmp_path / family))
    assert work.depth is None
    cluster = autopar.Cluster.load("a100-80g").with_devices(2)
    report = plan_workload(work, cluster, global_batch=4, top_k=1)
    whole = AutoModelForImageClassification.from_config(config)
    assert report.model["params"] == sum(p.numel() for p in whole.parameters())


@pytest.mark.parametrize("name, layers", [("mistral", 8), ("vit", 4), ("t5", None)])
def test_plan_inspect_and_codegen_take_a_config(configs, tmp_path, name, layers):
    """Every subcommand taking MODEL takes a config (file or directory); shape flags set the
    config's fields where it has them."""
    model = str(configs / name) if name != "vit" else str(configs / name / "config.json")
    flags = ["--layers", str(layers)] if layers else []
    doc_path = tmp_path / "plan.json"
    _cli(["plan", model, *flags, "--cluster", "a100-80g", "--gpus", "4", "--global-batch", "8",
          "--tp", "2", "--pp", "2", "--micro-batch", "2", "--schedule", "1f1b", "--recompute",
          "none", "--zero", "0", "--top", "1", "--out", str(doc_path)])
    doc = json.loads(doc_path.read_text())
    plan = doc["plan"]
    assert (plan["tp"], plan["pp"]) == (2, 2) and plan["model_fingerprint"]
    assert doc["model"]["family"] == name
    if layers:
        assert doc["model"]["layers"] == layers
        assert plan["stages"][-1]["layers"][1] == layers + 1  # pre, the blocks, post
    text = _cli(["inspect", model, *flags])
    assert "layer" in text.lower()
    _cli(["codegen", model, *flags, "--tp", "2", "--rank", "0", "--out", str(tmp_path / "code")])
    source = (tmp_path / "code" / "rank0.py").read_text()
    compile(source, "rank0.py", "exec")


USER_FILE = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class ConvNet(nn.Module):
    """An image model of the user's own: convolutions, then an MLP head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.mlp = nn.Sequential(nn.Linear(8 * 16 * 16, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.mlp(torch.relu(self.conv(x)).flatten(1))


def build(batch=2):
    with torch.device("meta"):
        model = ConvNet()
    x = torch.empty(batch, 3, 16, 16, device="meta")
    y = torch.empty(batch, dtype=torch.long, device="meta")
    return model, (x,), F.cross_entropy, (y,)


def as_dict():
    model, inputs, loss_fn, targets = build()
    return {"model": model, "example_inputs": inputs, "loss_fn": loss_fn,
            "example_targets": targets}


def wrong():
    return 3


def no_loss():
    return {"model": ConvNet(), "example_inputs": (torch.zeros(2, 3, 16, 16),)}


NOT_A_FUNCTION = 1
'''


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_model.py"
    path.write_text(textwrap.dedent(USER_FILE))
    return path


@pytest.mark.parametrize("function", ["build", "as_dict"])
def test_plan_takes_a_function_returning_the_workload(user_file, tmp_path, function):
    doc_path = tmp_path / "plan.json"
    _cli(["plan", f"{user_file}:{function}", "--cluster", "a100-80g", "--gpus", "2",
          "--global-batch", "8", "--top", "1", "--out", str(doc_path)])
    doc = json.loads(doc_path.read_text())
    assert doc["model"]["params"] == sum(p.numel() for p in load_workload(
        f"{user_file}:build").model.parameters())
    assert doc["plan"]["dp"] * doc["plan"]["tp"] * doc["plan"]["pp"] == 2


@pytest.mark.parametrize("source, match", [
    ("{file}:missing", "has no function 'missing'"),
    ("{file}:wrong", "returned the wrong things"),
    ("{file}:no_loss", "without \\['loss_fn'\\]"),
    ("{file}:NOT_A_FUNCTION", "has no function"),
    ("{dir}/nothing.py:build", "no file"),
    ("{dir}/not_a_config.json", "is not a transformers config"),
    ("{dir}/broken.json", "is not JSON"),
    ("{dir}", "no transformers config"),
    ("gpt-5", "unknown model 'gpt-5'"),
])
def test_bad_model_sources_are_named(user_file, tmp_path, source, match):
    (tmp_path / "not_a_config.json").write_text(json.dumps({"hidden": 64}))
    (tmp_path / "broken.json").write_text("{")
    source = source.format(file=user_file, dir=tmp_path)
    with pytest.raises(InvalidInputError, match=match) as err:
        load_workload(source)
    assert err.value.fix, str(err.value)


def test_the_command_line_reports_a_bad_model_source(user_file, capsys):
    assert main(["plan", f"{user_file}:wrong", "--cluster", "a100-80g", "--gpus", "2",
                 "--global-batch", "8"]) != 0
    err = capsys.readouterr().err
    assert "InvalidInputError" in err and "returned the wrong things" in err and "fix:" in err


def test_shape_flags_a_config_lacks_are_named(configs):
    with pytest.raises(InvalidInputError, match="--kv-heads does not apply"):
        load_workload(str(configs / "vit"), overrides={"kv_heads": 2})


def test_python_plan_matches_the_command_line_and_runs(tmp_path):
    """autopar.plan on a meta model against autopar plan on a file building the same model:
    the same plan and prediction. Its saved document runs under
    parallelize (world 1) and trains as one process does."""
    from autopar import models

    shape = dict(layers=3, hidden=64, heads=4, vocab=128, seq=32)
    zm = models.build("gpt", device="meta", dropout=0.0, **shape)
    tokens = torch.empty(2, 16, dtype=torch.long, device="meta")
    report = autopar.plan(zm.model, "cpu", devices=1, example_inputs=(tokens,),
                          example_targets=(tokens.clone(),), loss_fn=zm.loss_fn, global_batch=8,
                          seq=32, micro_batch_size=4)
    assert isinstance(report.plan, autopar.Plan) and report.plan.micro_batch_size == 4
    assert isinstance(report.prediction, autopar.Prediction)
    doc = report.document()
    assert doc["plan"]["model_fingerprint"] == report.plan.model_fingerprint
    script = tmp_path / "tiny_gpt.py"
    script.write_text("from autopar import models\n\n\ndef build():\n"
                      f"    zm = models.build('gpt', device='meta', dropout=0.0, **{shape!r})\n"
                      "    inputs, targets = zm.example_inputs(batch=2, seq=16)\n"
                      "    return zm.model, inputs, zm.loss_fn, targets\n")
    cli_doc = json.loads(_cli(["plan", f"{script}:build", "--seq", "32", "--cluster", "cpu",
                               "--gpus", "1", "--global-batch", "8", "--micro-batch", "4",
                               "--json"]))
    assert cli_doc["plan"]["model_fingerprint"] == report.plan.model_fingerprint
    assert cli_doc["prediction"]["step_time_s"] == pytest.approx(
        report.prediction.step_time_s, rel=1e-9)
    path = tmp_path / "plan.json"
    report.save(path)

    torch.manual_seed(0)
    model = models.build("gpt", dropout=0.0, **shape).model
    ref = models.build("gpt", dropout=0.0, **shape).model
    ref.load_state_dict(model.state_dict())
    data = torch.randint(0, 128, (8, 33), generator=torch.Generator().manual_seed(1))
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    pm = autopar.parallelize(model, example_inputs=(x,), example_targets=(y,),
                             loss_fn=zm.loss_fn, optimizer=sgd, plan=str(path))
    assert pm.plan.micro_batch_size == 4
    loss = pm.train_step((x,), (y,))
    opt = sgd(ref.parameters())
    want = zm.loss_fn(ref(x), y)
    want.backward()
    opt.step()
    assert loss == pytest.approx(want.item(), rel=1e-6)
    state = pm.state_dict()
    for k, v in ref.state_dict().items():
        if v.is_floating_point():
            torch.testing.assert_close(state[k], v, rtol=0, atol=1e-6, msg=k)
    pm.close()


def test_python_plan_refuses_bad_pins():
    with pytest.raises(InvalidInputError, match="bad pinned choice"):
        autopar.plan(nn.Linear(2, 2), "cpu", example_inputs=(torch.zeros(2, 2),),
                     loss_fn=lambda y: y.sum(), global_batch=2, colour="red")


def test_python_plan_prices_the_optimizer_it_is_given():
    """autopar.plan(optimizer=...) takes what parallelize takes and prices its profile on the
    cluster's device (OptimizerFactory.profile): on one H100 under bf16, plain SGD keeps the
    fp32 master weights alone (4 bytes a parameter of Adam's 12) and its step holds no
    temporary, where torch's foreach AdamW holds a 4-byte square root of every moment; SGD
    with momentum keeps 4 bytes more; an OptimizerProfile is taken whole."""
    from autopar import models

    zm = models.build("gpt", device="meta", dropout=0.0, layers=2, hidden=64, heads=4,
                      vocab=128, seq=32)
    tokens = torch.empty(2, 16, dtype=torch.long, device="meta")
    P = sum(p.numel() for p in zm.model.parameters())

    def memory(optimizer):
        report = autopar.plan(zm.model, "h100-80g", devices=1, example_inputs=(tokens,),
                              example_targets=(tokens.clone(),), loss_fn=zm.loss_fn,
                              global_batch=8, seq=32, micro_batch_size=8, zero=0,
                              recompute="none", optimizer=optimizer)
        return report.document()["prediction"]["memory"], report.document()["training"]

    adam, adam_training = memory(None)
    sgd, sgd_training = memory(functools.partial(torch.optim.SGD, lr=0.1))
    momentum, _ = memory(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    fused, fused_training = memory(autopar.OptimizerProfile(kernel="fused"))
    assert "optimizer" not in adam_training  # the default: AdamW on torch's default kernel
    assert adam["optimizer"] == pytest.approx(12 * P, rel=1e-6)
    assert adam["optimizer_step"] == pytest.approx(4 * P, rel=1e-6)
    assert sgd["optimizer"] == pytest.approx(4 * P, rel=1e-6) and sgd["optimizer_step"] == 0
    assert sgd_training["optimizer"]["state_bytes"] == 0.0
    assert sgd_training["optimizer"]["step"]["bytes_per_param"] == 12.0
    assert momentum["optimizer"] == pytest.approx(8 * P, rel=1e-6)
    assert fused["optimizer_step"] == 0 and fused_training["optimizer"] == {"kernel": "fused"}
