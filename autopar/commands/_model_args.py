"""Model selection flags shared by subcommands: MODEL (a zoo preset or family, a transformers
config, or file.py:function; see autopar.models.workload) plus shape overrides."""

from __future__ import annotations

import argparse

SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq")


def add_model_args(parser: argparse.ArgumentParser, *, seq_help: str | None = None) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="a zoo preset (gpt2-small, gpt3-175b, bert-base, llama-7b, ...), "
                             "a family (gpt, bert, llama) shaped by the flags below, a "
                             "transformers config.json or a directory holding one (built on "
                             "meta, the task head from its architectures), or "
                             "path/to/file.py:function returning (model, example_inputs, "
                             "loss_fn[, example_targets])")
    shape = parser.add_argument_group("model shape (override a preset or config, or shape a "
                                      "family)")
    shape.add_argument("--layers", type=int)
    shape.add_argument("--hidden", type=int)
    shape.add_argument("--heads", type=int)
    shape.add_argument("--kv-heads", dest="kv_heads", type=int)
    shape.add_argument("--ffn-hidden", dest="ffn_hidden", type=int)
    shape.add_argument("--vocab", type=int)
    shape.add_argument("--max-seq", dest="max_seq", type=int,
                       help="positions the model supports (default: the preset's; for a family, "
                            "--seq when given)")


def model_overrides(args: argparse.Namespace) -> dict:
    from autopar.models import FAMILIES

    out = {k: getattr(args, k, None) for k in SHAPE_FLAGS if k != "seq"}
    if getattr(args, "max_seq", None):
        out["seq"] = args.max_seq
    elif args.model in FAMILIES and getattr(args, "seq", None):
        out["seq"] = args.seq  # a family shaped by flags supports the sequence it is planned for
    return {k: v for k, v in out.items() if v is not None}
