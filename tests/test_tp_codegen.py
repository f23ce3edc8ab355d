"""Generated per-rank source: compiles, loads its shards as the API slices them, round-trips
the state dict, counts its collectives, and is byte-identical across runs and processes."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from autopar import PlanMismatchError
from autopar.cli import main
from autopar.ir import info
from autopar.sharding import StridedShard, is_sharded, shard_tensor
from autopar.tensor_parallel import tensor_parallelize
from tp_helpers import TINY_COST, block_layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [("gpt", 2, False), ("bert", 2, True), ("llama", 4, False), ("own_gpt", 4, True)]


@pytest.fixture(scope="module")
def programs(tiny_models):
    return {(family, tp, sp): tensor_parallelize(tiny_models[family][4], tp, sequence_parallel=sp,
                                                 cost=TINY_COST)
            for family, tp, sp in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-tp{c[1]}{'-sp' if c[2] else ''}")
def test_every_rank_compiles_and_loads_its_shards(tiny_models, programs, case):
    family, tp, _ = case
    model = tiny_models[family][0]
    program = programs[case]
    full = program.full_tensors(model)
    shards = []
    for rank in range(tp):
        source = program.source(rank)
        compile(source, f"rank{rank}.py", "exec")
        module = program.module_class(rank)(SimpleNamespace(size=tp, rank=rank))
        module.load_full_state_dict(full)  # the generated slicing
        api = program.shard_state_dict(model, rank)  # the API's slicing
        state = module.state_dict()
        assert set(state) == set(api)
        for key, tensor in api.items():
            assert torch.equal(state[key], tensor), (rank, key)
        shards.append(state)
        with pytest.raises(PlanMismatchError, match=f"rank {rank}"):
            program.module_class(rank)(SimpleNamespace(size=tp, rank=(rank + 1) % tp))
    gathered = program.gather_state_dict(shards, check_replicas=True)
    for name, tensor in full.items():
        if name in gathered:
            assert torch.equal(gathered[name], tensor), name
    params = dict(model.named_parameters(remove_duplicate=False))
    assert set(params) <= set(gathered)  # tied names included


def test_slicing_matches_torch_placements():
    """autopar.sharding's slices against DTensor's own (_split_tensor) for Shard and the
    block-interleaved StridedShard of fused QKV."""
    from torch.distributed.tensor.placement_types import Shard

    t = torch.arange(4 * 24).reshape(4, 24).float()
    for placement in (Shard(1), StridedShard(1, split_factor=3), Shard(0)):
        for tp in (2, 4):
            ref, _ = placement._split_tensor(t, tp, with_padding=False)
            for rank in range(tp):
                assert torch.equal(shard_tensor(t, placement, tp, rank), ref[rank])


def test_generated_source_names_its_collectives(programs):
    program = programs[("gpt", 2, False)]
    source = program.source(0)
    blocks = block_layers(program)
    sections = source.split("# ---- ")
    for block in blocks:
        body = next(s for s in sections if s.startswith(block + " ----"))
        assert body.count("tp.all_reduce(") == 2
        assert body.count("tp.copy_to_tp(") == 2  # Megatron's f, once per block half
    assert "tp.vocab_parallel_cross_entropy(" in source
    assert "tp.vocab_parallel_embedding(" in source
    sp = programs[("bert", 2, True)].source(1)
    for block in block_layers(programs[("bert", 2, True)]):
        body = next(s for s in sp.split("# ---- ") if s.startswith(block + " ----"))
        assert body.count("tp.all_gather(") == 2 and body.count("tp.reduce_scatter(") == 2
        assert "tp.all_reduce(" not in body


def test_per_rank_graph_keeps_layers_and_marks_collectives(programs):
    program = programs[("llama", 4, False)]
    collectives = [n for n in program.gm.graph.nodes if n.op == "call_function"
                   and info(n).collective is not None]
    assert collectives and all(info(n).layer for n in collectives)
    params = [n for n in program.gm.graph.nodes if n.op == "placeholder"][1:]
    for n in params:
        meta = info(n)
        if meta.spec is not None and is_sharded(meta.placement):
            assert meta.local_value.shape[meta.placement.dim] * 4 == meta.spec.shape[meta.placement.dim]


def test_sources_are_deterministic(tiny_models, programs):
    again = tensor_parallelize(tiny_models["gpt"][4], 2, cost=TINY_COST)
    first = programs[("gpt", 2, False)]
    for rank in range(2):
        assert again.source(rank) == first.source(rank)


CLI = ["codegen", "gpt", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "128",
       "--max-seq", "32", "--tp", "2", "--sp", "--batch", "8", "--seq", "32"]


def test_cli_writes_identical_files_across_processes(tmp_path, capsys):
    """Every rank's file, written by this process and by another one with another hash seed,
    byte for byte; ``--rank`` writes just that rank's file, the same bytes."""
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    code = "import sys; from autopar.cli import main; sys.exit(main(sys.argv[1:]))"
    other = subprocess.Popen([sys.executable, "-c", code, *CLI, "--out", str(tmp_path / "b")],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert main(CLI + ["--out", str(tmp_path / "a")]) == 0  # while the other process runs
    out = capsys.readouterr().out
    assert "wrote" in out and "rank1.py" in out
    _, stderr = other.communicate(timeout=300)
    assert other.returncode == 0, stderr[-2000:]
    files = sorted(os.listdir(tmp_path / "a"))
    assert files == ["rank0.py", "rank1.py"] == sorted(os.listdir(tmp_path / "b"))
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
        compile((tmp_path / "a" / name).read_text(), name, "exec")
    assert main(CLI + ["--rank", "1", "--out", str(tmp_path / "c")]) == 0
    assert os.listdir(tmp_path / "c") == ["rank1.py"]
    assert (tmp_path / "c" / "rank1.py").read_bytes() == (tmp_path / "a" / "rank1.py").read_bytes()


def test_cli_errors(tmp_path, capsys):
    assert main(CLI[:-1] + ["7", "--out", str(tmp_path)]) == 1  # s=7 with sequence parallel
    assert "ShardingError" in capsys.readouterr().err
    assert main(["codegen", "gpt", "--layers", "2", "--hidden", "64", "--heads", "4",
                 "--vocab", "128", "--max-seq", "32", "--tp", "2", "--rank", "5",
                 "--out", str(tmp_path)]) == 1
    assert "--rank" in capsys.readouterr().err


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-tp{c[1]}{'-sp' if c[2] else ''}")
def test_the_collectives_property_holds_and_catches_a_missing_collective(programs, case):
    """``collectives`` is a predicate on the per-rank program: it holds on every program built,
    and bypassing one collective that changes a placement (its consumer then reads the producer's
    placement) makes it name the consumer."""
    import copy

    from autopar.passes.infra import PassContext, check_property

    program = programs[case]
    assert check_property("collectives", program.gm, PassContext()) is None
    gm = copy.deepcopy(program.gm)

    def tensor_arg(n):  # a collective's tensor (its other argument is the communicator)
        return next((a for a in n.args if isinstance(a, torch.fx.Node)
                     and info(a).placement is not None), None)

    for node in gm.graph.nodes:
        if node.op != "call_function" or info(node).collective is None:
            continue
        src = tensor_arg(node)
        users = [u for u in node.users if info(u).strategy is not None
                 and len(u.all_input_nodes) == len(info(u).strategy.inputs)]
        if src is not None and info(src).placement != info(node).placement and users:
            break
    else:
        raise AssertionError("no placement-changing collective to bypass")
    node.replace_all_uses_with(src)
    reason = check_property("collectives", gm, PassContext())
    assert reason is not None and src.name in reason, reason
