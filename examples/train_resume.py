"""Train with periodic checkpoints and resume from the newest one after a restart.

    autopar run examples/train_resume.py --nproc 2 --max-restarts 1 -- --ckpt runs/gpt --steps 8

Every rank parallelizes a small GPT (examples/gpt.py), loads the newest complete checkpoint
under ``--ckpt`` if there is one (``pm.load_latest``: a save cut short by a lost rank has no
completion marker and is skipped), trains to ``--steps`` steps saving every ``--every`` steps, and
rank 0 writes the final parameters to ``--out`` (a dict of tensors: ``torch.load(path,
weights_only=True)`` reads it). The batch of step ``i`` depends only on ``i``, so a resumed run
sees the same data as an uninterrupted one.

``--fail-at N`` injects a fault for tests: on the first attempt only
(``TORCHELASTIC_RESTART_COUNT`` is 0), rank 1 exits abruptly before step N, as a lost machine
would; torchrun (``--max-restarts``) stops the other ranks and restarts them all.
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
import torch.distributed as dist

import autopar
from autopar.runtime.checkpoint import step_dir

try:
    from examples.gpt import GPT, GPTConfig, gpt_loss
except ImportError:  # run as a script: examples/ itself is on sys.path
    from gpt import GPT, GPTConfig, gpt_loss

VOCAB, SEQ, BATCH = 128, 16, 8


def batch(step: int) -> tuple[tuple[torch.Tensor], tuple[torch.Tensor]]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(1000 + step))
    return (tokens[:, :-1].contiguous(),), (tokens[:, 1:].contiguous(),)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="checkpoint root (step-<N> directories)")
    p.add_argument("--out", help="rank 0 writes the final parameters here")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--every", type=int, default=2, help="save every k steps")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (dp = world / pp)")
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout (s)")
    p.add_argument("--fail-at", type=int, help="fault injection: rank 1 dies before this step "
                                               "on the first attempt")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, hidden=64, heads=4, vocab=VOCAB, seq=32))
    world = int(os.environ.get("WORLD_SIZE", 1))
    pm = autopar.parallelize(
        model, example_inputs=batch(0)[0], example_targets=batch(0)[1], loss_fn=gpt_loss,
        plan={"dp": world // args.pp, "pp": args.pp, "tp": 1, "num_micro_batches": 2,
              "zero": args.zero},
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), timeout_s=args.timeout)
    rank = dist.get_rank()
    resumed = pm.load_latest(args.ckpt)
    if rank == 0:
        print(f"attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}: "
              + (f"resumed from step {resumed}" if resumed is not None else "starting fresh"),
              flush=True)
    while pm.steps < args.steps:
        if (args.fail_at is not None and pm.steps == args.fail_at and rank == 1
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            os._exit(1)  # a lost rank: no cleanup, no goodbye to the others
        loss = pm.train_step(*batch(pm.steps))
        if rank == 0:
            print(f"step {pm.steps} loss {loss:.6f}", flush=True)
        if pm.steps % args.every == 0:
            pm.save(step_dir(args.ckpt, pm.steps))
    state = pm.state_dict()
    if rank == 0 and args.out:
        torch.save(state, args.out)
    pm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
