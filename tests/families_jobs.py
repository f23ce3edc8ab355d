"""transformers families for tests/test_families.py: tiny configs, their batches, the
single-process reference and the job every rank of a LocalPool runs (importable by name).

Each family is the config ``autopar plan`` would read (``config.json``) and the model class its
``architectures`` names, with dropout off so that one process is an exact reference. The tasks
follow :data:`autopar.models.workload.TASKS`: causal LM (shifted tokens), masked LM, image
classification (pixels, one label per image), sequence-to-sequence (encoder ids, a padding
mask, decoder ids, decoder targets; given by keyword).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Mapping

import torch
import torch.distributed as dist

import autopar
from tp_helpers import TINY_COST

LR = 1e-3
#: A family that fails on one rank only must not hold the others for the default 300 s.
TIMEOUT_S = 60
EPS = 1e-5  # see tests/parallelize_jobs.py: Adam's epsilon vs reduction-order noise
BATCH, SEQ, VOCAB = 8, 16, 128
_DECODER = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=VOCAB,
                max_position_embeddings=64, num_hidden_layers=2)


def _config(name: str):
    import transformers as tf

    if name == "gpt2":
        return tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                             eos_token_id=0,
                             architectures=["GPT2LMHeadModel"])
    if name == "llama":
        return tf.LlamaConfig(**_DECODER, num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    if name == "mistral":
        return tf.MistralConfig(**_DECODER, num_key_value_heads=2,
                                architectures=["MistralForCausalLM"])
    if name == "qwen2":  # biases on q, k, v
        return tf.Qwen2Config(**_DECODER, num_key_value_heads=2,
                              architectures=["Qwen2ForCausalLM"])
    if name == "qwen3":  # q and k norms
        return tf.Qwen3Config(**_DECODER, num_key_value_heads=2, head_dim=16,
                              architectures=["Qwen3ForCausalLM"])
    if name == "phi3":  # fused qkv and gate-up projections
        return tf.Phi3Config(**_DECODER, num_key_value_heads=4, pad_token_id=0,
                             bos_token_id=0, eos_token_id=0,
                             architectures=["Phi3ForCausalLM"])
    if name == "gemma":  # scaled embeddings, tied head, GeGLU
        return tf.GemmaConfig(**_DECODER, num_key_value_heads=2, head_dim=16,
                              architectures=["GemmaForCausalLM"])
    if name == "opt":
        return tf.OPTConfig(hidden_size=64, num_attention_heads=4, ffn_dim=128,
                            vocab_size=VOCAB, max_position_embeddings=64, num_hidden_layers=2,
                            word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0,
                            architectures=["OPTForCausalLM"])
    if name == "gpt_neox":  # parallel residual, fused qkv, partial rotary
        return tf.GPTNeoXConfig(**_DECODER, hidden_dropout=0.0, attention_dropout=0.0,
                                architectures=["GPTNeoXForCausalLM"])
    if name == "bert":
        return tf.BertConfig(**_DECODER, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0, architectures=["BertForMaskedLM"])
    if name == "roberta":
        return tf.RobertaConfig(**{**_DECODER, "max_position_embeddings": 80},
                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                architectures=["RobertaForMaskedLM"])
    if name == "vit":
        return tf.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=64,
                            num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                            num_labels=8, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0,
                            architectures=["ViTForImageClassification"])
    if name == "t5":
        return tf.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                           vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0,
                           architectures=["T5ForConditionalGeneration"])
    if name == "bart":
        return tf.BartConfig(d_model=64, encoder_layers=2, decoder_layers=2,
                             encoder_attention_heads=4, decoder_attention_heads=4,
                             encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=VOCAB,
                             max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                             activation_dropout=0.0, architectures=["BartForConditionalGeneration"])
    raise KeyError(name)


FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "opt", "gpt_neox",
            "bert", "roberta", "vit", "t5", "bart")


def make_model(name: str, device: str = "cpu"):
    """The family's model (seeded: every call gives the same weights) and its loss."""
    import transformers as tf

    from autopar.models.workload import _task_of

    config = _config(name)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    cls = getattr(tf, config.architectures[0])
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config)
    task = _task_of(cls.__name__)
    _, _, loss_fn = task(config, 1, 1, "meta")
    return model.train(), loss_fn


def batches(name: str, steps: int) -> list[tuple[Any, tuple[torch.Tensor, ...]]]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        if name == "vit":
            pixels = torch.randn(BATCH, 3, 16, 16, generator=gen)
            out.append(((pixels,), (torch.randint(0, 8, (BATCH,), generator=gen),)))
        elif name in ("t5", "bart"):
            src = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
            tgt = torch.randint(1, VOCAB, (BATCH, SEQ // 2 + 1), generator=gen)
            mask = torch.ones(BATCH, SEQ, dtype=torch.long)
            mask[::2, SEQ - 3:] = 0  # every other source sequence padded by 3
            out.append(({"input_ids": src, "attention_mask": mask,
                         "decoder_input_ids": tgt[:, :-1].contiguous()},
                        (tgt[:, 1:].contiguous(),)))
        else:
            tokens = torch.randint(1, VOCAB, (BATCH, SEQ + 1), generator=gen)
            out.append(((tokens[:, :-1].contiguous(),), (tokens[:, 1:].contiguous(),)))
    return out


def _call(model, inputs):
    return model(**inputs) if isinstance(inputs, Mapping) else model(*inputs)


def reference(name: str, steps: int = 2) -> dict[str, Any]:
    """One process, fp32, AdamW: the losses and every parameter after ``steps`` steps."""
    model, loss_fn = make_model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for inputs, targets in batches(name, steps):
        opt.zero_grad()
        loss = loss_fn(_call(model, inputs), *targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return dict(losses=losses, state={k: v.detach().clone() for k, v in
                                      model.state_dict().items()})


def train(configs, steps: int = 2):
    """For each ``(family, plan)``: parallelize, train ``steps`` steps; rank 0 returns the state
    dict. ``plan`` is pins or ``"auto"``. A failure is returned (as text), not raised, so one
    family does not hide the others."""
    out = []
    for name, plan in configs:
        start = time.perf_counter()
        try:
            model, loss_fn = make_model(name)
            data = batches(name, steps)
            pm = autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                                     loss_fn=loss_fn, plan=plan if plan == "auto" else dict(plan),
                                     tp_cost=TINY_COST, timeout_s=TIMEOUT_S, optimizer=functools.partial(
                                         torch.optim.AdamW, lr=LR, eps=EPS))
            losses = [pm.train_step(inputs, targets) for inputs, targets in data]
            state = pm.state_dict()
            chosen = pm.plan
            result = dict(losses=losses, state=state if dist.get_rank() == 0 else None,
                          plan=(chosen.dp, chosen.tp, chosen.pp, chosen.zero))
            pm.close()
        except Exception as exc:  # noqa: BLE001 - reported per family by the test
            result = dict(error=f"{type(exc).__name__}: {exc}"[:2000])
        result["seconds"] = time.perf_counter() - start
        out.append(result)
    return out
