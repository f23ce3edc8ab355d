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
from typing import Any, Callable, Mapping

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
#: Special token ids inside the tiny vocabulary (some configs default to ids past it).
_TOKENS = dict(pad_token_id=0, bos_token_id=0, eos_token_id=0)
_NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_SEQ2SEQ = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                vocab_size=VOCAB, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                activation_dropout=0.0)
_IMAGE = dict(image_size=16, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_labels=8, **_NO_DROPOUT)


def _family_configs() -> dict[str, Callable[[], Any]]:
    """Family name -> the tiny config of that family (dropout and stochastic depth off), with
    ``architectures`` naming the class ``autopar plan`` would build from its config.json."""
    import transformers as tf

    def gpt2_like(cls, arch, **kw):
        return lambda: cls(n_embd=64, n_head=4, n_layer=2, vocab_size=VOCAB, n_positions=64,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                           eos_token_id=0, architectures=[arch], **kw)

    def decoder(cls, arch, **kw):
        return lambda: cls(**{**_DECODER, **kw}, architectures=[arch])

    return {
        # -- decoders --
        "gpt2": gpt2_like(tf.GPT2Config, "GPT2LMHeadModel"),
        "llama": decoder(tf.LlamaConfig, "LlamaForCausalLM", num_key_value_heads=2),
        "mistral": decoder(tf.MistralConfig, "MistralForCausalLM", num_key_value_heads=2),
        "qwen2": decoder(tf.Qwen2Config, "Qwen2ForCausalLM", num_key_value_heads=2),
        "qwen3": decoder(tf.Qwen3Config, "Qwen3ForCausalLM", num_key_value_heads=2, head_dim=16),
        "phi3": decoder(tf.Phi3Config, "Phi3ForCausalLM", num_key_value_heads=4, **_TOKENS),
        "gemma": decoder(tf.GemmaConfig, "GemmaForCausalLM", num_key_value_heads=2, head_dim=16),
        "gemma2": decoder(tf.Gemma2Config, "Gemma2ForCausalLM", num_key_value_heads=2,
                          head_dim=16, sliding_window=8),
        "opt": lambda: tf.OPTConfig(hidden_size=64, num_attention_heads=4, ffn_dim=128,
                                    vocab_size=VOCAB, max_position_embeddings=64,
                                    num_hidden_layers=2, word_embed_proj_dim=64, dropout=0.0,
                                    attention_dropout=0.0, architectures=["OPTForCausalLM"]),
        "gpt_neox": decoder(tf.GPTNeoXConfig, "GPTNeoXForCausalLM", hidden_dropout=0.0,
                            attention_dropout=0.0),
        "falcon": lambda: tf.FalconConfig(hidden_size=64, num_attention_heads=4,
                                          num_hidden_layers=2, vocab_size=VOCAB,
                                          hidden_dropout=0.0, attention_dropout=0.0,
                                          architectures=["FalconForCausalLM"]),
        "falcon_gqa": lambda: tf.FalconConfig(hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                                              new_decoder_architecture=True, num_hidden_layers=2,
                                              vocab_size=VOCAB, hidden_dropout=0.0,
                                              attention_dropout=0.0,
                                              architectures=["FalconForCausalLM"]),
        "bloom": lambda: tf.BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=VOCAB,
                                        hidden_dropout=0.0, attention_dropout=0.0,
                                        architectures=["BloomForCausalLM"]),
        "gptj": gpt2_like(tf.GPTJConfig, "GPTJForCausalLM", rotary_dim=8),
        "codegen": gpt2_like(tf.CodeGenConfig, "CodeGenForCausalLM", n_ctx=64, rotary_dim=8),
        "gpt_neo": lambda: tf.GPTNeoConfig(hidden_size=64, num_heads=4, num_layers=2,
                                           attention_types=[[["global", "local"], 1]],
                                           window_size=8, vocab_size=VOCAB,
                                           max_position_embeddings=64, resid_dropout=0.0,
                                           embed_dropout=0.0, attention_dropout=0.0,
                                           bos_token_id=0, eos_token_id=0,
                                           architectures=["GPTNeoForCausalLM"]),
        "phi": decoder(tf.PhiConfig, "PhiForCausalLM", resid_pdrop=0.0, embd_pdrop=0.0,
                       attention_dropout=0.0, partial_rotary_factor=0.5),
        "stablelm": decoder(tf.StableLmConfig, "StableLmForCausalLM", num_key_value_heads=2,
                            hidden_dropout=0.0, attention_dropout=0.0),
        "starcoder2": decoder(tf.Starcoder2Config, "Starcoder2ForCausalLM", num_key_value_heads=2,
                              residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0),
        "cohere": decoder(tf.CohereConfig, "CohereForCausalLM", num_key_value_heads=2, **_TOKENS),
        "granite": decoder(tf.GraniteConfig, "GraniteForCausalLM", num_key_value_heads=2),
        "olmo2": decoder(tf.Olmo2Config, "Olmo2ForCausalLM", num_key_value_heads=2, **_TOKENS),
        "glm4": decoder(tf.Glm4Config, "Glm4ForCausalLM", num_key_value_heads=2, **_TOKENS),
        "smollm3": decoder(tf.SmolLM3Config, "SmolLM3ForCausalLM", num_key_value_heads=2,
                           no_rope_layer_interval=2, **_TOKENS),  # the second layer: no rotary
        "biogpt": decoder(tf.BioGptConfig, "BioGptForCausalLM", **_NO_DROPOUT),
        "xglm": lambda: tf.XGLMConfig(d_model=64, attention_heads=4, ffn_dim=128, num_layers=2,
                                      vocab_size=VOCAB, max_position_embeddings=64, dropout=0.0,
                                      attention_dropout=0.0, activation_dropout=0.0,
                                      architectures=["XGLMForCausalLM"]),
        # -- encoders --
        "bert": decoder(tf.BertConfig, "BertForMaskedLM", **_NO_DROPOUT),
        "roberta": decoder(tf.RobertaConfig, "RobertaForMaskedLM", max_position_embeddings=80,
                           **_NO_DROPOUT),
        "xlm_roberta": decoder(tf.XLMRobertaConfig, "XLMRobertaForMaskedLM",
                               max_position_embeddings=80, **_NO_DROPOUT),
        "megatron_bert": decoder(tf.MegatronBertConfig, "MegatronBertForMaskedLM",
                                 **_NO_DROPOUT),
        "distilbert": lambda: tf.DistilBertConfig(dim=64, n_heads=4, n_layers=2, hidden_dim=128,
                                                  vocab_size=VOCAB, max_position_embeddings=64,
                                                  dropout=0.0, attention_dropout=0.0,
                                                  architectures=["DistilBertForMaskedLM"]),
        "electra": decoder(tf.ElectraConfig, "ElectraForMaskedLM", embedding_size=32,
                           **_NO_DROPOUT),
        "albert": decoder(tf.AlbertConfig, "AlbertForMaskedLM", embedding_size=32,
                          **_NO_DROPOUT),
        "deberta_v2": decoder(tf.DebertaV2Config, "DebertaV2ForMaskedLM", relative_attention=True,
                              position_buckets=16, **_NO_DROPOUT),
        "modernbert": decoder(tf.ModernBertConfig, "ModernBertForMaskedLM",
                              global_attn_every_n_layers=2, local_attention=8, cls_token_id=0,
                              sep_token_id=0, **_TOKENS),
        # -- images --
        "vit": lambda: tf.ViTConfig(**_IMAGE, intermediate_size=128,
                                    architectures=["ViTForImageClassification"]),
        "deit": lambda: tf.DeiTConfig(**_IMAGE, intermediate_size=128,
                                      architectures=["DeiTForImageClassification"]),
        "beit": lambda: tf.BeitConfig(**_IMAGE, intermediate_size=128, drop_path_rate=0.0,
                                      architectures=["BeitForImageClassification"]),
        "dinov2": lambda: tf.Dinov2Config(**_IMAGE, mlp_ratio=2, drop_path_rate=0.0,
                                          architectures=["Dinov2ForImageClassification"]),
        "swin": lambda: tf.SwinConfig(image_size=16, patch_size=2, num_channels=3, embed_dim=16,
                                      depths=[1, 1], num_heads=[2, 4], window_size=2,
                                      num_labels=8, drop_path_rate=0.0, **_NO_DROPOUT,
                                      architectures=["SwinForImageClassification"]),
        "convnext": lambda: tf.ConvNextConfig(num_stages=2, image_size=16, num_channels=3,
                                              hidden_sizes=[16, 32], depths=[1, 1], num_labels=8,
                                              drop_path_rate=0.0,
                                              architectures=["ConvNextForImageClassification"]),
        # -- encoder-decoders --
        "t5": lambda: tf.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                                  vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0,
                                  architectures=["T5ForConditionalGeneration"]),
        "mt5": lambda: tf.MT5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                                    vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0,
                                    architectures=["MT5ForConditionalGeneration"]),
        "bart": lambda: tf.BartConfig(**_SEQ2SEQ, architectures=["BartForConditionalGeneration"]),
        "mbart": lambda: tf.MBartConfig(**_SEQ2SEQ,
                                        architectures=["MBartForConditionalGeneration"]),
        "pegasus": lambda: tf.PegasusConfig(**_SEQ2SEQ,
                                            architectures=["PegasusForConditionalGeneration"]),
    }


def _config(name: str):
    configs = _family_configs()
    if name not in configs:
        raise KeyError(name)
    return configs[name]()


FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "opt",
            "gpt_neox", "falcon", "falcon_gqa", "bloom", "gptj", "codegen", "gpt_neo", "phi",
            "stablelm", "starcoder2", "cohere", "granite", "olmo2", "glm4", "smollm3", "biogpt",
            "xglm", "bert", "roberta", "xlm_roberta", "megatron_bert", "distilbert", "electra",
            "albert", "deberta_v2", "modernbert", "vit", "deit", "beit", "dinov2", "swin",
            "convnext", "t5", "mt5", "bart", "mbart", "pegasus")


def make_model(name: str, device: str = "cpu"):
    """The family's model (seeded: every call gives the same weights) and its loss."""
    import transformers as tf

    from autopar.models.workload import _task_of

    config = _config(name)
    config.use_cache = False
    cls = getattr(tf, config.architectures[0])
    # torch's fused attention where the class has it; written-out attention where it has not
    # (BLOOM, GPT-Neo, CodeGen, ... refuse "sdpa")
    config._attn_implementation = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config)
    task = _task_of(cls.__name__)
    _, _, loss_fn = task(config, 1, 1, "meta")
    return model.train(), loss_fn


def batches(name: str, steps: int) -> list[tuple[Any, tuple[torch.Tensor, ...]]]:
    gen = torch.Generator().manual_seed(11)
    out = []
    config = _config(name)
    for _ in range(steps):
        if hasattr(config, "image_size"):
            pixels = torch.randn(BATCH, 3, 16, 16, generator=gen)
            out.append(((pixels,), (torch.randint(0, 8, (BATCH,), generator=gen),)))
        elif config.is_encoder_decoder:
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
    dict. ``plan`` is pins, ``"auto"`` or an :class:`autopar.Plan` (stage cuts given). A failure is returned (as text), not raised, so one
    family does not hide the others."""
    out = []
    for name, plan in configs:
        start = time.perf_counter()
        try:
            model, loss_fn = make_model(name)
            data = batches(name, steps)
            pm = autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                                     loss_fn=loss_fn,
                                     plan=plan if plan == "auto" or isinstance(plan, autopar.Plan)
                                     else dict(plan),
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


def train_from_checkpoint(configs, root: str, steps: int = 2):
    """For each ``(family, plan)``: the model built on the meta device and loaded from
    ``root/<family>`` (what transformers' save_pretrained wrote of :func:`make_model`'s
    weights), trained ``steps`` steps, then saved back with ``pm.save_pretrained`` to
    ``root/<family>-saved``; rank 0 returns the losses and the state dict."""
    import os

    import transformers as tf

    out = []
    for name, plan in configs:
        try:
            config = _config(name)
            config.use_cache = False
            cls = getattr(tf, config.architectures[0])
            config._attn_implementation = "sdpa" if getattr(cls, "_supports_sdpa", False) \
                else "eager"
            with torch.device("meta"):
                model = cls(config).train()
            _, loss_fn = make_model(name, device="meta")
            data = batches(name, steps)
            pm = autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                                     loss_fn=loss_fn, plan=dict(plan), tp_cost=TINY_COST,
                                     timeout_s=TIMEOUT_S, checkpoint=os.path.join(root, name),
                                     optimizer=functools.partial(torch.optim.AdamW, lr=LR,
                                                                 eps=EPS))
            losses = [pm.train_step(inputs, targets) for inputs, targets in data]
            state = pm.state_dict()
            pm.save_pretrained(os.path.join(root, f"{name}-saved"))
            pm.close()
            out.append(dict(losses=losses, state=state if dist.get_rank() == 0 else None))
        except Exception as exc:  # noqa: BLE001 - reported per family by the test
            out.append(dict(error=f"{type(exc).__name__}: {exc}"[:2000]))
    return out
