"""Hugging Face safetensors checkpoints read by shard, and every bad checkpoint named.

The reference for the slices is ``shard_tensor`` of the full tensor (the same slicing the
tensor-parallel program uses); for the errors, the message must name the offending tensors with
expected and found. The multi-rank runs against one process are in tests/test_parallelize.py
(``test_a_meta_model_trains_from_a_hugging_face_checkpoint``).
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import save_file

import autopar
from autopar.errors import InvalidInputError
from autopar.runtime.hf_checkpoint import SafetensorsCheckpoint, TensorEntry
from autopar.sharding import Replicate, Shard, StridedShard, make_shard, shard_tensor

import parallelize_jobs as jobs


@pytest.fixture(scope="module")
def gpt_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model, _ = jobs.make_model("gpt")
    path = tmp_path_factory.mktemp("gpt")
    model.save_pretrained(path)
    return path, model


def _entry(name, t, required=True):
    return TensorEntry(name, (name,), tuple(t.shape), t.dtype, required)


def test_slices_equal_the_programs_own_slicing(tmp_path):
    full = {"w": torch.randn(8, 6), "v": torch.randn(12, 4), "b": torch.randn(6)}
    save_file(full, tmp_path / "model.safetensors")
    ck = SafetensorsCheckpoint(tmp_path)
    for placement in (Replicate(), Shard(0), Shard(1), make_shard(0, 3)):
        name = "v" if isinstance(placement, StridedShard) else "w"
        for rank in range(2):
            got = ck.read(_entry(name, full[name]), placement, 2, rank)
            assert torch.equal(got, shard_tensor(full[name], placement, 2, rank)), placement
    as_bf16 = TensorEntry("b", ("b",), (6,), torch.bfloat16)
    assert ck.read(as_bf16).dtype == torch.bfloat16  # converted as the plan stores it


def test_an_index_and_its_shard_files_are_read(tmp_path, gpt_checkpoint):
    _, model = gpt_checkpoint
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    ck = SafetensorsCheckpoint(tmp_path)
    files = {f for f, _, _ in ck.tensors.values()}
    assert len(files) > 1
    wte = model.transformer.wte.weight
    entry = TensorEntry("transformer.wte.weight", ("transformer.wte.weight", "lm_head.weight"),
                        tuple(wte.shape), wte.dtype)
    assert torch.equal(ck.read(entry, Shard(0), 2, 1), wte.detach().chunk(2)[1])


def test_each_bad_checkpoint_is_named(tmp_path, gpt_checkpoint):
    path, model = gpt_checkpoint
    entries = [TensorEntry(n, (n,), tuple(p.shape), p.dtype)
               for n, p in model.named_parameters()]
    SafetensorsCheckpoint(path).check(entries)  # the good one passes

    with pytest.raises(InvalidInputError, match="missing from the checkpoint: extra.weight"):
        SafetensorsCheckpoint(path).check(entries + [_entry("extra.weight", torch.zeros(3))])
    with pytest.raises(InvalidInputError,
                       match="in the checkpoint but not in the model: transformer.h.0"):
        SafetensorsCheckpoint(path).check([e for e in entries if not e.fqn.startswith(
            "transformer.h.0.")])
    wrong = [TensorEntry(e.fqn, e.names, (e.shape[0] + 1, *e.shape[1:]), e.dtype)
             if e.fqn == "transformer.wpe.weight" else e for e in entries]
    with pytest.raises(InvalidInputError, match=r"shapes differ: transformer.wpe.weight: "
                                                r"expected \(\d+, 64\), found"):
        SafetensorsCheckpoint(path).check(wrong)

    cut = tmp_path / "cut"
    cut.mkdir()
    data = (path / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidInputError, match="not a complete safetensors file"):
        SafetensorsCheckpoint(cut)

    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (sharded / victim).unlink()
    with pytest.raises(InvalidInputError, match="(?s)shard files that are not there.*" + victim):
        SafetensorsCheckpoint(sharded)

    with pytest.raises(InvalidInputError, match="no safetensors checkpoint"):
        SafetensorsCheckpoint(tmp_path)  # a directory without one


def test_parallelize_refuses_an_init_that_leaves_meta_and_another_models_checkpoint(
        gpt_checkpoint, tmp_path):
    path, _ = gpt_checkpoint
    llama, loss_fn = jobs.make_model("llama", "meta")
    data = jobs.batches("llama", 1)
    kwargs = dict(example_inputs=data[0][0], example_targets=data[0][1], loss_fn=loss_fn,
                  plan={"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 1},
                  optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    with pytest.raises(InvalidInputError, match="tensor.s. on the meta device") as err:
        autopar.parallelize(llama, init=lambda m: None if m is not llama.lm_head
                            else torch.nn.init.normal_(m.weight), **kwargs)
    assert "model.embed_tokens.weight" in str(err.value)  # the first of them, named
    with pytest.raises(InvalidInputError, match="init= initializes a model built on the meta"):
        autopar.parallelize(llama, checkpoint=path, init=lambda m: None, **kwargs)
    with pytest.raises(InvalidInputError, match="does not fit the model") as err:
        autopar.parallelize(llama, checkpoint=path, **kwargs)  # GPT-2's weights
    assert "missing from the checkpoint: model." in str(err.value)
    assert "in the checkpoint but not in the model: transformer." in str(err.value)
    with pytest.raises(InvalidInputError, match="verify=True"):
        autopar.parallelize(llama, checkpoint=path, verify=True, **kwargs)


def test_the_streaming_writer_is_read_back_by_safetensors_itself(tmp_path):
    """The writer lays the safetensors headers out itself (to hold one tensor at a time);
    safetensors' own loader and this module's reader must read back every byte, in one file
    and across shard files with an index."""
    from safetensors.torch import load_file

    from autopar.runtime.hf_checkpoint import SafetensorsWriter, parse_size

    gen = torch.Generator().manual_seed(3)
    tensors = {"a.weight": torch.randn(5, 3, generator=gen),
               "b.bias": torch.randn(7, generator=gen).to(torch.bfloat16),
               "c.ids": torch.arange(6).reshape(1, 6), "d.scalar": torch.tensor(2.5),
               "e.mask": torch.tensor([True, False, True])}
    order = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    for limit, files in ((10 ** 6, 1), (40, 4)):
        path = tmp_path / f"out{limit}"
        writer = SafetensorsWriter(path, order, limit)
        for k, v in tensors.items():
            writer.write(k, v)
        writer.commit()
        written = sorted(p.name for p in path.glob("*.safetensors"))
        assert len(written) == files and not list(tmp_path.glob(".*partial*"))
        back = {}
        for name in written:
            back.update(load_file(path / name))
        assert back.keys() == tensors.keys()
        for k, v in tensors.items():
            assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
        ck = SafetensorsCheckpoint(path)
        assert torch.equal(ck.read(_entry("a.weight", tensors["a.weight"]), Shard(1), 3, 2),
                           tensors["a.weight"][:, 2:3])
    assert parse_size("5GB") == 5 * 10 ** 9 and parse_size("20KB") == 20_000
    with pytest.raises(InvalidInputError, match="not a size"):
        parse_size("lots")


def test_an_aborted_or_misordered_write_leaves_nothing_behind(tmp_path):
    from autopar.runtime.hf_checkpoint import SafetensorsWriter

    order = [("x", (2,), torch.float32), ("y", (3,), torch.float32)]
    writer = SafetensorsWriter(tmp_path / "ck", order, 10 ** 6)
    writer.write("x", torch.zeros(2))
    with pytest.raises(InvalidInputError, match="out of order"):
        writer.write("x", torch.zeros(2))
    writer.abort()
    assert not (tmp_path / "ck").exists() and not list(tmp_path.iterdir())
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(InvalidInputError, match="not an empty directory"):
        SafetensorsWriter(tmp_path / "full", order, 10 ** 6)


def test_a_meta_model_from_a_checkpoint_trains_like_the_real_model(gpt_checkpoint, tmp_path):
    """In one process, fp32 and mixed precision: the meta model loaded from the checkpoint of
    a real model's weights takes the same steps as parallelize on that real model (the same
    weights through the same program: equal to the bit); the tied LM head stays tied."""
    for mixed in (False, True):
        losses = {}
        for source in ("real", "meta"):
            torch.manual_seed(0)
            model, loss_fn = jobs.make_model("gpt", "cpu" if source == "real" else "meta")
            data = jobs.batches("gpt", 2)
            pm = autopar.parallelize(
                model, example_inputs=data[0][0], example_targets=data[0][1], loss_fn=loss_fn,
                plan={"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 2},
                optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), mixed_precision=mixed,
                checkpoint=gpt_checkpoint[0] if source == "meta" else None)
            losses[source] = [pm.train_step(i, t) for i, t in data]
            state = pm.state_dict()
            assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
            pm.close()
        assert losses["meta"] == losses["real"], (mixed, losses)


def test_transformers_checkpoint_names_are_read_through_its_own_conversions(tmp_path):
    """transformers' save_pretrained of a Mixtral writes each expert's w1 / w2 / w3 apart (its
    model holds them fused: experts.gate_up_proj, experts.down_proj) and the router under
    block_sparse_moe: read through transformers' own conversions (autopar/hf_names.py), every
    model tensor equals the model's, whole and as shards along the experts (what an expert-
    parallel rank keeps); a checkpoint that lacks one expert's tensor names the fused tensor it
    cannot make, before anything is read."""
    import transformers as tf
    from safetensors.torch import load_file

    from autopar.hf_names import checkpoint_keys

    torch.manual_seed(0)
    config = tf.MixtralConfig(hidden_size=32, num_attention_heads=4, intermediate_size=48,
                              vocab_size=64, num_hidden_layers=2, num_key_value_heads=2,
                              num_local_experts=4, num_experts_per_tok=2)
    model = tf.MixtralForCausalLM(config)
    model.save_pretrained(tmp_path / "mixtral")
    with torch.device("meta"):
        meta = tf.MixtralForCausalLM(config)
    source = SafetensorsCheckpoint(tmp_path / "mixtral", functools.partial(checkpoint_keys, meta))
    assert "model.layers.1.mlp.experts.gate_up_proj" in source.keys.converted
    state = model.state_dict()
    entries = [_entry(n, t) for n, t in state.items()]
    source.check(entries)
    for e in entries:
        assert torch.equal(source.read(e), state[e.fqn]), e.fqn
    fused = _entry("model.layers.0.mlp.experts.gate_up_proj",
                   state["model.layers.0.mlp.experts.gate_up_proj"])
    for rank in range(2):
        piece = source.read(fused, Shard(0), 2, rank)
        assert torch.equal(piece, state[fused.fqn].chunk(2)[rank])

    tensors = load_file(tmp_path / "mixtral" / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w1.weight"]
    (tmp_path / "short").mkdir()
    save_file(tensors, tmp_path / "short" / "model.safetensors")
    with pytest.raises(InvalidInputError, match="not made by converting the checkpoint's tensors: "
                                                "model.layers.1.mlp.experts.gate_up_proj"):
        SafetensorsCheckpoint(tmp_path / "short",
                              functools.partial(checkpoint_keys, meta)).check(entries)
