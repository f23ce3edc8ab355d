"""Summaries of a captured model's analysis, shared by ``autopar inspect`` and the API."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from autopar.ir import LayerKind, evaluate, next_block_names

__all__ = ["ModelReport", "inspect_model", "profile_report"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ModelReport:
    model: str
    batch: int
    seq: int
    dtype: str
    params: int
    forward_flops: int
    activation_bytes: int
    layers: list[dict[str, Any]]
    capture_method: str
    capture_s: float
    analyze_s: float
    #: Blocks captured when a shallower copy was (the rest repeat the last one); None: all.
    blocks_captured: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "batch": self.batch, "seq": self.seq, "dtype": self.dtype,
            "params": self.params, "forward_flops": self.forward_flops,
            "activation_bytes": self.activation_bytes, "layers": self.layers,
            "capture": {"method": self.capture_method, "capture_s": round(self.capture_s, 3),
                        "analyze_s": round(self.analyze_s, 3),
                        **({"blocks_captured": self.blocks_captured}
                           if self.blocks_captured is not None else {})},
        }


def profile_report(profile, batch: int, seq: int) -> tuple[list[dict[str, Any]], int, int]:
    """Per-layer numbers at a concrete (batch, seq): rows, total FLOPs, total activations."""
    rows = []
    for layer in profile.layers:
        rows.append({
            "name": layer.name,
            "kind": layer.kind.value,
            "signature": layer.signature,
            "params": layer.params,
            "forward_flops": int(evaluate(layer.flops, b=batch, s=seq)),
            "activation_bytes": int(evaluate(layer.saved_bytes, b=batch, s=seq)),
            "boundary_bytes": int(evaluate(layer.boundary_bytes, b=batch, s=seq)),
            "modules": list(layer.modules),
        })
    return rows, sum(r["forward_flops"] for r in rows), sum(r["activation_bytes"] for r in rows)


def inspect_model(name: str, *, batch: int = 1, seq: int | None = None, dtype: str = "fp32",
                  full: bool = False, **overrides: Any) -> ModelReport:
    """Build what ``name`` names (a zoo preset or family, a transformers config,
    ``file.py:function``) on the meta device, capture it with its loss, analyze it.

    A model deeper than :data:`autopar.models.workload.CAPTURE_BLOCKS` blocks is built and
    captured that deep and its last block repeated to the real depth, as the planner does
    (GPT-3 175B's 96 blocks take ~55 s to export on a 2-core machine, two take ~3 s);
    ``full=True`` captures every block."""
    from autopar.frontend import capture
    from autopar.ir import SEQ
    from autopar.models.workload import load_workload
    from autopar.passes.analyze import analyze

    start = time.perf_counter()
    work = load_workload(name, overrides=overrides, shallow=not full)
    work.model.to(DTYPES[dtype])
    captured = capture(work.model, work.example_inputs, work.loss_fn,
                       example_targets=work.example_targets)
    seq = seq or work.max_seq or captured.example_sizes.get(SEQ, 1)
    captured_at = time.perf_counter()
    profile = analyze(captured)
    done = time.perf_counter()
    rows, _, _ = profile_report(profile, batch, seq)
    params = profile.params
    blocks = [i for i, r in enumerate(rows) if r["kind"] == LayerKind.BLOCK.value]
    captured_blocks = None
    if work.depth is not None and blocks and work.depth > len(blocks):
        captured_blocks = len(blocks)
        last = rows[blocks[-1]]
        extra = _repeat_block(last, work.depth - len(blocks))
        # what crosses after a block followed by a block (a LLaMA's rotary tables too) is
        # what the captured blocks but the last send; the last real block sends what it does
        if len(blocks) > 1:
            between = rows[blocks[-2]]["boundary_bytes"]
            extra[-1] = {**extra[-1], "boundary_bytes": last["boundary_bytes"]}
            for r in [last, *extra[:-1]]:
                r["boundary_bytes"] = between
        rows[blocks[-1] + 1:blocks[-1] + 1] = extra
        params += sum(r["params"] for r in extra)  # a block's weights are its own
    return ModelReport(model=work.name, batch=batch, seq=seq, dtype=dtype, params=params,
                       forward_flops=sum(r["forward_flops"] for r in rows),
                       activation_bytes=sum(r["activation_bytes"] for r in rows), layers=rows,
                       capture_method=captured.method.value, capture_s=captured_at - start,
                       analyze_s=done - captured_at, blocks_captured=captured_blocks)


def _repeat_block(row: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """``count`` copies of a block's row, named as the blocks after it (``h.1`` -> ``h.2``, ...;
    its modules renamed alike)."""
    name = row["name"]
    out = []
    for new in next_block_names(name, count):
        modules = [new + m[len(name):] if m == name or m.startswith(name + ".") else m
                   for m in row["modules"]]
        out.append({**row, "name": new, "modules": modules})
    return out


def collapse_repeated(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], int, str]]:
    """Group consecutive rows with the same signature: (row, count, display name)."""
    groups: list[tuple[dict[str, Any], int, str]] = []
    i = 0
    while i < len(rows):
        j = i
        while (j + 1 < len(rows) and rows[j + 1]["signature"] == rows[i]["signature"]
               and rows[i]["kind"] == LayerKind.BLOCK.value):
            j += 1
        count = j - i + 1
        first, last = rows[i]["name"], rows[j]["name"]
        prefix = first.rpartition(".")[0]
        if count > 1 and last.startswith(prefix + "."):
            name = f"{prefix}.[{first.rpartition('.')[2]}-{last.rpartition('.')[2]}]"
        else:
            name = first if count == 1 else f"{first} .. {last}"
        groups.append((rows[i], count, name))
        i = j + 1
    return groups
