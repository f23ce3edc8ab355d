"""`autopar plan / explain / simulate / calibrate` end to end."""

from __future__ import annotations

import json
import math
import time

import pytest

from autopar import Cluster
from autopar.cli import main
from autopar.planner import calibration
from autopar.planner.calibration import fit_ring

PLAN_KEYS = {"dp", "tp", "pp", "virtual_stages", "micro_batch_size", "num_micro_batches",
             "schedule", "recompute", "zero", "sequence_parallel", "stages"}
BREAKDOWN = {"compute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s", "bubble_s", "recompute_s"}


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """One `autopar plan` run: its human output and the document it wrote."""
    import contextlib
    import io

    path = tmp_path_factory.mktemp("plan") / "plan.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "gpt2-small", "--cluster", "a100-80g", "--gpus", "16",
                     "--global-batch", "64", "--pp", "2", "--tp", "2", "--out", str(path)]) == 0
    return path, out.getvalue()


@pytest.fixture(scope="module")
def plan_file(planned):
    return planned[0]


def test_plan_json_has_the_documented_fields(capsys):
    # hidden 512: at hidden 256 (256 tokens per micro-batch, bf16 on an H100) the GEMMs are
    # so small that the search rightly runs them replicated rather than pay 4 collectives
    assert main(["plan", "gpt", "--layers", "4", "--hidden", "512", "--heads", "8", "--vocab",
                 "1000", "--max-seq", "512", "--seq", "256", "--cluster", "h100-80g", "--gpus",
                 "8", "--global-batch", "32", "--tp", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert PLAN_KEYS <= set(doc["plan"]) and doc["plan"]["tp"] == 2
    assert all(len(s["layers"]) == 2 for s in doc["plan"]["stages"])
    pred = doc["prediction"]
    assert {"step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_memory_bytes"} <= set(pred)
    assert BREAKDOWN <= set(pred["breakdown"])
    assert sum(pred["breakdown"].values()) == pytest.approx(pred["step_time_s"])
    assert {"time_s", "candidates_evaluated"} <= set(doc["search"])
    assert pred["tokens_per_s"] == pytest.approx(32 * 256 / pred["step_time_s"])
    assert doc["tp_placement"] and doc["model"]["layers"] == 4
    # the sharding search's layout, per GEMM of each distinct layer; the plan names GEMMs only
    # for a full-depth capture (the CLI captures 2 of the 4 blocks: tests/test_plan_integration)
    assert {"column", "row"} <= {row["sharding"] for row in doc["tp_placement"]}
    assert doc["model"]["captured_blocks"] == 2 and doc["plan"]["gemm_sharding"] == {}
    assert set(doc["search"]["components"]) == {"sharding", "stage_partition", "schedule"}
    assert "stand-in" not in json.dumps(doc["search"]["components"])
    sp = pred["stage_partition"]
    assert sp["lp_bound_s"] <= sp["objective_s"] * (1 + 1e-9) and 0 <= sp["gap"] < 1


def test_the_optimizer_kernel_is_a_planning_input(capsys):
    """--optimizer-kernel fused prices torch's fused AdamW (28 bytes a parameter on a GPU, a
    third of the default foreach's 84) and is recorded in the plan document's training."""
    steps = {}
    for extra in ([], ["--optimizer-kernel", "fused"]):
        assert main(["plan", "gpt", "--layers", "2", "--hidden", "256", "--heads", "4", "--vocab",
                     "1024", "--seq", "128", "--cluster", "h100-80g", "--gpus", "1",
                     "--global-batch", "8", "--json", *extra]) == 0
        doc = json.loads(capsys.readouterr().out)
        steps[tuple(extra)] = doc["prediction"]["breakdown"]["optimizer_s"]
        assert doc["training"].get("optimizer", {}).get("kernel") == (extra[1] if extra else None)
    assert steps[()] == pytest.approx(3 * steps[("--optimizer-kernel", "fused")])


def test_the_optimizer_state_is_a_planning_input(capsys):
    """--optimizer-state-bytes 0 (plain SGD) counts no moments: the plan's optimizer memory
    is the fp32 master weights alone, 4 of Adam's 12 bytes a parameter under bf16, and the
    document records it."""
    memory = {}
    for extra in ([], ["--optimizer-state-bytes", "0"]):
        assert main(["plan", "gpt", "--layers", "2", "--hidden", "256", "--heads", "4", "--vocab",
                     "1024", "--seq", "128", "--cluster", "h100-80g", "--gpus", "1",
                     "--global-batch", "8", "--zero", "0", "--json", *extra]) == 0
        doc = json.loads(capsys.readouterr().out)
        memory[bool(extra)] = doc["prediction"]["memory"]["optimizer"]
        assert doc["training"].get("optimizer", {}).get("state_bytes") == (0.0 if extra else None)
    assert memory[True] == pytest.approx(memory[False] / 3, rel=1e-6)


def test_the_optimizer_class_is_a_planning_input(capsys):
    """--optimizer SGD (with --optimizer-options) is profiled on probes as parallelize profiles
    it: plain SGD keeps the fp32 master weights alone (4 of Adam's 12 bytes a parameter under
    bf16) and its step holds no temporary, where the default foreach AdamW holds a 4-byte
    square root of every moment; the document records the profile; --optimizer-state-bytes
    still overrides the state."""
    out = []
    for extra in ([], ["--optimizer", "SGD", "--optimizer-options", '{"lr": 0.1}'],
                  ["--optimizer", "sgd", "--optimizer-state-bytes", "2"]):
        assert main(["plan", "gpt", "--layers", "2", "--hidden", "256", "--heads", "4", "--vocab",
                     "1024", "--seq", "128", "--cluster", "h100-80g", "--gpus", "1",
                     "--global-batch", "8", "--zero", "0", "--json", *extra]) == 0
        doc = json.loads(capsys.readouterr().out)
        out.append((doc["prediction"]["memory"], doc["training"].get("optimizer")))
    (adam, adam_doc), (sgd, sgd_doc), (two, two_doc) = out
    params = adam["weights"] / 2  # bf16 weights
    assert adam_doc is None and adam["optimizer_step"] == pytest.approx(4 * params)
    assert sgd["optimizer"] == pytest.approx(adam["optimizer"] / 3, rel=1e-6)
    assert sgd["optimizer_step"] == 0 and sgd_doc["state_bytes"] == 0.0
    assert sgd_doc["step"] == {"bytes_per_param": 12.0, "ops_per_tensor": 1.0,
                               "temporary_bytes": 0.0, "tensor_temporary_bytes": 0.0}
    assert two_doc["state_bytes"] == 2.0
    assert two["optimizer"] == pytest.approx(6 * params, rel=1e-6)
    assert main(["plan", "gpt", "--layers", "2", "--hidden", "256", "--heads", "4", "--vocab",
                 "1024", "--seq", "128", "--cluster", "h100-80g", "--gpus", "1",
                 "--global-batch", "8", "--optimizer", "SGD"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ("optimizer priced as profiled: state 0 bytes a parameter, step 12 bytes a parameter "
            "and 1 calls a tensor, temporaries 0 bytes") in text


def test_a_whole_tensor_optimizer_is_planned_without_shards(capsys):
    """--optimizer Adafactor (not element-wise: its statistics are a matrix's rows and columns)
    is planned with neither tensor-parallel nor ZeRO shards, which the runtime refuses for it,
    and the document says so; pinned --tp 2 is a named error saying why."""
    args = ["plan", "gpt", "--layers", "4", "--hidden", "1024", "--heads", "16", "--vocab",
            "1024", "--seq", "1024", "--cluster", "h100-80g", "--gpus", "8", "--global-batch",
            "64", "--optimizer", "Adafactor"]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["training"]["optimizer"]["elementwise"] is False
    assert (doc["plan"]["tp"], doc["plan"]["zero"]) == (1, 0)
    assert all(a["plan"]["tp"] == 1 and a["plan"]["zero"] == 0 for a in doc["alternatives"])
    assert main([*args, "--tp", "2"]) == 1
    err = capsys.readouterr().err
    assert "InfeasiblePlanError" in err and "updates whole tensors" in err


def test_the_default_sequence_is_the_context_a_rotary_model_was_configured_for(capsys):
    """A rotary model learns no position table, so its length is not capped; without --seq
    it is planned at its configured context (max_position_embeddings), as a learned-position
    model is at its table's rows, not at the few tokens it was captured with."""
    assert main(["plan", "llama", "--layers", "2", "--hidden", "64", "--heads", "4",
                 "--kv-heads", "2", "--vocab", "128", "--max-seq", "256", "--cluster",
                 "a100-80g", "--gpus", "2", "--global-batch", "4", "--tp", "1", "--pp", "1",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["training"]["seq"] == 256  # was 16


def test_human_output_tables(planned):
    out = planned[1]
    for title in ("pipeline stages", "tensor-parallel placement", "predicted step",
                  "step time breakdown", "next best plans", "MFU", "stages: the stage ILP"):
        assert title in out


def test_explain(plan_file, capsys):
    from autopar import solver

    assert main(["explain", str(plan_file)]) == 0
    out = capsys.readouterr().out
    for part in ("Where the time goes", "Why this plan", "Alternatives", "Search:",
                 "pp=2 cuts the layers",
                 f"the stage ILP ({ {'highs': 'HiGHS', 'cbc': 'CBC'}[solver.backend()]},",
                 "proven optimal for the stage model", "a looser bound",
                 "simulated pipeline", "from the stage model"):
        assert part in out


def test_simulate_prices_a_crowded_cpu_host_as_the_plan(tmp_path, capsys):
    """Four processes on the `cpu` preset's two cores with a resume cost: `autopar simulate`
    rebuilds the pipeline the search priced (cores, efficiency and the resume cost from the
    plan's cluster), and the resume cost is in it."""
    import dataclasses

    times, paths = {}, {}
    for name, resume in (("crowded", 2e-3), ("plain", 0.0)):
        spec = dataclasses.replace(Cluster.load("cpu"), cores_per_node=2, resume_s=resume)
        paths[name] = tmp_path / f"{name}-cluster.json"
        paths[name].write_text(json.dumps(spec.to_json()))
    for name, path in paths.items():
        assert main(["plan", "gpt", "--layers", "4", "--hidden", "64", "--heads", "4", "--vocab",
                     "256", "--seq", "32", "--global-batch", "8", "--gpus", "4", "--cluster",
                     str(path), "--dtype", "fp32", "--pp", "4", "--micro-batch", "2", "--schedule",
                     "1f1b", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        plan_path = tmp_path / f"{name}.json"
        plan_path.write_text(json.dumps(doc))
        trace = tmp_path / f"{name}.trace.json"
        assert main(["simulate", str(plan_path), "--trace", str(trace)]) == 0
        capsys.readouterr()
        simulated = json.loads(trace.read_text())["otherData"]["simulated_pipeline_s"]
        partition = doc["prediction"]["stage_partition"]
        assert simulated == pytest.approx(partition["simulated_pipeline_s"], rel=1e-9)
        times[name] = simulated
        # explain says how many computes resume (4 stages x 4 micro-batches x F and B, less
        # those that follow their own rank's previous compute), and nothing without the cost
        assert main(["explain", str(plan_path)]) == 0
        said = "resume on a core others ran on" in capsys.readouterr().out
        if name == "crowded":
            assert 4 <= partition["resumed_computes"] <= 32 and said
        else:
            assert "resumed_computes" not in partition and not said
    assert times["crowded"] >= times["plain"] + 2e-3  # the first forward resumes, at least


def test_simulate_writes_a_trace_and_a_gantt(plan_file, tmp_path, capsys):
    trace, png = tmp_path / "t.json", tmp_path / "g.png"
    assert main(["simulate", str(plan_file), "--trace", str(trace), "--png", str(png)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    doc = json.loads(plan_file.read_text())
    slices = [e for e in events if e.get("ph") == "X" and e["cat"] in ("forward", "backward")]
    m, stages = doc["plan"]["num_micro_batches"], len(doc["plan"]["stages"])
    assert len(slices) == 2 * m * stages  # one forward and one backward per stage and micro-batch
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    breakdown = doc["prediction"]["breakdown"]
    pipeline = doc["prediction"]["step_time_s"] - breakdown["dp_comm_s"] \
        - breakdown["optimizer_s"] - breakdown["loss_comm_s"]
    compute = [e for e in events if e.get("ph") == "X"
               and e["cat"] in ("forward", "backward", "weight grad")]
    end = max(e["ts"] + e["dur"] for e in compute) / 1e6
    assert end == pytest.approx(pipeline, rel=1e-6)  # the plan's prediction is the simulator's
    assert json.loads(trace.read_text())["otherData"]["simulated_pipeline_s"] == \
        pytest.approx(doc["prediction"]["stage_partition"]["simulated_pipeline_s"])


@pytest.mark.parametrize("argv, error", [
    (["plan", "gpt2-small", "--cluster", "a100-80g", "--gpus", "12", "--global-batch", "8"],
     "ClusterSpecError"),
    (["plan", "gpt2-small", "--cluster", "tpu-v9", "--gpus", "8", "--global-batch", "8"],
     "ClusterSpecError"),
    (["plan", "gpt", "--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "128",
      "--cluster", "a100-80g", "--gpus", "8", "--global-batch", "8", "--tp", "3"],
     "InfeasiblePlanError"),
    (["plan", "gpt2-small", "--cluster", "a100-80g", "--gpus", "8", "--global-batch", "8",
      "--seq", "4096"], "InvalidInputError"),
    (["simulate", "nope.json", "--png", "x.png"], "InvalidInputError"),
    (["plan", "gpt", "--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "128",
      "--cluster", "a100-80g", "--gpus", "8", "--global-batch", "8",
      "--optimizer-state-bytes", "-1"], "InvalidInputError"),
    (["plan", "gpt", "--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "128",
      "--cluster", "a100-80g", "--gpus", "8", "--global-batch", "8", "--optimizer", "Lion"],
     "InvalidInputError"),
    (["plan", "gpt", "--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "128",
      "--cluster", "a100-80g", "--gpus", "8", "--global-batch", "8", "--optimizer", "SGD",
      "--optimizer-options", "momentum=0.9"], "InvalidInputError"),
    (["plan", "gpt", "--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "128",
      "--cluster", "a100-80g", "--gpus", "8", "--global-batch", "8", "--optimizer", "SGD",
      "--optimizer-options", '{"colour": 1}'], "InvalidInputError"),
])
def test_bad_input_is_a_named_error(argv, error, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert error in err and "fix:" in err


def test_explain_rejects_other_json(tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"dp": 2}))
    assert main(["explain", str(path)]) == 1
    assert "PlanMismatchError" in capsys.readouterr().err


@pytest.mark.slow
def test_gpt3_175b_on_1024_a100_in_under_a_minute(capsys):
    start = time.perf_counter()
    assert main(["plan", "gpt3-175b", "--cluster", "a100-80g", "--gpus", "1024",
                 "--global-batch", "1536", "--json"]) == 0
    elapsed = time.perf_counter() - start
    doc = json.loads(capsys.readouterr().out)
    assert elapsed < 60, elapsed
    plan = doc["plan"]
    assert plan["dp"] * plan["tp"] * plan["pp"] == 1024 and plan["tp"] <= 8
    assert doc["prediction"]["peak_memory_bytes"] < 78 * 2**30
    assert doc["search"]["candidates_evaluated"] > 1000


def test_ring_fit_recovers_latency_and_bandwidth():
    sizes = [2**k for k in range(10, 25, 2)]
    times = [150e-6 + 2 * 3 / 4 * s / 1.5e9 for s in sizes]
    lat, bw = fit_ring(sizes, times, 2 * 3 / 4)
    assert lat == pytest.approx(150e-6) and bw == pytest.approx(1.5e9)


def test_ring_fit_in_absolute_error_for_noise_of_one_size():
    """Collectives after compute are differences of two ~13 ms timings: their noise is the same
    at every size. There the unweighted fit prices a step's 3.2 MB collective closer than the
    relative one, whose 1 / t^2 weights hand the slope to the noisiest (smallest) points; over
    200 seeded draws of a quick calibration's sizes, with +-1 ms of noise. A fit with no
    positive slope is noise only: an infinite bandwidth and the mean as latency."""
    import random
    import statistics

    sizes = [2**k for k in range(12, 23, 2)]  # 4 KiB .. 4 MiB
    a, bw, steps, size = 2.5e-3, 0.5e9, 0.5, 3.2e6
    true = a + steps * size / bw
    rng = random.Random(0)
    errors: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(200):
        times = [max(a + steps * s / bw + rng.gauss(0, 1e-3), 1e-4) for s in sizes]
        for relative in (True, False):
            lat, b = fit_ring(sizes, times, steps, relative=relative)
            errors[relative].append(abs((lat + steps * size / b) / true - 1)
                                    if math.isfinite(b) else 1.0)
    assert statistics.fmean(errors[False]) < 0.85 * statistics.fmean(errors[True])
    assert sum(e > 0.3 for e in errors[False]) < sum(e > 0.3 for e in errors[True]) / 2
    lat, b = fit_ring(sizes, [4e-3, 3e-3, 3e-3, 2.5e-3, 2.5e-3, 2e-3], steps, relative=False)
    assert math.isinf(b) and lat == pytest.approx(17e-3 / 6)


def test_collective_fits_stand_in_for_a_fit_that_is_noise_only():
    """calibrate's fits (calibration.fit_collectives): each collective's bus bandwidth comes from
    its after-compute times; where those show no positive slope (noise only) the back-to-back
    bandwidth stands in, and where that has none either, the largest size's time as all
    transfer; never an infinite bandwidth (a quick calibration's reduce-scatter once came out
    at 10^15 B/s and made ZeRO-1's reduce-scatter free). The arrival a0 is the median of the
    after-compute latencies less the back-to-back ones."""
    from autopar.planner.calibration import fit_collectives

    sizes = [2**k for k in range(12, 23, 2)]
    n = 2

    def ring(a, bw, steps):
        return [a + steps * s / bw for s in sizes]

    falling = [4e-3, 3.5e-3, 3.2e-3, 3.0e-3, 2.9e-3, 2.8e-3]  # noise only
    per_size = {"all_reduce": ring(3e-4, 2e9, 1.0), "all_reduce_after_compute": ring(2e-3, 1e9, 1.0),
                "all_gather": ring(2e-4, 0.8e9, 0.5), "all_gather_after_compute": falling,
                "reduce_scatter": falling, "reduce_scatter_after_compute": falling,
                "p2p": ring(5e-5, 4e9, 1.0)}
    fits = fit_collectives(sizes, per_size, n)
    assert fits["all_reduce"]["bus_bandwidth"] == pytest.approx(1e9)
    assert fits["all_reduce"]["back_to_back_bus_bandwidth"] == pytest.approx(2e9)
    assert fits["all_gather"]["bus_bandwidth"] == pytest.approx(0.8e9)  # back to back's
    # both noise: the largest size over its time, as all transfer of (n-1)/n of it
    assert fits["reduce_scatter"]["bus_bandwidth"] == pytest.approx(0.5 * sizes[-1] / 2.8e-3)
    assert fits["reduce_scatter"]["back_to_back_bus_bandwidth"] is None
    assert all(math.isfinite(fits[op]["bus_bandwidth"])
               for op in ("all_reduce", "all_gather", "reduce_scatter"))
    assert fits["p2p"]["latency_s"] == pytest.approx(5e-5)
    assert fits["p2p"]["bandwidth"] == pytest.approx(4e9)
    assert fits["all_reduce"]["after_compute_latency_s"] == pytest.approx(2e-3)
    extra = sorted(fits[op]["after_compute_latency_s"] - fits[op]["latency_s"]
                   for op in ("all_reduce", "all_gather", "reduce_scatter"))
    assert fits["arrival"]["latency_s"] == pytest.approx(max(extra[1], 0.0))


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_calibrate_writes_a_cluster_file(quick_calibration, capsys):
    out = quick_calibration  # `autopar calibrate --quick --world 2 --out me.json --raw ...`
    cluster = Cluster.load(str(out))
    assert cluster.backend == "gloo" and cluster.device.peak_flops["fp32"] > 1e8
    assert 0 < cluster.intra_node.latency_s < 0.1 and cluster.intra_node.bandwidth > 1e7
    # the oversubscription probe ran (2 x cores processes) on any host of <= 16 cores
    assert 0 < cluster.oversubscription_efficiency <= 1
    probed = "2 t(cores)" in cluster.sources["oversubscription_efficiency"]
    assert probed or cluster.cores_per_node > 16
    # the resume probe: a layer handed round 2 x cores processes costs more than without
    # pause by a few ms at most on any host (>= 0 by construction)
    assert 0 <= cluster.resume_s < 0.05 and ("ring" in cluster.sources["resume_s"]) == probed
    # all-gather and reduce-scatter measured on their own; the arrival from compute measured
    # (the median of a difference of two noisy times: >= 0 by construction, < 50 ms sane)
    assert set(cluster.collectives) == {"all-gather", "reduce-scatter"}
    for spec in cluster.collectives.values():
        assert 0 < spec.latency_s < 0.1 and spec.bus_bandwidth > 1e7
    assert 0 <= cluster.collective_latency_s < 0.05
    # --quick stops the attention table at ATTENTION_QUICK_MAX_SEQ (every head size measured),
    # and the file's source says which rows it holds
    rows = {(r[0], r[1]) for r in cluster.device.attention_table}
    assert rows == {(s, d) for s in calibration.ATTENTION_SEQ
                    if s <= calibration.ATTENTION_QUICK_MAX_SEQ for d in calibration.ATTENTION_HEAD}
    assert str(sorted({int(s) for s, _ in rows})) in cluster.sources["device.attention_table"]
    # a CPU GEMM's bias broadcast, priced per output element (forward, backward)
    assert all(t > 0 for t in cluster.device.op_table["linear.bias"])
    # a CNN's ops, and the convolution table --quick measures (up to CONV_QUICK_MAX_IMAGES
    # images), merged over the ranks with its three rates per row, as its source says
    assert {"batch_norm", "max_pool2d", "relu"} <= set(cluster.device.op_table)
    conv = cluster.device.conv_table
    assert conv and {r[0] for r in conv} == {b for b in calibration.CONV_BATCHES
                                             if b <= calibration.CONV_QUICK_MAX_IMAGES}
    assert all(1e7 < rate < 1e13 for r in conv for rate in r[5:])
    assert str(sorted({int(r[0]) for r in conv})) in cluster.sources["device.conv_table"]
    # AdamW's default step on a core: slower than its 28 bytes per parameter of traffic at the
    # host's memory bandwidth. The probe prices a copy as 2 transfers per byte (read + write);
    # a write-allocate cache also reads the destination first (3 transfers), so the true
    # bandwidth may be up to 1.5x the reported one, while AdamW's in-place updates pay no such
    # read (on CI's VM: 9.2 GB/s reported, AdamW at 10.5 GB/s of its 28 bytes).
    floor = 28 / (1.5 * cluster.device.memory_bandwidth)
    assert floor < cluster.device.optimizer_s_per_param < 1e-7
    # and a fixed cost per tensor: its ~10 ops each cost at least a kernel's floor
    assert 10 * cluster.device.kernel_floor_s < cluster.device.optimizer_s_per_tensor < 1e-2
    raw = json.loads(out.with_suffix(".raw.json").read_text())
    # a0 from the three collectives' fits after compute less back to back; the bandwidths
    # priced are the after-compute fits' (what a step gets)
    assert raw["arrival"]["samples"] == 3
    for key in ("all_reduce", "all_gather", "reduce_scatter"):
        assert raw[key]["after_compute_latency_s"] >= 0 and raw[key]["back_to_back_bus_bandwidth"] > 0
    assert cluster.intra_node.bandwidth == pytest.approx(raw["all_reduce"]["bus_bandwidth"])
    assert len(raw["times"]["reduce_scatter_after_compute"]) == len(raw["sizes"])
    assert main(["plan", "gpt", "--cluster", str(out), "--gpus", "2", "--global-batch", "4",
                 "--json"]) == 0


def test_the_console_script_writes_everything_before_its_fast_exit(tmp_path):
    """``autopar plan`` ends its process with os._exit after flushing (autopar.cli.entry): the
    plan file, the printed JSON and an error's message all arrive, with the exit status."""
    import subprocess
    import sys

    exe = [sys.executable, "-c", "import sys; from autopar.cli import entry; "
           "sys.argv[0] = 'autopar'; entry()"]
    small = ["plan", "gpt", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "128",
             "--seq", "32", "--cluster", "a100-80g", "--gpus", "8", "--global-batch", "16"]
    out = tmp_path / "plan.json"
    runs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for args in ([*exe, *small, "--out", str(out), "--json"], [*exe, *small, "--tp", "3"])]
    (stdout, stderr), (_, bad_stderr) = (p.communicate(timeout=300) for p in runs)
    assert runs[0].returncode == 0, stderr[-2000:]
    printed = json.loads(stdout)  # the whole document, flushed before the exit
    assert json.loads(out.read_text()) == printed and printed["plan"]["dp"] >= 1
    assert runs[1].returncode == 1 and "InfeasiblePlanError" in bad_stderr and \
        "fix:" in bad_stderr
