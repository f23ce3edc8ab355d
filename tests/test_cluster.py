"""Cluster specs: datasheet presets with sourced efficiencies, files with units, clear errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autopar import Cluster, ClusterSpecError
from autopar.cluster import PRESET_NAMES, GroupSpan, parse_quantity
from autopar.planner.comm import mesh_span

GiB = 2**30


@pytest.mark.parametrize("name, flops, hbm, mem, link, nic", [
    # datasheets: A100 SXM4 80GB, H100 SXM5, H200; NVLink 3/4 per direction; HDR/NDR NICs
    ("a100-80g", 312e12, 2.039e12, 80 * GiB, 300e9, 200e9 / 8),
    ("h100-80g", 989.4e12, 3.35e12, 80 * GiB, 450e9, 400e9 / 8),
    ("h200", 989.4e12, 4.8e12, 141e9, 450e9, 400e9 / 8),
])
def test_gpu_presets_carry_datasheet_numbers(name, flops, hbm, mem, link, nic):
    c = Cluster.load(name)
    assert c.devices_per_node == 8 and c.inter_node.count == 8
    assert c.device.peak("bf16") == pytest.approx(flops)
    assert c.device.memory_bandwidth == pytest.approx(hbm)
    assert c.device.memory_bytes == pytest.approx(mem)
    assert c.intra_node.bandwidth == pytest.approx(link)
    assert c.inter_node.bandwidth == pytest.approx(nic)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_number_has_a_source(name):
    c = Cluster.load(name)
    for key in ("device.peak_flops", "device.memory_bandwidth", "intra_node", "inter_node"):
        assert key in c.sources and c.sources[key], (name, key)
    if name != "cpu":  # efficiency factors of the GPU presets name their microbenchmark
        for key in ("device.gemm_efficiency", "device.attention_efficiency",
                    "device.memory_efficiency", "device.kernel_floor_s"):
            assert len(c.sources[key]) > 20, (name, key)


def test_with_devices_fills_nodes():
    c = Cluster.load("a100-80g").with_devices(1024)
    assert (c.nodes, c.devices_per_node, c.num_devices) == (128, 8, 1024)
    assert Cluster.load("a100-80g").with_devices(4).nodes == 1
    assert Cluster.load("a100-80g").with_devices(16, 4).nodes == 4
    assert Cluster.load("cpu").with_devices(4).devices_per_node == 4  # one host


@pytest.mark.parametrize("gpus, per_node, match", [
    (1020, None, "do not fill whole nodes of 8"),
    (32, 16, "has nodes of 8 devices"),
    (0, None, "positive integer"),
])
def test_with_devices_errors(gpus, per_node, match):
    with pytest.raises(ClusterSpecError, match=match) as info:
        Cluster.load("a100-80g").with_devices(gpus, per_node)
    assert info.value.fix


@pytest.mark.parametrize("text, base, value", [
    ("200 Gb/s", "bytes/s", 25e9), ("80 GiB", "bytes", 80 * GiB), ("2.5 us", "s", 2.5e-6),
    ("312 TFLOP/s", "flop/s", 312e12), ("2.039 TB/s", "bytes/s", 2.039e12), ("3 ms", "s", 3e-3),
    ("141 GB", "bytes", 141e9), (12.5, "bytes", 12.5), ("1e9", "bytes/s", 1e9),
])
def test_quantities(text, base, value):
    assert parse_quantity(text, base) == pytest.approx(value)


@pytest.mark.parametrize("text, base", [("80 GiB", "bytes/s"), ("fast", "bytes/s"),
                                        ("3 parsecs", "s"), (True, "s")])
def test_bad_quantities(text, base):
    with pytest.raises(ClusterSpecError):
        parse_quantity(text, base)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_file_round_trip(tmp_path, suffix):
    c = Cluster.load("h100-80g").with_devices(64)
    path = str(tmp_path / f"c{suffix}")
    c.save(path)
    assert Cluster.load(path) == c


def _spec(**changes):
    d = Cluster.load("a100-80g").to_json()
    for dotted, value in changes.items():
        target = d
        *head, last = dotted.split(".")
        for k in head:
            target = target[k]
        if value is None:
            del target[last]
        else:
            target[last] = value
    return d


@pytest.mark.parametrize("changes, match", [
    ({"device.gemm_efficiency": 1.5}, "efficiency factor"),
    ({"intra_node.bandwidth": -1}, "must be a positive number"),
    ({"device.peak_flops": {"int4": 1e15}}, "unknown dtype"),
    ({"device.memory_bytes": None}, "lacks key"),
    ({"device.hbm": 1}, "unknown key"),
    ({"nodes": 0}, "positive integer"),
    ({"inter_node.kind": "carrier-pigeon"}, "unknown link kind"),
    ({"device.default_dtype": "fp8"}, "has no peak"),
    ({"backend": "mpi"}, "unknown backend"),
    ({"cores_per_node": -2}, "cores_per_node"),
    ({"cores_per_node": 2.5}, "cores_per_node"),
    ({"oversubscription_efficiency": 0}, "oversubscription_efficiency"),
    ({"oversubscription_efficiency": 1.2}, "oversubscription_efficiency"),
    ({"resume_s": -1e-3}, "resume_s"),
    ({"device.node_overhead_s": -1e-6}, "host time per graph node"),
    ({"device.node_backward_overhead_s": "2 s"}, "host time per graph node"),
    ({"device.optimizer_s_per_param": -1e-9}, "optimizer step's time per parameter"),
    ({"device.optimizer_s_per_param": "1 ms"}, "optimizer step's time per parameter"),
    ({"device.optimizer_s_per_tensor": -1e-6}, "fixed time per parameter tensor"),
    ({"device.optimizer_s_per_tensor": "1 s"}, "fixed time per parameter tensor"),
    ({"collectives": {"broadcast": {"latency_s": 1e-5, "bus_bandwidth": 1e9}}},
     "unknown collective"),
    ({"collectives": {"reduce-scatter": {"latency_s": 1e-5}}}, "lacks key"),
    ({"collectives": {"reduce-scatter": {"latency_s": 1e-5, "bus_bandwidth": 0}}},
     "must be a positive number"),
    ({"collectives": [1]}, "collectives must be a mapping"),
    ({"collectives": {"all-gather": 1e9}}, "collectives.all-gather must be a mapping"),
])
def test_bad_specs_name_the_problem(tmp_path, changes, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_spec(**changes)))
    with pytest.raises(ClusterSpecError, match=match) as info:
        Cluster.load(str(path))
    assert info.value.expected is not None and info.value.fix is not None


@pytest.mark.parametrize("efficiency", [1.0, 0.9])
@pytest.mark.parametrize("cores, computing, share", [
    (0, 64, 1.0),  # GPUs: every device its own compute
    (2, 1, 1.0), (2, 2, 1.0), (2, 3, 2 / 3), (2, 4, 0.5), (8, 32, 0.25),
])
def test_compute_share_of_processes_on_shared_cores(cores, computing, share, efficiency):
    """Fair sharing, times the measured efficiency once the processes outnumber the cores (and
    never below or at the core count)."""
    c = dataclasses.replace(Cluster.load("cpu"), cores_per_node=cores,
                            oversubscription_efficiency=efficiency)
    oversubscribed = 0 < cores < computing
    assert c.compute_share(computing) == pytest.approx(
        share * (efficiency if oversubscribed else 1.0))


def test_cpu_preset_describes_its_host():
    c = Cluster.load("cpu")
    assert c.cores_per_node >= 1  # recorded by autopar calibrate
    assert 0 < c.device.node_overhead_s < 1e-4 and 0 < c.device.node_backward_overhead_s < 1e-4
    assert 0 < c.oversubscription_efficiency <= 1
    assert 0 < c.resume_s < 0.01  # resuming on a core others ran on: ms, not a step's worth
    # a core's for-loop AdamW: a few ns per parameter, slower than 28 bytes of streaming
    assert c.device.optimizer_s_per_param > 28 / c.device.memory_bandwidth
    for key in ("cores_per_node", "oversubscription_efficiency", "device.node_overhead_s",
                "device.node_backward_overhead_s", "device.optimizer_s_per_param",
                "device.optimizer_s_per_tensor", "resume_s"):
        assert c.sources.get(key), key
    gpu = Cluster.load("a100-80g")  # kernels launch asynchronously: no per-node host time
    assert gpu.cores_per_node == 0 and gpu.device.node_overhead_s == 0.0
    assert gpu.device.optimizer_s_per_param == 0.0  # a fused AdamW: priced as its traffic
    assert gpu.device.optimizer_s_per_tensor == 0.0  # multi-tensor kernels: no per-tensor loop
    assert 0 < c.device.optimizer_s_per_tensor < 1e-3  # a core's for-loop AdamW: ~10 ops a tensor
    assert gpu.device.optimizer_s_per_tensor == 0.0  # multi-tensor kernels: no per-tensor loop
    assert 0 < c.device.optimizer_s_per_tensor < 1e-3  # a core's for-loop AdamW: ~10 ops a tensor
    round_trip = Cluster.from_json(json.loads(json.dumps(c.to_json())))
    assert round_trip == c
    # gloo's all-gather and reduce-scatter as measured; the reduce-scatter is no ring at the
    # all-reduce's bandwidth; every collective pays the ranks' arrival from compute
    assert set(c.collectives) == {"all-gather", "reduce-scatter"}
    assert c.collectives["reduce-scatter"].bus_bandwidth < c.intra_node.bandwidth
    assert c.collective_latency_s > 0
    for key in ("collectives", "collective_latency_s"):
        assert c.sources.get(key), key


def test_unknown_preset_and_bad_syntax(tmp_path):
    with pytest.raises(ClusterSpecError, match="no cluster preset or file"):
        Cluster.load("a100")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ClusterSpecError, match="cannot parse"):
        Cluster.load(str(bad))


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_a_preset_reads_the_same_under_pythons_yaml_parser(name):
    """Cluster files are parsed with libyaml where PyYAML has it (7x faster on the cpu preset);
    PyYAML's pure-Python SafeLoader is the reference: the same document, key for key."""
    from importlib import resources

    import yaml

    from autopar.cluster import _parse_text

    text = resources.files("autopar.data").joinpath(f"clusters/{name}.yaml").read_text()
    assert _parse_text(text, f"{name}.yaml") == yaml.load(text, Loader=yaml.SafeLoader)


def test_group_spans_follow_the_mesh_layout():
    """Brute force: place every rank (tp innermost, then pp, then dp) and count."""
    c = Cluster.load("a100-80g").with_devices(128)
    dp, pp, tp = 4, 4, 8

    def ranks(axis, fixed):
        d, p, t = fixed
        if axis == "tp":
            return [(d * pp + p) * tp + i for i in range(tp)]
        if axis == "pp":
            return [(d * pp + i) * tp + t for i in range(pp)]
        return [(i * pp + p) * tp + t for i in range(dp)]

    for axis in ("tp", "pp", "dp"):
        assert mesh_span(c, dp, pp, tp, axis) == c.span(ranks(axis, (1, 2, 3)))
    assert mesh_span(c, dp, pp, tp, "tp") == GroupSpan(8, 1, 8)
    assert mesh_span(c, dp, pp, tp, "dp") == GroupSpan(4, 4, 1)
    assert mesh_span(c, 16, 2, 4, "pp") == GroupSpan(2, 1, 2)


#: What measure_cuda returns on an H100 (made-up figures of the right size), for the tests of
#: what ``calibrate --device cuda`` does with its measurements.
H100_MEASURED = {
    "device_name": "NVIDIA H100 80GB HBM3", "gemm_flops_bf16": 7.5e14,
    "gemm_flops_fp32": 5.0e13, "memory_bandwidth": 2.9e12, "kernel_floor_s": 2.5e-6,
    "gemm_table": [[512, 1024, 1024, 1e14]], "attention_table": [[1024, 64, 3e14, 2e14]],
    "op_table": {"gelu": [3e-12, 6e-12]}, "launch_overhead_s": 1.2e-5,
    "launch_backward_overhead_s": 1.5e-5, "host_optimizer_s_per_param": 3e-9,
    "host_optimizer_s_per_tensor": 5e-5, "checkpoint_call_overhead_s": 2e-4,
    "checkpoint_tensor_overhead_s": 1e-5,
}


def test_calibrate_device_cuda_writes_and_shows_the_measurements(tmp_path, monkeypatch, capsys):
    """The CLI path of ``autopar calibrate --device cuda`` (a GPU's measurements stubbed by the
    dict measure_cuda returns): the file holds the measured launch and host-optimizer costs and
    the table shows them."""
    import torch

    from autopar.cli import main
    from autopar.planner import calibration_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(calibration_cuda, "measure_cuda", lambda quick=False: H100_MEASURED)
    out = tmp_path / "h100.json"
    assert main(["calibrate", "--device", "cuda", "--out", str(out)]) == 0
    cluster = Cluster.load(str(out))
    assert cluster.device.launch_overhead_s == 1.2e-5
    assert cluster.host_optimizer_s_per_param == 3e-9
    shown = capsys.readouterr().out
    assert "12.0 us / 15.0 us" in shown and "3.00 ns" in shown


def test_a_calibrated_gpu_keeps_its_preset_links_and_prices_with_its_tables(tmp_path):
    """``autopar calibrate --device cuda`` output (built here from a measurement dict, as
    measure_cuda returns it on a GPU): the device's numbers are the measured ones, the nodes and
    links the preset's; the file round-trips; the cost model's GEMM time comes from the measured
    table (a shape in the table is priced at its measured rate), not from peak x efficiency."""
    from autopar.planner.calibration_cuda import cuda_cluster
    from autopar.planner.cost_model import gemm_time

    rate = {(m, n, k): 1e14 + m for m in (512, 8192) for n in (1024, 4096) for k in (1024, 4096)}
    measured = {
        **H100_MEASURED,
        "gemm_table": [[m, n, k, r] for (m, n, k), r in rate.items()],
        "attention_table": [[1024, 64, 3.0e14, 2.0e14], [2048, 128, 4.0e14, 3.0e14]],
        "op_table": {"gelu": [3e-12, 6e-12], "layer_norm": [4e-12, 9e-12]},
    }
    cluster = cuda_cluster(measured, torch_version="test")
    assert (cluster.device.launch_overhead_s, cluster.device.launch_backward_overhead_s) == \
        (1.2e-5, 1.5e-5)
    assert (cluster.host_optimizer_s_per_param, cluster.host_optimizer_s_per_tensor) == \
        (3e-9, 5e-5)
    assert (cluster.device.checkpoint_call_overhead_s,
            cluster.device.checkpoint_tensor_overhead_s) == (2e-4, 1e-5)
    preset = Cluster.load("h100-80g")
    assert cluster.name == "h100-80g-calibrated"
    assert (cluster.nodes, cluster.devices_per_node) == (preset.nodes, preset.devices_per_node)
    assert cluster.intra_node == preset.intra_node and cluster.inter_node == preset.inter_node
    d = cluster.device
    assert d.peak_flops["bf16"] == 7.5e14 and d.gemm_efficiency == 1.0
    assert d.op_table["gelu"] == (3e-12, 6e-12) and d.default_dtype == "bf16"
    path = tmp_path / "h100.json"
    cluster.save(str(path))
    assert Cluster.load(str(path)) == cluster
    m, n, k = 8192, 4096, 1024
    assert gemm_time(cluster, "bf16", 1, m, n, k) == pytest.approx(2 * m * n * k / rate[(m, n, k)])
    assert gemm_time(preset, "bf16", 1, m, n, k) != pytest.approx(gemm_time(cluster, "bf16", 1,
                                                                            m, n, k))


def test_one_map_from_device_names_to_presets():
    """parallelize's default cluster and calibrate --device cuda's base read the same map."""
    from autopar.cluster import FALLBACK_GPU_PRESET, preset_for_device

    assert preset_for_device("NVIDIA H100 80GB HBM3") == "h100-80g"
    assert preset_for_device("NVIDIA H200") == "h200"
    assert preset_for_device("NVIDIA A100-SXM4-80GB") == "a100-80g"
    assert preset_for_device("cpu") == "cpu"
    assert preset_for_device("NVIDIA L4") == FALLBACK_GPU_PRESET == "a100-80g"
