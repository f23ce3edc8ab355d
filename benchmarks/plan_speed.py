"""How long `autopar plan` takes on large clusters, end to end (a fresh process per run: the
interpreter's start, imports, building and capturing the model on meta, the search, the report).

    .venv/bin/python benchmarks/plan_speed.py            # prints the markdown table
    .venv/bin/python benchmarks/plan_speed.py --runs 3

Each configuration runs ``--runs`` times in a row; the table gives the median wall time and the
search's own time (what ``autopar plan`` prints as "searched ... in"), with the candidate
counts and the plan chosen.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = [
    # (label, autopar plan arguments)
    ("GPT-3 175B, 1024 A100, batch 1536",
     ["gpt3-175b", "--cluster", "a100-80g", "--gpus", "1024", "--global-batch", "1536"]),
    ("GPT-3 175B, 10240 A100, batch 7680",
     ["gpt3-175b", "--cluster", "a100-80g", "--gpus", "10240", "--global-batch", "7680"]),
    ("1T GPT (128 x 25600, Narayanan et al. 2021), 3072 A100, batch 3072",
     ["gpt", "--layers", "128", "--hidden", "25600", "--heads", "160", "--vocab", "51200",
      "--seq", "2048", "--cluster", "a100-80g", "--gpus", "3072", "--global-batch", "3072"]),
    ("LLaMA-65B, 2048 A100, batch 2048",
     ["llama-65b", "--cluster", "a100-80g", "--gpus", "2048", "--global-batch", "2048"]),
]


def run_once(args: list[str]) -> tuple[float, dict]:
    exe = os.path.join(os.path.dirname(sys.executable), "autopar")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        start = time.perf_counter()
        proc = subprocess.run([exe, "plan", *args, "--out", out], capture_output=True,
                              text=True, timeout=600)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"autopar plan {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
        with open(out) as f:
            doc = json.load(f)
    return wall, doc


def label(plan: dict) -> str:
    return (f"dp={plan['dp']} tp={plan['tp']} pp={plan['pp']} v={plan['virtual_stages']} "
            f"mbs={plan['micro_batch_size']} {plan['schedule']} recompute={plan['recompute']} "
            f"zero={plan['zero']}" + (" sp" if plan.get("sequence_parallel") else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; {args.runs} runs each; medians\n")
    print("| configuration | wall | search | candidates (priced) | plan |")
    print("|---|---|---|---|---|")
    for name, cli in CONFIGS:
        walls, searches, doc = [], [], {}
        for _ in range(args.runs):
            wall, doc = run_once(cli)
            walls.append(wall)
            searches.append(doc["search"]["search_s"])
        s = doc["search"]
        print(f"| {name} | {statistics.median(walls):.1f} s | {statistics.median(searches):.1f} s"
              f" | {s['candidates']} ({s['candidates_evaluated']}) | {label(doc['plan'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
