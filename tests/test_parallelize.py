"""autopar.parallelize end to end on real gloo processes, against the single-process run.

Every world-4 (dp, pp, tp) shape and world 8 as (2, 2, 2), on the project's own GPT, HF GPT-2
and HF LLaMA (kv-heads < heads), and HF BERT (integer position-id buffers) at pp > 1 and tp > 1,
with the five schedules (ZB-V with tied weights on one rank's two chunks) and sequence
parallelism mixed in: after 3 AdamW steps, losses and every
parameter equal the single-process run. Every model runs ZeRO 1, 2 and 3 with dp > 1 (ZeRO-3 with
pp > 1; ZeRO-3 under ZB-H1 and under ZB-V with a tied weight on one rank's two chunks), one of
them as hybrid sharding (Plan.zero_shard_size); one run clips the global gradient
norm, one feeds each data-parallel rank only its share of the batch, three evaluate (``pm(...)``,
``eval_step``) and compile every rank's generated code; two run in mixed precision with pipeline
parallelism. Selective recompute runs on HF GPT-2 and LLaMA with eager attention, whose attention
cores it recomputes in backward (pp=2 x tp=2 with SP under 1F1B and ZeRO-3, dp=2 x pp=2 under
ZB-H1, LLaMA in bf16), and on the own GPT (fused attention: nothing to recompute). Per-rank
memory is checked against the ZeRO accounting of Rajbhandari et al. 2020.

Tolerance (fp32): parameters within 1e-5 absolute, losses within 1e-5 relative. The parallel
program computes the same sums in another order (tensor-parallel all-reduces, micro-batch
accumulation, data-parallel averaging); in fp32 that moves results by ~1e-7 (measured: <= 3e-7
after 3 steps). Adam's epsilon is 1e-5 so rounding noise on near-zero gradients is not magnified
into O(lr) steps. A real fault (a missing reduction, a wrong scale, a stale tied weight) moves
parameters by O(lr) = 1e-3. Recomputation repeats the same ops on the same values (bit-identical
in one process: tests/test_recompute.py), so it needs no tolerance of its own.

Mixed precision (bf16 compute, fp32 master weights, fp32 gradient accumulation and reduction) is
compared with tests/dp_harness.py's single-process mixed-precision run on the same micro-batches
(dp x m of them, each computed in bf16, gradients accumulated in fp32): see
:func:`_compare_mixed` for why those tolerances.
"""

from __future__ import annotations

import functools

import pytest
import torch

import autopar
from autopar import PlanMismatchError
from autopar.runtime.local_pool import LocalPool

import parallelize_jobs as jobs
from conftest import train_one_process

pytestmark = pytest.mark.distributed

MODELS = ("own_gpt", "gpt", "llama")
WORLD4 = [  # (dp, pp, tp, schedule, virtual stages, micro-batches, sequence parallel)
    (4, 1, 1, "1f1b", 1, 1, False),
    (1, 4, 1, "1f1b", 1, 4, False),
    (1, 1, 4, "1f1b", 1, 1, True),
    (2, 2, 1, "gpipe", 1, 2, False),
    (2, 1, 2, "1f1b", 1, 2, False),
    (1, 2, 2, "interleaved-1f1b", 2, 2, True),
]
#: ZeRO stage of each model on the shapes with dp > 1 (ZeRO-3 on the pipelined one); the dp = 1
#: shapes rotate the stages too (ZeRO-3's gather hooks on pipeline and tensor-parallel stage
#: modules, with a shard group of one).
ZERO_DP = {"own_gpt": {(4, 1, 1): 1, (2, 1, 2): 2, (2, 2, 1): 3},
           "gpt": {(4, 1, 1): 2, (2, 1, 2): 1, (2, 2, 1): 3},
           "llama": {(4, 1, 1): 2, (2, 1, 2): 1, (2, 2, 1): 3}}
#: Options folded into the shape runs above (none changes what the fp32 reference is but
#: max_grad_norm, whose reference clips with torch.nn.utils.clip_grad_norm_).
OPTIONS = {("llama", (4, 1, 1)): dict(pins=dict(zero_shard_size=2)),  # hybrid: 2 x 2
           ("gpt", (2, 1, 2)): dict(local=True),
           # the optimizer as a function with its own parameter groups, under an LR schedule:
           # on tensor-parallel shards (ZeRO-1) and on ZeRO-3's flat pieces with a tied weight
           ("llama", (2, 1, 2)): dict(recipe=True),
           ("own_gpt", (2, 1, 2)): dict(max_grad_norm=0.5),
           # fused attention without dropout: selective recompute has nothing to recompute
           ("own_gpt", (1, 2, 2)): dict(probe=True, pins=dict(recompute="selective")),
           ("gpt", (2, 2, 1)): dict(probe=True, recipe=True),
           # ZeRO-3 keeping each layer gathered from its forward to its backward
           ("llama", (2, 2, 1)): dict(pins=dict(reshard_after_forward=False))}
CLIP = 0.5
SELECTIVE = dict(recompute="selective")
FULL = dict(recompute="full")
#: Runs of their own: BERT at pp > 1 and tp > 1; mixed precision with pipeline parallelism;
#: selective recompute on eager attention (HF GPT-2 and LLaMA with an explicit softmax: their
#: attention cores are recomputed in backward) under 1F1B with tp=2 and SP, ZB-H1 (whose W
#: recomputes the cores once more), and bf16 (LLaMA's fp32 softmax cast back to bf16).
EXTRA = [("bert", (1, 2, 2, "interleaved-1f1b", 2, 2, True), 0, {}),
         ("bert", (2, 1, 2, "1f1b", 1, 2, False), 3, {}),
         ("llama_eager", (1, 2, 2, "1f1b", 1, 2, True), 0,
          dict(mixed_precision=True, pins=SELECTIVE)),
         ("gpt", (2, 2, 1, "1f1b", 1, 2, False), 3, dict(mixed_precision=True)),
         ("gpt_eager", (1, 2, 2, "1f1b", 1, 2, True), 3, dict(pins=SELECTIVE, probe=True)),
         ("gpt_eager", (2, 2, 1, "zb-h1", 1, 2, False), 1, dict(pins=SELECTIVE)),
         # ZB-V: the tied embedding and LM head on one rank's two chunks (ZeRO-3 gathers them
         # again for each weight-gradient action), each chunk with a block beside them (the
         # embedding's and the head's layer units then share the weight across two stages);
         # tp with SP
         ("gpt:128:4", (2, 2, 1, "zb-v", 2, 2, False), 3, {}),
         ("llama", (1, 2, 2, "zb-v", 2, 4, True), 1, {}),
         # full recompute one block at a time inside ZeRO-3's per-layer gathers, under a split
         # backward (its W reads the blocks the I recomputed) and with tp + SP (the head's
         # gathered input kept as a shard outside the checkpointed blocks)
         ("llama", (2, 2, 1, "zb-v", 2, 2, False), 3, dict(pins=FULL)),
         ("own_gpt", (1, 2, 2, "interleaved-1f1b", 2, 2, True), 3, dict(pins=FULL))]


def _pins(dp, pp, tp, schedule, v, m, sp, zero, **extra):
    return dict(dp=dp, pp=pp, tp=tp, schedule=schedule, virtual_stages=v, num_micro_batches=m,
                sequence_parallel=sp and tp > 1, zero=zero, **extra)


def _world4_configs():
    configs = []
    for j, name in enumerate(MODELS):
        for i, shape in enumerate(WORLD4):
            mesh = shape[:3]
            zero = ZERO_DP[name].get(mesh, (i + j) % 4)
            if shape[1] == 4 and name == "llama":  # one zero-bubble run (ZeRO-3 with ZB-H1)
                shape = shape[:3] + ("zb-h1",) + shape[4:]
            options = dict(OPTIONS.get((name, mesh), {}))
            pins = _pins(*shape, zero=zero, **options.pop("pins", {}))
            configs.append((name, pins, options))
    for name, shape, zero, options in EXTRA:
        options = dict(options)
        configs.append((name, _pins(*shape, zero=zero, **options.pop("pins", {})), options))
    return configs


@pytest.fixture(scope="module")
def references():
    refs = {(name, None): jobs.reference(name)
            for name in MODELS + ("bert", "gpt_eager", "llama_eager", "gpt:128:4")}
    refs[("own_gpt", CLIP)] = jobs.reference("own_gpt", max_grad_norm=CLIP)
    for name in ("gpt", "llama"):
        refs[(name, "recipe")] = jobs.reference(name, use_recipe=True)
    return refs


def _compare(result, reference, what):
    ref_losses, ref_state = reference["losses"], reference["state"]
    assert result["losses"] == pytest.approx(ref_losses, rel=1e-5), what
    state = result["state"]
    for key, want in ref_state.items():
        if not torch.is_floating_point(want):
            continue
        assert key in state, f"{what}: {key} missing from state_dict()"
        torch.testing.assert_close(state[key], want, rtol=0, atol=1e-5, msg=f"{what}: {key}")


def _compare_mixed(result, mixed, fp32, what):
    """bf16 compute against the single-process mixed-precision run on the same micro-batches.

    The parallel run rounds some sums to bf16 where one process does not, and the other way
    round: a tied embedding / LM head's two gradient contributions are summed in fp32 across
    stages here but in bf16 by autograd in one process; tensor-parallel partial sums are rounded
    to bf16 before their all-reduce. Adam turns such rounding into a different step only for
    elements whose gradient is within rounding of zero (its first steps are ~lr x sign(g)), so
    parameters are compared by the relative L2 distance of the final parameters, over the
    length of the reference's update: measured 0.4% (pipeline only) and 2.7% (with tp), the
    size of the gap between two single-process bf16 runs that differ in the micro-batch count
    (0.7-1.2%) and of bf16 vs fp32 (3%); a fault is of order one (a replica's gradient not
    averaged: 90%). Bound: 8%. Losses (means of bf16 losses) within two bf16 ulps (2^-6
    relative) of that run, and, as a sanity bound, of the fp32 run (measured 0.35%)."""
    assert result["param_dtypes"] == ["torch.bfloat16"], what  # bf16 compute copies
    assert result["losses"] == pytest.approx(mixed["losses"], rel=2 ** -6), what
    assert result["losses"] == pytest.approx(fp32["losses"], rel=2 ** -6), what
    state, ref, init = result["state"], mixed["state"], mixed["init"]
    assert all(state[k].dtype == torch.float32 for k in ref), what  # fp32 master weights
    diff = sum(((state[k] - ref[k]) ** 2).sum() for k in ref) ** 0.5
    update = sum(((ref[k] - init[k]) ** 2).sum() for k in ref) ** 0.5
    assert diff / update < 0.08, (what, (diff / update).item())


def _memory_formula(pins, local_params, mixed, shard_size):
    """ZeRO's accounting (Rajbhandari et al. 2020, section 3) for one rank holding P parameters (its stages' shards),
    sharded over N ranks: mixed precision bf16 weights (2), fp32 gradients (4: the default
    gradient dtype) and fp32 master + Adam (12); fp32 weights (4), gradients (4) and Adam m, v
    (8; the weights are the master) -- 16 bytes per parameter either way. ZeRO-1 shards the
    optimizer state, ZeRO-2 also the gradients, ZeRO-3 also the weights
    (tests/test_zero.py checks the same on one model)."""
    p, z, n = local_params, pins["zero"], shard_size
    weights, grads, optim = (2, 4, 12) if mixed else (4, 4, 8)
    return {"params": weights * p / (n if z >= 3 else 1), "grads": grads * p / (n if z >= 2 else 1),
            "optimizer": optim * p / (n if z >= 1 else 1)}


def _check_memory(per_rank, k, pins, mixed, what):
    for r in per_rank:
        result = r[k]
        want = _memory_formula(pins, result["local_params"], mixed, result["shard_size"])
        got = result["memory"]
        for kind, value in want.items():
            # within 5%: bucket padding (< N elements per bucket) and Adam's step counters
            assert got[kind] == pytest.approx(value, rel=0.05), (what, result["coordinates"],
                                                                 kind, got, want)


def test_every_world4_shape_with_zero_0_to_3(shared_pool4, references):
    configs = _world4_configs()
    dp_zero = {(n, p["zero"]) for n, p, _ in configs if p["dp"] > 1}
    assert dp_zero >= {(n, z) for n in MODELS for z in (1, 2, 3)}  # ZeRO that shards something
    assert {n for n, p, _ in configs if p["dp"] > 1 and p["pp"] > 1 and p["zero"] == 3} >= set(MODELS)
    assert {p["pp"] > 1 for n, p, _ in configs if n == "bert"} == {True, False}
    assert {p["tp"] > 1 for n, p, _ in configs if n == "bert"} == {True}
    mixed = {(p["dp"], p["pp"], p["tp"]) for _, p, o in configs if o.get("mixed_precision")}
    assert mixed == {(1, 2, 2), (2, 2, 1)}
    selective = {(n, p["schedule"], p["tp"], p["sequence_parallel"]) for n, p, _ in configs
                 if p.get("recompute") == "selective" and n.endswith("_eager")}
    assert selective >= {("gpt_eager", "1f1b", 2, True), ("gpt_eager", "zb-h1", 1, False)}
    full = {(p["schedule"], p["zero"], p["sequence_parallel"]) for _, p, _ in configs
            if p.get("recompute") == "full"}
    assert full >= {("zb-v", 3, False), ("interleaved-1f1b", 3, True)}
    mixed_refs = {(name, pins["dp"] * pins["num_micro_batches"]):
                  jobs.reference_mixed(name, pins["dp"] * pins["num_micro_batches"])
                  for name, pins, options in configs if options.get("mixed_precision")}
    pool = shared_pool4
    per_rank = pool.run(jobs.train, configs, timeout_s=900)
    print("\n".join(f"{r['seconds']:5.1f} s  {n} {p} {o}" for r, (n, p, o) in
                    zip(per_rank[0], configs)))
    for k, (name, pins, options) in enumerate(configs):
        what = f"{name} {pins} {options}"
        result = per_rank[0][k]
        assert len({r[k]["losses"][-1] for r in per_rank}) == 1, what  # the same loss everywhere
        if pins.get("recompute") == "selective":  # one recomputed core per block, on some stage
            column = [r[k]["regions"] for r in per_rank if r[k]["coordinates"][::2] == (0, 0)]
            assert sum(column) == (2 if name.endswith("_eager") else 0), (what, column)
        if options.get("mixed_precision"):
            ref = mixed_refs[(name, pins["dp"] * pins["num_micro_batches"])]
            _compare_mixed(result, ref, references[(name, None)], what)
            _check_memory(per_rank, k, pins, True, what)
            continue
        reference = references[(name, "recipe" if options.get("recipe") else
                                 options.get("max_grad_norm"))]
        _compare(result, reference, what)
        if options.get("max_grad_norm"):  # the clip was active in every step
            assert min(reference["norms"]) > options["max_grad_norm"], reference["norms"]
        if pins.get("zero_shard_size"):
            assert {r[k]["shard_size"] for r in per_rank} == {pins["zero_shard_size"]}
            _check_memory(per_rank, k, pins, False, what)
        if options.get("probe"):
            for r in per_rank:
                assert r[k]["call_loss"] == r[k]["eval_loss"], what
                assert r[k]["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5), what
                assert len(r[k]["code_lines"]) == 4 and min(r[k]["code_lines"]) > 50, what


def test_world8_dp2_pp2_tp2(references):
    configs = [(name, _pins(2, 2, 2, "1f1b", 1, 2, sp, zero))
               for name, zero, sp in (("own_gpt", 0, False), ("gpt", 1, True), ("llama", 2, False),
                                      ("gpt", 3, False))]
    with LocalPool(8, timeout_s=600) as pool:
        per_rank = pool.run(jobs.train, configs, timeout_s=900)
    for k, (name, pins) in enumerate(configs):
        what = f"world 8 {name} {pins}"
        _compare(per_rank[0][k], references[(name, None)], what)
        _check_memory(per_rank, k, pins, False, what)


def test_zero3_gathers_one_layer_at_a_time(shared_pool2):
    """ZeRO-3 through parallelize gathers per captured layer (runtime/layer_units.py), not the
    whole stage: on a 6-block GPT at dp=2 the most a rank holds gathered at once is the tied
    embedding / LM head (kept with the stage, as FSDP keeps it in its root), the head's layer,
    the block running and the one prefetched (Rajbhandari et al. 2020's per-layer fetch), about a
    third of the stage; gathering the whole stage would hold all of it."""
    pool = shared_pool2
    found = pool.run(jobs.zero_memory, 6, _pins(2, 1, 1, "1f1b", 1, 2, False, 3))
    # under compile each layer is compiled on its own, the gathers and frees between them:
    # the same gathers, the same peak, the same loss
    compiled = pool.run(jobs.zero_memory, 6, _pins(2, 1, 1, "1f1b", 1, 2, False, 3),
                        compile="aot_eager")
    for r, c in zip(found, compiled):
        assert (c["peak"], c["gathers"], c["units"]) == (r["peak"], r["gathers"], r["units"])
        assert (c["compiled"], r["compiled"]) == (8, 0)  # pre, 6 blocks, post
        assert float(c["loss"]) == pytest.approx(float(r["loss"]), rel=1e-6)
    for r in found:
        layers = r["layers"]
        block = max(v for k, v in layers.items() if k.startswith("blocks."))
        assert r["units"] == len(layers) + 1  # one per layer, and the stage's own
        assert 2 * block <= r["peak"] <= 2 * block + layers["pre"] + layers["post"], r
        assert r["peak"] < 0.4 * r["stage"], r
    # kept gathered from forward to backward: the whole stage at once, and no backward gathers;
    # under ZB-H1 (8 blocks: 4 per stage) the input-gradient actions free each layer once its
    # input side has run and the weight-gradient actions gather layer by layer, on both stages:
    # the first, with no input gradient, splits at the chain above two or more weights
    # (runtime/split_backward.py; it gathered its whole stage for one autograd call before)
    pool = shared_pool2
    kept = pool.run(jobs.zero_memory, 6,
                    _pins(2, 1, 1, "1f1b", 1, 2, False, 3, reshard_after_forward=False))
    split = pool.run(jobs.zero_memory, 8, _pins(1, 2, 1, "zb-h1", 1, 4, False, 3))
    for r in split:
        layers = r["layers"]
        block = max(v for k, v in layers.items() if k.startswith("blocks."))
        ends = layers.get("pre", 0) + layers.get("post", 0)
        # a block's pre-backward fires when the residual stream's gradient first reaches it, at
        # the start of the next block's backward: that block, this one, the one prefetched
        assert r["peak"] <= 3 * block + ends < 0.8 * r["stage"], r
    for r, again in zip(kept, found):
        assert r["peak"] >= r["stage"] - r["layers"]["post"], r
        # 2 micro-batches: each layer but the roots (the stage's own unit, its last layer)
        # gathered once more per micro-batch for its backward when resharded
        assert again["gathers"] - r["gathers"] == 2 * (r["units"] - 2), (r, again)
        assert r["loss"] == again["loss"]


def test_zero2_and_3_keep_no_full_gradient_between_micro_batches(shared_pool2):
    """ZeRO-2/3 reduce-scatter every micro-batch's gradients into the shard, one bucket in flight,
    so the full (unsharded) gradients never all exist at once, as Rajbhandari et al. 2020 count
    ZeRO-2's memory (2P + 14P/N); ZeRO-1 keeps its full buffer across the micro-batches by
    design (4P + 12P/N). 4 micro-batches at dp=2, buckets of ~1/8 of a block (ZeRO-3: one
    per layer): the most full
    gradient elements alive at once stays under a third of the stage's parameters under ZeRO-2
    and 3, and is all of them under ZeRO-1. The three runs give the same loss."""
    runs = {zero: _pins(2, 1, 1, "1f1b", 1, 4, False, zero) for zero in (1, 2, 3)}
    pool = shared_pool2
    found = {zero: pool.run(jobs.zero_memory, 6, pins, 0.025)
             for zero, pins in runs.items()}
    for zero, per_rank in found.items():
        for r in per_rank:
            # ZeRO-3 buckets follow its units (one per layer); the others the bucket size
            assert r["buckets"] > (8 if zero == 3 else 20), (zero, r["buckets"])
            if zero == 1:
                assert r["full_grads"] >= r["stage"], r
            else:
                assert r["full_grads"] < r["stage"] / 3, (zero, r["full_grads"], r["stage"])
            assert r["loss"] == pytest.approx(found[1][0]["loss"], rel=1e-6)


def test_a_meta_model_trains_from_a_checkpoint_and_initializes_like_one_device(
        shared_pool4, references, tmp_path):
    """Initialized: built on meta from seed 0 and parallelized with ``init=`` (no weights
    anywhere), every rank's shards are, to the bit, the values one device holds after the same
    initialization from the same seed (transformers' to_empty + init_weights, or the own GPT's
    ``apply(_init)`` with its tie kept), under tp 2 x pp 2, dp 2 x pp 2 with ZeRO-3, pp 4 and
    dp 2 x tp 2: LLaMA, GPT-2 (its parent-written c_proj and tied head), BERT (tied decoder) and
    the own GPT; each rank's CPU random state ends where one device's does.

    Loaded: built on the meta device, loaded from the safetensors checkpoint of the single-process
    model's initial weights (one file for LLaMA, an index and shard files for GPT-2), each rank
    reading only its slices: tp 2 x pp 2, dp 2 x pp 2 with ZeRO-3 and pp 4 train to the
    single-process numbers (the tolerances above). The tied embedding and LM head load once;
    LLaMA's rotary buffers, in no checkpoint, come from the model's _init_weights. Every rank
    allocates exactly what its RankProgram says it holds. Saved back with save_pretrained (shard
    files and an index), transformers' from_pretrained gives exactly the trained weights, and
    its loss on a batch is the parallel model's (fp32, another summation order: 1e-5)."""
    dirs = {}
    for name, shard_size in (("gpt", "20KB"), ("llama", "5GB")):
        torch.manual_seed(0)  # jobs.reference's initial weights
        model, _ = jobs.make_model(name)
        dirs[name] = str(tmp_path / name)
        model.save_pretrained(dirs[name], max_shard_size=shard_size)
    assert (tmp_path / "gpt" / "model.safetensors.index.json").exists()
    saved = {k: str(tmp_path / f"saved{k}") for k in range(2)}
    configs = [("gpt", _pins(1, 2, 2, "1f1b", 1, 2, True, 0),
                dict(checkpoint=dirs["gpt"], save_pretrained=saved[0])),
               ("llama", _pins(2, 2, 1, "1f1b", 1, 2, False, 3),
                dict(checkpoint=dirs["llama"], save_pretrained=saved[1])),
               ("gpt", _pins(1, 4, 1, "1f1b", 1, 4, False, 1), dict(checkpoint=dirs["gpt"]))]
    init_configs = [("llama", _pins(1, 2, 2, "1f1b", 1, 2, False, 0)),
                    ("gpt", _pins(2, 2, 1, "1f1b", 1, 2, False, 3)),
                    ("own_gpt", _pins(1, 4, 1, "1f1b", 1, 4, False, 0)),
                    ("bert", _pins(2, 1, 2, "1f1b", 1, 1, False, 1))]
    pool = shared_pool4
    per_rank = pool.run(jobs.train, configs, timeout_s=900)
    initialized = pool.run(jobs.init_states, init_configs, timeout_s=600)
    for k, (name, pins) in enumerate(init_configs):
        want, rng = jobs.reference_init(name)
        got = initialized[0][k]["state"]
        assert set(got) == set(want), (name, set(got) ^ set(want))
        for key, value in want.items():
            assert torch.equal(got[key], value), (name, pins, key)
        for r in initialized:
            assert torch.equal(r[k]["rng"], rng), name
            program_says, allocated = r[k]["held_bytes"]
            assert program_says == allocated > 0 or r[k]["zero"] == 3, (name, program_says)
    for k, (name, pins, _) in enumerate(configs):
        what = f"meta {name} {pins}"
        _compare(per_rank[0][k], references[(name, None)], what)
        if pins["zero"] < 3:  # ZeRO-3 then reshards what the executor holds
            for r in per_rank:
                program_says, allocated = r[k]["held_bytes"]
                assert program_says == allocated > 0, (what, r[k]["coordinates"])
        if k in saved:  # saved back: from_pretrained gives the trained weights and their loss
            loaded = type(jobs.make_model(name, "meta")[0]).from_pretrained(saved[k])
            state = per_rank[0][k]["state"]
            for key, value in loaded.state_dict().items():
                assert torch.equal(value, state[key]), (what, key)
            assert len(list((tmp_path / f"saved{k}").glob("model-*.safetensors"))) > 1
            _, loss_fn = jobs.make_model(name, "meta")
            inputs, targets = jobs.batches(name, 1)[0]
            with torch.no_grad():
                loss = float(loss_fn(loaded(*inputs), *targets))
            assert loss == pytest.approx(per_rank[0][k]["eval_loss"], rel=1e-5), what


def test_a_model_larger_than_a_rank_is_loaded_by_shards(tmp_path):
    """A ~170 MB (fp32) GPT-2-style model, built on meta and loaded from its checkpoint on 4
    ranks, tp 2 x pp 2 and dp 4 with ZeRO-3 (pp 4 and a 1.1B model: benchmarks/load_large.py).
    Each rank allocates exactly the parameters its RankProgram holds (under half the model;
    under ZeRO-3 a quarter, the plan's predicted weight memory). Its peak resident memory across
    parallelize, less the gradient and optimizer buffers the data-parallel engine allocates,
    stays within those parameters plus one full tensor (the piece being written into the
    engine's buffers) plus 32 MB (process groups, the captured graph, allocator slack; measured
    1-23 MB) and under 70% of the model: no rank ever held the whole model. Each tensor streams
    straight into the engine's buffers, so under ZeRO-3 a rank keeps only its shard of it."""
    from autopar import models

    large = models.build("gpt", dropout=0.0, **jobs.LARGE).model
    total = sum(p.numel() * 4 for p in large.parameters())
    large.save_pretrained(tmp_path / "large")
    del large
    models.build("gpt", dropout=0.0, layers=2, hidden=64, heads=4, vocab=128,
                 seq=jobs.LARGE["seq"]).model.save_pretrained(tmp_path / "large-tiny")
    # ZeRO-3 first: the later runs reuse memory the earlier ones freed, so only the first
    # measures the full growth (the later ones are still bounded by it)
    configs = [_pins(4, 1, 1, "1f1b", 1, 1, False, 3), _pins(1, 2, 2, "1f1b", 1, 2, False, 0)]
    with LocalPool(4, timeout_s=600) as pool:
        for pins in configs:
            per_rank = pool.run(jobs.load_large, str(tmp_path / "large"), pins, timeout_s=600)
            what = f"{pins['dp']}x{pins['pp']}x{pins['tp']} zero {pins['zero']}"
            for r in per_rank:
                if pins["zero"] == 3:  # a quarter of the flat parameters, as the plan predicts
                    kept = r["memory"]["params"]
                    assert kept == pytest.approx(r["predicted_weights"], rel=1e-3), (what, r)
                    assert kept == pytest.approx(total / 4, rel=1e-3), (what, r)
                else:
                    assert r["params"] == r["held"] < total / 2, (what, r)
                    kept = r["held"]
                loading = r["growth"] - r["memory"]["grads"] - r["memory"]["optimizer"]
                assert loading < kept + r["largest"] + 32 * 2 ** 20, (what, r)
                assert loading < 0.7 * total, (what, r)  # never the whole model


def test_single_process_state_dict_loads_into_the_original_model():
    """parallelize in one process: the trained state dict loads into the user's model class and
    gives the same outputs; load_state_dict puts it back."""
    model, loss_fn = jobs.make_model("gpt")
    data = jobs.batches("gpt", 2)
    pm = autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                             loss_fn=loss_fn, plan={"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 2},
                             optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
    for inputs, targets in data:
        pm.train_step(inputs, targets)
    state = pm.state_dict()
    fresh, _ = jobs.make_model("gpt")
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected and all("attn.bias" in k or "masked_bias" in k for k in missing)
    inputs, targets = data[0]
    assert pm.eval_step(inputs, targets) == pytest.approx(loss_fn(fresh(*inputs), *targets).item(),
                                                         rel=1e-6)
    pm.load_state_dict(jobs.make_model("gpt")[0])  # back to the initial weights
    init_model, _ = jobs.make_model("gpt")
    assert pm.eval_step(inputs, targets) == pytest.approx(
        loss_fn(init_model(*inputs), *targets).item(), rel=1e-6)
    pm.close()


class _WithAnUnreadParameter(torch.nn.Module):
    """A model one of whose parameters its forward never reads (as Dinov2's mask token when no
    mask is given)."""

    def __init__(self) -> None:
        super().__init__()
        self.mask_token = torch.nn.Parameter(torch.randn(1, 8))
        self.inner = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x, mask=None):
        if mask is not None:
            x = torch.where(mask[..., None], self.mask_token, x)
        return self.out(torch.relu(self.inner(x)))


def test_a_parameter_the_graph_never_reads_is_kept_and_not_stepped():
    """It lives on the first stage outside the optimizer: AdamW with weight decay steps every
    other parameter as one process does (1e-6: the same sums) and leaves it exactly as it was,
    as one process's AdamW does with a parameter whose .grad stays None; state_dict keeps it."""
    torch.manual_seed(0)
    model, ref = _WithAnUnreadParameter(), _WithAnUnreadParameter()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    opt = functools.partial(torch.optim.AdamW, lr=0.1, weight_decay=0.5)
    loss_fn = torch.nn.functional.cross_entropy
    pm = autopar.parallelize(model, example_inputs=(x,), example_targets=(y,), loss_fn=loss_fn,
                             optimizer=opt, plan={"dp": 1, "tp": 1, "pp": 1,
                                                  "num_micro_batches": 2})
    losses = [pm.train_step((x,), (y,)) for _ in range(3)]
    ref_opt = opt(ref.parameters())
    want = []
    for _ in range(3):
        ref_opt.zero_grad()
        loss = loss_fn(ref(x), y)
        loss.backward()
        ref_opt.step()
        want.append(loss.item())
    assert losses == pytest.approx(want, rel=1e-6)
    state = pm.state_dict()
    assert torch.equal(state["mask_token"], ref.mask_token.detach())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=1e-6)
    assert not torch.equal(state["inner.weight"], model.inner.weight.detach())  # trained
    pm.close()


def test_the_optimizer_is_priced_as_it_runs():
    """parallelize prices the optimizer's kernel the user asked for (OptimizerProfile.kernel):
    torch's fused AdamW, which the cpu preset measured at a fraction of the
    default for-loop's time per parameter and per tensor, predicts a step well under a third
    of the default's; and the fused optimizer trains as one process's fused AdamW (the same
    kernel on the same numbers: 1e-6)."""
    _, loss_fn = jobs.make_model("own_gpt")
    data = jobs.batches("own_gpt", 2)
    optimizer_s = {}
    for fused in (False, True):
        make = functools.partial(torch.optim.AdamW, lr=1e-2, **({"fused": True} if fused else {}))
        pm = autopar.parallelize(jobs.make_model("own_gpt")[0], "cpu",
                                 example_inputs=data[0][0], example_targets=data[0][1],
                                 loss_fn=loss_fn, optimizer=make, plan={"dp": 1, "tp": 1})
        optimizer_s[fused] = pm.prediction.breakdown["optimizer_s"]
        if fused:
            losses = [pm.train_step(i, t) for i, t in data]
            ref = jobs.make_model("own_gpt")[0]
            want, _ = train_one_process(ref, loss_fn, make(ref.parameters()), data)
            assert losses == pytest.approx(want, rel=1e-6)
        pm.close()
    assert 0 < optimizer_s[True] < optimizer_s[False] / 3, optimizer_s


@pytest.mark.parametrize("make,state,step", [
    (functools.partial(torch.optim.SGD, lr=1e-2, momentum=0.9), 4, (32.0, 3.0)),
    (lambda params: torch.optim.AdamW(params, lr=1e-3, amsgrad=True), 12, (96.0, 9.0))])
def test_the_optimizers_state_is_priced_as_it_is_kept(make, state, step):
    """parallelize prices the optimizer state the optimizer it is given keeps (measured on a
    probe: SGD's momentum 4 bytes a parameter, AdamW with amsgrad 12; a callable too), not
    Adam's 8: the prediction's optimizer bytes equal what the rank holds after a step
    (fp32: no master copy), within the scalar step counters. Its step is priced by what that
    optimizer moves and calls (hand counts of torch's for-loop: SGD with momentum 32 bytes a
    parameter and 3 calls a tensor, amsgrad AdamW 96 and 9), not AdamW's 84 and 8."""
    from autopar.plan_types import OptimizerStep
    from autopar.planner.kernels import optimizer_time

    _, loss_fn = jobs.make_model("own_gpt")
    data = jobs.batches("own_gpt", 1)
    pm = autopar.parallelize(jobs.make_model("own_gpt")[0], "cpu", example_inputs=data[0][0],
                             example_targets=data[0][1], loss_fn=loss_fn, optimizer=make,
                             plan={"dp": 1, "tp": 1})
    try:
        pm.train_step(*data[0])
        params = sum(p.numel() for p in pm.executor.params.values())
        held = pm.memory_bytes()["optimizer"]
        assert held == pytest.approx(state * params, rel=1e-3)
        assert pm.prediction.memory["optimizer"] == pytest.approx(held, rel=1e-3)
        cpu = autopar.Cluster.load("cpu").with_devices(1)
        tensors = len(pm.executor.params)
        assert pm.prediction.breakdown["optimizer_s"] == pytest.approx(
            optimizer_time(cpu, params, tensors, step=OptimizerStep(*step)), rel=1e-6)
    finally:
        pm.close()


def test_plan_for_another_world_size_is_refused():
    model, loss_fn = jobs.make_model("own_gpt")
    data = jobs.batches("own_gpt", 1)
    with pytest.raises(PlanMismatchError, match="world size"):
        autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                            loss_fn=loss_fn, plan=autopar.Plan(dp=2, num_micro_batches=4),
                            optimizer=torch.optim.SGD)


def test_load_state_dict_keeps_fp32_master_weights_under_mixed_precision():
    """Under mixed precision the modules compute with bf16 copies; loading a state dict must
    set the fp32 master weights from the given fp32 tensors, not from their bf16 roundings."""
    model, loss_fn = jobs.make_model("own_gpt")
    data = jobs.batches("own_gpt", 1)
    pm = autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                             loss_fn=loss_fn, mixed_precision=True,
                             plan={"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 2},
                             optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
    pm.train_step(*data[0])
    noisy: dict[int, torch.Tensor] = {}  # tied names share one tensor: one noisy copy each
    state = {k: noisy.setdefault(id(v), v + 1e-4 * torch.randn_like(v))
             if v.is_floating_point() else v
             for k, v in pm.state_dict().items()}  # values bf16 cannot hold
    pm.load_state_dict(state)
    back = pm.state_dict()
    for key, want in state.items():
        assert torch.equal(back[key], want), key
    pm.train_step(*data[0])  # and the engine still trains
    pm.close()


def test_mixed_precision_computes_the_loss_in_fp32():
    """bf16 compute, fp32 loss: the captured cross-entropy runs on fp32 logits (as under
    torch.autocast and in Megatron-LM), so the reported loss is not rounded to bf16's 8 bits of
    mantissa (a loss near 4.9 would read 4.875 or 4.90625). Reference: the same model under
    torch.autocast(bf16), which also computes the GEMMs in bf16 and the loss in fp32; the two
    differ only by the order of bf16 roundings (measured ~1e-5 relative), far below bf16's
    step of ~4e-3."""
    from autopar.ir import info, op_name

    model, loss_fn = jobs.make_model("gpt")
    data = jobs.batches("gpt", 1)
    (inputs, targets), = data
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = float(loss_fn(model(*inputs), *targets))
    pm = autopar.parallelize(model, example_inputs=inputs, example_targets=targets,
                             loss_fn=loss_fn, mixed_precision=True,
                             plan={"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 1},
                             optimizer=torch.optim.SGD)
    losses = [n for n in pm.captured.gm.graph.nodes if n.op == "call_function"
              and "cross_entropy" in op_name(n)]
    assert losses and all(info(n).spec.dtype == torch.float32 for n in losses)
    got = pm.eval_step(inputs, targets)
    pm.close()
    assert abs(got - want) <= 1e-3 * abs(want), (got, want)


def test_an_odd_vocabulary_is_padded_and_trains_like_one_process(shared_pool2, tmp_path):
    """A vocabulary of 101 (prime: no tp divides it) is padded to a multiple of 128 x tp
    (Megatron-LM's default; passes/pad_vocab.py): under tp 2, with the tied GPT-2 head and with
    LLaMA's untied one (and sequence parallelism), 3 AdamW steps give the single-process losses
    and parameters (the tolerances above), and ``state_dict`` has the model's 101 rows.
    ``save_pretrained`` writes 101 rows that transformers' ``from_pretrained`` reads back exactly.
    A checkpoint saved at tp 2 (101 padded to 256) stores 101 rows and resumes at dp 2 x tp 1
    (padded to 128) to the uninterrupted run."""
    import checkpoint_jobs as ckpt
    from autopar.runtime import checkpoint

    names = ("gpt:101", "llama:101")
    refs = {name: jobs.reference(name) for name in names}
    resumed_ref = jobs.reference("gpt:101", steps=ckpt.TOTAL)
    hf_dir = str(tmp_path / "hf")
    configs = [("gpt:101", _pins(1, 1, 2, "1f1b", 1, 2, False, 0),
                dict(save_pretrained=hf_dir)),
               ("llama:101", _pins(1, 1, 2, "1f1b", 1, 2, True, 0), {})]
    save_pins = _pins(1, 1, 2, "1f1b", 1, 2, False, 0)
    load_pins = _pins(2, 1, 1, "1f1b", 1, 1, False, 1)
    root = str(tmp_path / "ckpt")
    pool = shared_pool2
    per_rank = pool.run(jobs.train, configs, timeout_s=600)
    saved = pool.run(ckpt.train_and_save, [("gpt:101", save_pins)], root)[0]
    resumed = pool.run(ckpt.load_and_continue, [("gpt:101", load_pins)], root)[0]
    for k, (name, pins, _) in enumerate(configs):
        result = per_rank[0][k]
        _compare(result, refs[name], f"{name} {pins}")
        assert result["vocab"] == (101, 256), name  # padded to a multiple of 128 x tp
        assert {tuple(v.shape) for key, v in result["state"].items()
                if "embed" in key or "wte" in key or "lm_head" in key} == {(101, 64)}, name
    loaded = type(jobs.make_model("gpt:101", "meta")[0]).from_pretrained(hf_dir)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, per_rank[0][0]["state"][key]), key
    entries = checkpoint.read_metadata(f"{root}/gpt:101").state_dict_metadata
    assert tuple(entries["model/lm_head.weight"].size) == (101, 64)
    assert tuple(entries["optim/exp_avg/lm_head.weight"].size) == (101, 64)
    assert saved[0]["losses"] == pytest.approx(resumed_ref["losses"][:ckpt.SAVED_AT], rel=1e-5)
    for key, want in saved[0]["state"].items():
        assert torch.equal(resumed[0]["loaded"][key], want), key
    assert resumed[0]["losses"] == pytest.approx(resumed_ref["losses"][ckpt.SAVED_AT:], rel=1e-5)
    for key, want in resumed_ref["state"].items():
        torch.testing.assert_close(resumed[0]["final"][key], want, rtol=0, atol=1e-5, msg=key)


@pytest.mark.distributed
def test_a_whole_tensor_optimizer_is_never_given_shards(shared_pool2):
    """Adafactor's update of a matrix reads its row and column statistics, which a
    tensor-parallel shard's are not (tp=2 updated the split GEMMs up to 6% of a step off one
    process's, silently, before this was refused): pinned tp=2 is a named PlanMismatchError on
    every rank, zero=1 the engine's named error, and plan="auto" searches neither, training
    as one process does: fp32 Adafactor on the same batches, within 1e-3 of its lr (1e-5; the
    step divides each gradient by its own root mean square, so the data-parallel mean's
    rounding, ~1e-7 of a gradient, comes out at ~6e-4 of a step on a LayerNorm weight; the
    split GEMMs' error was 6e-5)."""
    plans = [{"tp": 2, "dp": 1, "pp": 1, "micro_batch_size": 8},
             {"dp": 2, "tp": 1, "pp": 1, "zero": 1, "micro_batch_size": 4}, "auto"]
    for rank, results in enumerate(shared_pool2.run(jobs.whole_tensor_optimizer, "gpt", plans)):
        (tp_err, tp_text), (zero_err, zero_text), (plan, diff) = results
        assert tp_err == "PlanMismatchError" and "cannot update tensor-parallel shards" in tp_text
        assert "fix:" in tp_text
        # it names the model's parameters, not the engine's local ones
        assert "transformer.h.0." in tp_text and "__" not in tp_text.split("fix:")[0], tp_text
        assert zero_err == "InvalidInputError" and "cannot run on ZeRO shards" in zero_text
        assert plan["tp"] == 1 and plan["zero"] == 0, plan
        assert diff[0] < 1e-5, (rank, diff)
