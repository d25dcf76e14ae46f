"""The collectives model pinned at the nccl-tests and NCCL-maintainer figures its catalog cites."""
import json

import pytest

import hardware
from costmodel import collectives as coll
from hardware.errors import HardwareError


@pytest.fixture(scope="module")
def h100():
    return hardware.load("256xh100-sxm")


def test_ring_inside_a_node_is_the_simple_protocol_for_large_messages(h100):
    """Launch + 7 steps at the NVLink step latency + the ring's traffic at the bus bandwidth."""
    group, nbytes = coll.Group(8, 8), 1e9
    simple = next(p for p in h100.collectives.ring if p.name == "simple")
    bw = h100.node.link_gbps * 1e9 * h100.gpu.efficiency.intra_node_bw
    expected = (simple.launch_us + 7 * simple.intra_step_us) * 1e-6 + 7 / 8 * nbytes / bw
    assert coll.all_gather(nbytes, group, h100) == pytest.approx(expected)
    assert coll.reduce_scatter(nbytes, group, h100) == pytest.approx(expected)


def test_nvlink_bus_bandwidth_matches_the_maintainers_figure(h100):
    """nccl-tests #212: ~370 GB/s ring bus bandwidth on 8 H100s."""
    busbw = coll.bus_bandwidth("all_gather", 4e9, coll.Group(8, 8), h100)
    assert busbw / 1e9 == pytest.approx(370, rel=0.05)


def test_two_node_ring_runs_at_the_nics_rate(h100):
    """nccl-tests #290: 46-48 GB/s per 400 Gb/s NIC, 8 NICs a node."""
    busbw = coll.bus_bandwidth("all_gather", 4e9, coll.Group(16, 8), h100)
    assert busbw / 1e9 == pytest.approx(8 * 47, rel=0.05)


def test_bus_bandwidth_falls_at_32_nodes(h100):
    """nccl #1218: all_gather_perf at 2 GB on 32 H100 nodes: ~200 GB/s."""
    busbw = coll.bus_bandwidth("all_gather", 2e9, coll.Group(256, 8), h100)
    assert busbw / 1e9 == pytest.approx(200, rel=0.10)


def test_bus_bandwidth_rises_with_message_size(h100):
    sizes = [2**k for k in range(10, 33, 2)]
    busbw = [coll.bus_bandwidth("all_reduce", s, coll.Group(8, 8), h100) for s in sizes]
    assert busbw == sorted(busbw)
    assert busbw[0] < 0.01 * busbw[-1]  # 1 kB: latency-bound


def test_ring_latency_counts_every_rank_not_only_the_nodes(h100):
    big = hardware.load("1024xa100-80g")
    small_msg = 1e3
    ring = coll.all_gather(small_msg, coll.Group(1024, 8), big)
    fastest_step = min(p.intra_step_us for p in big.collectives.ring) * 1e-6
    assert ring >= 1023 * fastest_step
    # the tree keeps a small all-reduce in log2(nodes) hops, far under the ring's latency
    assert coll.all_reduce(small_msg, coll.Group(1024, 8), big) < ring


def test_profile_without_a_library_is_plain_alpha_beta():
    cpu = hardware.load("4xcpu")
    assert cpu.collectives is None
    nbytes, group = 1e8, coll.Group(4, 4)
    bw = cpu.node.link_gbps * 1e9 * cpu.gpu.efficiency.intra_node_bw
    alpha = cpu.node.link_latency_us * 1e-6
    assert coll.all_reduce(nbytes, group, cpu) == pytest.approx(2 * (3 / 4 * nbytes / bw + 3 * alpha))


def test_group_placement():
    cluster = hardware.load("16xa100-80g")
    assert coll.group_of(8, 1, cluster) == coll.Group(8, 8)
    assert coll.group_of(2, 8, cluster) == coll.Group(2, 1)


def _entry_with(tmp_path, collectives):
    entry = json.loads((hardware.catalog_io.CATALOG_DIR / "h100-sxm.json").read_text())
    entry["network"]["collectives"] = collectives
    entry["count"] = 16
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(entry))
    return path


def test_nic_scaling_needs_a_source(tmp_path):
    path = _entry_with(tmp_path, {"library_file": "nccl", "nic_scaling": [[2, 1.0], [32, 0.5]]})
    with pytest.raises(HardwareError, match="nic_scaling"):
        hardware.load(path)


def test_unknown_library_names_the_known_ones(tmp_path):
    path = _entry_with(tmp_path, {"library_file": "mpi"})
    with pytest.raises(HardwareError, match="nccl"):
        hardware.load(path)


def test_measured_passes_price_the_librarys_all_gather_and_reduce_scatter():
    """gloo's all-gather and reduce-scatter cost about as much as its all-reduce (calibrate
    measures the passes): a profile carrying them prices those kinds by them."""
    cpu = hardware.load("4xcpu")
    link = hardware.schema.Protocol(name="link", launch_us=0, intra_step_us=cpu.node.link_latency_us,
                                    inter_step_us=cpu.node.link_latency_us, bandwidth_fraction=1.0,
                                    sources={k: "test" for k in ("launch_us", "intra_step_us", "inter_step_us",
                                                                 "bandwidth_fraction")})
    gloo = cpu.model_copy(update={"collectives": hardware.schema.Collectives(
        library="gloo", ring=[link], passes={"all_gather": 2.5, "reduce_scatter": 3.0}, sources={"passes": "test"})})
    nbytes, group = 1e8, coll.Group(4, 4)
    assert coll.all_gather(nbytes, group, gloo) == pytest.approx(2.5 * coll.all_gather(nbytes, group, cpu))
    assert coll.reduce_scatter(nbytes, group, gloo) == pytest.approx(3.0 * coll.reduce_scatter(nbytes, group, cpu))
    assert coll.all_reduce(nbytes, group, gloo) == pytest.approx(coll.all_reduce(nbytes, group, cpu))


def test_measured_passes_need_a_source():
    link = hardware.schema.Protocol(name="link", launch_us=0, intra_step_us=1, inter_step_us=1,
                                    bandwidth_fraction=1.0, sources={k: "test" for k in (
                                        "launch_us", "intra_step_us", "inter_step_us", "bandwidth_fraction")})
    with pytest.raises(ValueError, match="passes"):
        hardware.schema.Collectives(library="gloo", ring=[link], passes={"all_gather": 2.0})
