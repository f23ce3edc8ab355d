"""``autopar demo``: plan and train a small GPT on local CPU ranks, next to a single-process run.

The corpus (public-domain sonnets, a speech and fables, ``autopar/data/corpus.txt``) is tokenized
by character. Every rank builds the same GPT-2-style model; ``autopar.parallelize`` plans it for
the local world, priced on this machine (``autopar calibrate --quick`` the first time, cached:
:mod:`autopar.planner.calibration_cache`), and trains it with rank 0 drawing a progress bar. The
parent process then trains the same model, from the same weights and on the same batches, in one
process: the two loss curves must agree (fp32: to ~1e-6).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import torch

#: Adam's epsilon. With torch's 1e-8, Adam divides rounding noise on near-zero gradients by
#: ~1e-8 and turns fp32 reordering (the parallel sums run in another order) into visible steps;
#: 1e-5 (LLaMA's value) keeps the two runs within ~1e-5 of each other over the demo.
ADAM_EPS = 1e-5
#: Relative tolerance between the parallel and single-process losses at every step.
LOSS_RTOL = 1e-4

__all__ = ["DemoConfig", "run_demo", "corpus", "train_job", "reference_losses"]


@dataclass(frozen=True)
class DemoConfig:
    nproc: int = 4
    steps: int = 40
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    seq: int = 64
    global_batch: int = 16
    lr: float = 3e-3
    seed: int = 0
    pins: dict[str, Any] = field(default_factory=dict)
    #: The cluster file (or preset) the plan is priced on; None: this machine's cached quick
    #: calibration, measured on first use.
    cluster: str | None = None


def corpus() -> tuple[str, list[str]]:
    text = resources.files("autopar").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    return text, sorted(set(text))


def _vocab_size(chars: list[str]) -> int:
    return -(-len(chars) // 8) * 8  # a multiple of 8, so the vocabulary splits over tp ranks


def _build_model(cfg: DemoConfig, vocab: int):
    from autopar import models

    return models.build("gpt", layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads,
                        vocab=vocab, seq=cfg.seq, dropout=0.0, seed=cfg.seed)


def _batches(cfg: DemoConfig, text: str, chars: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    out = []
    for _ in range(cfg.steps):
        starts = torch.randint(0, len(ids) - cfg.seq - 1, (cfg.global_batch,), generator=gen)
        window = torch.stack([ids[s:s + cfg.seq + 1] for s in starts.tolist()])
        out.append((window[:, :-1].contiguous(), window[:, 1:].contiguous()))
    return out


def train_job(cfg: DemoConfig) -> dict[str, Any]:
    """Runs on every rank (a LocalPool job): parallelize, train, time each step."""
    import torch.distributed as dist

    import autopar

    text, chars = corpus()
    zm = _build_model(cfg, _vocab_size(chars))
    data = _batches(cfg, text, chars)
    start = time.perf_counter()
    pm = autopar.parallelize(zm.model, example_inputs=(data[0][0],), example_targets=(data[0][1],),
                             loss_fn=zm.loss_fn, plan=dict(cfg.pins) or "auto", cluster=cfg.cluster,
                             optimizer=functools.partial(torch.optim.AdamW, lr=cfg.lr, eps=ADAM_EPS))
    setup_s = time.perf_counter() - start
    losses, times = [], []
    progress = _progress(cfg.steps) if dist.get_rank() == 0 else None
    for tokens, targets in data:
        t0 = time.perf_counter()
        losses.append(pm.train_step(tokens, targets))
        times.append(time.perf_counter() - t0)
        if progress is not None:
            progress.update(losses[-1])
    if progress is not None:
        progress.close()
    result = dict(losses=losses, step_times=times, setup_s=setup_s,
                  plan=pm.plan.to_json(),
                  prediction=pm.prediction.to_json() if pm.prediction else None)
    pm.close()
    return result


def reference_losses(cfg: DemoConfig) -> list[float]:
    """The same model, weights and batches in one process, plain PyTorch."""
    text, chars = corpus()
    zm = _build_model(cfg, _vocab_size(chars))
    opt = torch.optim.AdamW(zm.model.parameters(), lr=cfg.lr, eps=ADAM_EPS)
    losses = []
    for tokens, targets in _batches(cfg, text, chars):
        opt.zero_grad()
        loss = zm.loss_fn(zm.model(tokens), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class _progress:
    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("training"), BarColumn(), TextColumn("{task.completed}/"
                             "{task.total}"), TextColumn("loss {task.fields[loss]}"),
                             TimeRemainingColumn(), transient=False)
        self._bar.start()
        self._task = self._bar.add_task("train", total=total, loss="-")

    def update(self, loss: float) -> None:
        self._bar.update(self._task, advance=1, loss=f"{loss:.4f}")

    def close(self) -> None:
        self._bar.stop()


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """The whole demo (parent process): the parallel run, the reference, the report."""
    from rich.table import Table

    from autopar.runtime.local_pool import LocalPool
    from autopar.units import console, fmt_seconds

    out = console()
    text, chars = corpus()
    out.print(f"[bold]autopar demo[/bold]: a {cfg.layers}-layer GPT (hidden {cfg.hidden}, "
              f"{cfg.heads} heads, {_vocab_size(chars)} tokens, context {cfg.seq}) on "
              f"{len(text):,} characters of public-domain text, {cfg.nproc} CPU ranks (gloo), "
              f"global batch {cfg.global_batch}, {cfg.steps} AdamW steps")
    own = cfg.cluster is None
    if own:
        from autopar.planner.calibration_cache import host_calibration

        cfg = dataclasses.replace(cfg, cluster=host_calibration(say=out.print))
    start = time.perf_counter()
    with LocalPool(cfg.nproc, timeout_s=600) as pool:
        results = pool.run(train_job, cfg, timeout_s=900)
    parallel_s = time.perf_counter() - start
    res = results[0]
    plan, pred = res["plan"], res["prediction"]
    table = Table(title="plan chosen by autopar")
    for col in ("dp", "tp", "pp", "micro-batch", "micro-batches", "schedule", "ZeRO", "seq. parallel"):
        table.add_column(col, justify="right")
    table.add_row(*(str(plan[k]) for k in ("dp", "tp", "pp", "micro_batch_size",
                                           "num_micro_batches", "schedule", "zero",
                                           "sequence_parallel")))
    out.print(table)
    measured = statistics.median(res["step_times"][2:] or res["step_times"])
    if pred:
        out.print(f"step time: predicted {fmt_seconds(pred['step_time_s'])}, measured "
                  f"{fmt_seconds(measured)} (median after 2 warm-up steps; "
                  f"{pred['step_time_s'] / measured - 1:+.0%})")
        out.print("priced on " + (f"this machine's quick calibration ({cfg.cluster}; delete it "
                                  f"to measure again)" if own else f"{cfg.cluster}"),
                  markup=False, highlight=False)
    else:
        out.print(f"step time: measured {fmt_seconds(measured)} (pinned plan: no prediction)")
    out.print(f"set-up (capture, plan, build) {res['setup_s']:.1f} s; the single-process "
              f"reference trains now ...")
    reference = reference_losses(cfg)
    curve = Table(title="loss: parallel vs single process")
    for col in ("step", "autopar", "single process", "difference"):
        curve.add_column(col, justify="right")
    shown = sorted({0, 1, 2, cfg.steps - 1} | set(range(0, cfg.steps, max(1, cfg.steps // 8))))
    for i in shown:
        curve.add_row(str(i + 1), f"{res['losses'][i]:.6f}", f"{reference[i]:.6f}",
                      f"{res['losses'][i] - reference[i]:+.1e}")
    out.print(curve)
    worst = max(abs(a - b) for a, b in zip(res["losses"], reference))
    # fp32: the parallel program sums in another order; equal to ~1e-7 at first, the difference
    # compounds through Adam to ~1e-5 relative over the demo's steps.
    agrees = all(abs(a - b) <= LOSS_RTOL * abs(b) for a, b in zip(res["losses"], reference))
    out.print(("[green]agrees[/green]" if agrees else "[red]DISAGREES[/red]") +
              f" with the single-process run (relative tolerance {LOSS_RTOL:g})")
    out.print(f"largest loss difference over {cfg.steps} steps: {worst:.1e}; loss "
              f"{reference[0]:.3f} -> {reference[-1]:.3f}; total {time.perf_counter() - start:.0f} s "
              f"(parallel run {parallel_s:.0f} s)")
    return dict(result=res, reference=reference, worst=worst, measured_step_s=measured,
                agrees=agrees)
