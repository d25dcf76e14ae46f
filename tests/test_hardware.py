"""The hardware package: catalog data, spec parsing, overrides, errors, prices, CLI."""
from __future__ import annotations

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hardware
from hardware import Cluster, HardwareError, gpu_entry, list_catalog, load, price_per_gpu_hour
from hardware.catalog_io import CATALOG_DIR
from hardware.prices import load_price_table

EXPECTED = {"v100-32g", "a100-40g", "a100-80g", "h100-sxm", "h200", "b200", "mi300x", "l40s", "cpu"}


# --- catalog ------------------------------------------------------------------

def test_catalog_lists_every_gpu_type():
    assert set(list_catalog()) == EXPECTED
    assert {p.stem for p in CATALOG_DIR.glob("*.json")} == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_entry_loads_as_one_full_node(name):
    cluster = load(name)
    assert isinstance(cluster, Cluster)
    assert cluster.n_nodes == 1 and cluster.n_gpus == cluster.gpus_per_node == 8
    assert cluster.spec() == f"8x{name}"
    assert load(cluster.spec()) == cluster
    stacks = list(cluster.gpu.efficiency.stacks.values())
    for model in (cluster.gpu, cluster.gpu.efficiency, cluster.node, *stacks):
        numeric = [f for f, v in model if isinstance(v, (int, float, dict)) and f != "sources" and v is not None
                   and f not in type(model).unsourced_fields]
        assert set(numeric) <= set(model.sources), (name, type(model).__name__)
        assert all(model.sources[f].strip() for f in numeric)


@pytest.mark.parametrize("spec, check", [
    ("h100-sxm", lambda c: c.gpu.peak_tflops["bf16"] == 989),
    ("h100-sxm", lambda c: c.gpu.peak_tflops["tf32"] == 494.7 and c.gpu.peak_tflops["fp32"] == 67),
    ("h100-sxm", lambda c: c.node.link_gbps == 450 and c.nic_gbps == 400 and c.gpu.hbm_gbps == 3350),
    ("a100-80g", lambda c: c.gpu.hbm_gb == 80 and c.gpu.hbm_gbps == 2039),
    ("a100-40g", lambda c: c.gpu.hbm_gb == 40 and c.gpu.peak_tflops["tf32"] == 156),
    ("v100-32g", lambda c: set(c.gpu.peak_tflops) == {"fp32", "fp16"} and c.node.fabric == "mesh"),
    ("h200", lambda c: c.gpu.hbm_gb == 141 and c.gpu.hbm_gbps == 4800),
    ("b200", lambda c: c.gpu.peak_tflops["bf16"] == 2250 and c.node.link_gbps == 900),
    ("mi300x", lambda c: c.gpu.peak_tflops["bf16"] == 1307.4 and c.node.fabric == "mesh"),
    ("cpu", lambda c: c.gpu.peak_tflops["fp32"] == 1.0),
])
def test_known_figures(spec, check):
    assert check(load(spec))


def test_v100_bf16_falls_back_to_fp16_peak():
    assert load("v100").gpu.peak_flops("bf16") == 125e12


def test_mtbf_cites_llama3():
    assert 50_000 < load("h100").gpu.mtbf_hours < 51_000
    assert "Llama 3" in load("h100").gpu.sources["mtbf_hours"]


# --- spec parsing ---------------------------------------------------------------

@pytest.mark.parametrize("spec, name, n_nodes, per_node", [
    ("64xh100-sxm", "h100-sxm", 8, 8),
    ("64 x H100-SXM", "h100-sxm", 8, 8),
    ("  16X H100  ", "h100-sxm", 2, 8),
    ("8xa100-80g", "a100-80g", 1, 8),
    ("16xa100-80gb", "a100-80g", 2, 8),
    ("a100", "a100-80g", 1, 8),
    ("h100-sxm5", "h100-sxm", 1, 8),
    ("2xcpu", "cpu", 1, 2),
    ("4xcpu", "cpu", 1, 4),
    ("1xh200", "h200", 1, 1),
    ("8xmi300x", "mi300x", 1, 8),
    ("MI300X", "mi300x", 1, 8),
    ("24×b200", "b200", 3, 8),
])
def test_spec_forms(spec, name, n_nodes, per_node):
    cluster = load(spec)
    assert (cluster.name, cluster.n_nodes, cluster.gpus_per_node) == (name, n_nodes, per_node)


def test_partial_node_is_sourced():
    cluster = load("2xh100")
    assert "partial node" in cluster.node.sources["gpus_per_node"]


def test_overrides_replace_values_and_sources():
    cluster = load("16xh100", gpus_per_node=4, nic_gbps=100, nic_latency_us=0, intra_gbps=200,
                   intra_latency_us=1.5, price_per_gpu_hour=2.5)
    assert (cluster.n_nodes, cluster.gpus_per_node) == (4, 4)
    assert (cluster.nic_gbps, cluster.nic_latency_us, cluster.price_per_gpu_hour) == (100, 0, 2.5)
    assert (cluster.node.link_gbps, cluster.node.link_latency_us) == (200, 1.5)
    for field in ("nic_gbps", "nic_latency_us", "price_per_gpu_hour"):
        assert cluster.sources[field] == "user override"
    for field in ("gpus_per_node", "link_gbps", "link_latency_us"):
        assert cluster.node.sources[field] == "user override"
    assert "NVLink" not in cluster.node.sources["link_gbps"]


def test_overrides_on_a_cluster_object():
    cluster = load(load("16xh100"), nic_gbps=200)
    assert cluster.n_gpus == 16 and cluster.nic_gbps == 200
    assert load(cluster) == cluster


def test_load_is_fast_enough_for_the_planner():
    import time
    start = time.perf_counter()
    for _ in range(200):
        load("64xh100-sxm")
    assert time.perf_counter() - start < 2.0


# --- errors ---------------------------------------------------------------------

@pytest.mark.parametrize("spec, field, needle", [
    ("h1000", "hw", "h100-sxm"),
    ("8xtpu-v5", "hw", "h100-sxm"),
    ("", "hw", "h100-sxm"),
    ("0xh100", "hw", "8xh100-sxm"),
    ("-8xh100", "hw", "8xh100-sxm"),
    ("1.5xh100", "hw", "8xh100-sxm"),
    ("abcxh100", "hw", "8xh100-sxm"),
    ("xh100", "hw", "8xh100-sxm"),
    ("12xh100", "hw", "16xh100-sxm"),
    ("3xa100", "hw", "4xa100-80g"),
    ("no/such/file.json", "hw", "8xh100-sxm"),
])
def test_spec_errors_name_field_and_alternative(spec, field, needle):
    with pytest.raises(HardwareError) as info:
        load(spec)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}:")
    assert needle in str(info.value)


def test_nearest_counts_are_suggested():
    with pytest.raises(HardwareError, match=r"8xh100-sxm or 16xh100-sxm"):
        load("12xh100")
    with pytest.raises(HardwareError, match=r"2xcpu or 4xcpu"):
        load("3xcpu")


@pytest.mark.parametrize("kwargs, field", [
    ({"gpus_per_node": 0}, "gpus_per_node"),
    ({"gpus_per_node": 2.5}, "gpus_per_node"),
    ({"gpus_per_node": True}, "gpus_per_node"),
    ({"nic_gbps": -1}, "nic_gbps"),
    ({"nic_gbps": float("nan")}, "nic_gbps"),
    ({"intra_gbps": 0}, "intra_gbps"),
    ({"intra_latency_us": -0.1}, "intra_latency_us"),
    ({"nic_latency_us": "fast"}, "nic_latency_us"),
    ({"price_per_gpu_hour": -2}, "price_per_gpu_hour"),
])
def test_bad_overrides(kwargs, field):
    with pytest.raises(HardwareError) as info:
        load("8xh100", **kwargs)
    assert info.value.field == field and info.value.hint


def test_count_error_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "three.json"
    path.write_text(json.dumps({**_entry_dict(), "count": 3}))
    with pytest.raises(HardwareError, match="three.json.*2xh100-sxm or 4xh100-sxm"):
        load(path)


def test_gpus_per_node_override_must_fit_count():
    with pytest.raises(HardwareError, match="whole nodes of 3"):
        load("8xh100", gpus_per_node=3)


def test_non_string_spec():
    with pytest.raises(HardwareError):
        load(42)


# --- profile files ----------------------------------------------------------------

def _entry_dict(name="h100-sxm"):
    return json.loads((CATALOG_DIR / f"{name}.json").read_text())


def test_cluster_json_round_trips(tmp_path):
    cluster = load("32xh100", nic_gbps=200, price_per_gpu_hour=3.0)
    path = tmp_path / "mine.json"
    path.write_text(cluster.model_dump_json(indent=2))
    assert load(path) == cluster
    assert load(str(path)) == cluster


def test_entry_style_file_with_count(tmp_path):
    data = _entry_dict()
    data.update(name="my-h100", count=32)
    path = tmp_path / "my.json"
    path.write_text(json.dumps(data))
    cluster = load(path)
    assert (cluster.name, cluster.n_nodes) == ("my-h100", 4)
    assert cluster.price_per_gpu_hour == 6.88  # priced by the GPU's catalog name


def test_entry_missing_a_source_is_refused(tmp_path):
    data = _entry_dict()
    del data["gpu"]["sources"]["hbm_gb"]
    path = tmp_path / "unsourced.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HardwareError) as info:
        load(path)
    assert "hbm_gb" in str(info.value) and "unsourced.json" in str(info.value)
    assert info.value.field == "gpu"


@pytest.mark.parametrize("content, needle", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"name": "x"}), "gpu"),
    (json.dumps({**_entry_dict(), "gpu": {**_entry_dict()["gpu"], "hbm_gb": -1}}), "gpu.hbm_gb"),
    (json.dumps({**json.loads(load("h100").model_dump_json()), "n_nodes": 0}), "n_nodes"),
])
def test_malformed_files_name_file_and_field(tmp_path, content, needle):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(HardwareError) as info:
        load(path)
    assert "bad.json" in str(info.value) and needle in str(info.value)


# --- fuzzing --------------------------------------------------------------------

_spec_text = st.one_of(
    st.text(max_size=30),
    st.builds(lambda n, sep, name: f"{n}{sep}{name}", st.integers(-20, 200), st.sampled_from(["x", " x ", "X", "×"]),
              st.sampled_from(sorted(EXPECTED) + ["h100", "A100", "tpu", ""])),
    st.text(alphabet=string.ascii_lowercase + string.digits + "x-. ", max_size=20),
)


@settings(max_examples=300, deadline=None)
@given(_spec_text)
def test_random_specs_only_raise_hardware_error(spec):
    try:
        cluster = load(spec)
    except HardwareError as error:
        assert error.field and str(error)
    else:
        assert isinstance(cluster, Cluster) and cluster.n_gpus > 0


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_keys = st.sampled_from(["name", "gpu", "node", "network", "count", "n_nodes", "sources", "nic_gbps", "aliases"])


def _mutated_entry(draw_key, value):
    data = _entry_dict()
    data[draw_key] = value
    return data


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(_json, st.dictionaries(_keys, _json, max_size=6), st.builds(_mutated_entry, _keys, _json)))
def test_random_json_files_only_raise_hardware_error(tmp_path, data):
    path = tmp_path / "fuzz.json"
    path.write_text(json.dumps(data))
    try:
        cluster = load(path)
    except HardwareError as error:
        assert error.field and "fuzz.json" in str(error)
    else:
        assert isinstance(cluster, Cluster)


# --- prices ---------------------------------------------------------------------

def test_price_quotes_from_cloud_table():
    quote = price_per_gpu_hour("h100")
    assert quote.usd == pytest.approx(55.04 / 8) and "p5.48xlarge" in quote.source and quote.date
    assert price_per_gpu_hour("a100-40g").usd == pytest.approx(21.957642 / 8, rel=1e-4)
    assert price_per_gpu_hour("b200").usd == pytest.approx(113.9328 / 8, rel=1e-4)
    assert price_per_gpu_hour("mi300x").usd is None
    assert price_per_gpu_hour("unknown-gpu").usd is None


def test_cluster_price_and_source():
    cluster = load("16xh100")
    assert cluster.price_per_gpu_hour == pytest.approx(6.88)
    assert "p5.48xlarge" in cluster.sources["price_per_gpu_hour"]
    assert load("8xmi300x").price_per_gpu_hour is None


def test_user_price_table_overrides(tmp_path):
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"h100-sxm5": {"usd": 2.1, "source": "our contract", "date": "2026-01-01"},
                                "mi300x": 1.9}))
    table = load_price_table(path)
    assert table["h100-sxm"].usd == 2.1 and table["mi300x"].usd == 1.9
    assert price_per_gpu_hour("h100", table).source == "our contract"
    assert price_per_gpu_hour("b200", table).usd == pytest.approx(14.2416)  # falls back to shipped
    cluster = load("8xh100", price_table=path)
    assert cluster.price_per_gpu_hour == 2.1 and "our contract" in cluster.sources["price_per_gpu_hour"]


def test_bad_price_table(tmp_path):
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"h100": {"usd": -1}}))
    with pytest.raises(HardwareError, match="prices.h100.usd"):
        load_price_table(path)


def test_package_exports():
    for name in ("load", "list_catalog", "Cluster", "GPU", "Node", "Efficiency", "HardwareError",
                 "ParallaxError", "price_per_gpu_hour"):
        assert hasattr(hardware, name)
    assert gpu_entry("H100").name == "h100-sxm"


# --- CLI ------------------------------------------------------------------------

def test_cli_list(capsys):
    from parallax_cli import main
    assert main(["hardware", "list"]) == 0
    out = capsys.readouterr().out
    for name in EXPECTED:
        assert name in out
    assert "989" in out and "6.88" in out


def test_cli_show(capsys):
    from parallax_cli import main
    assert main(["hardware", "show", "16xh100", "--nic-gbps", "200"]) == 0
    out = capsys.readouterr().out
    assert "16xh100-sxm" in out and "989" in out and "Llama 3" in out and "user override" in out


def test_cli_bad_spec(capsys):
    from parallax_cli import main
    assert main(["hardware", "show", "12xh100"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "16xh100-sxm" in err


def test_each_stack_prices_with_its_own_fitted_efficiencies():
    """H100's eager set (fitted on PyTorch FSDP runs) differs from its fused base (Megatron / TE);
    compile takes eager's GEMM and attention speeds; pricing twice for one stack is a no-op."""
    cluster = load("8xh100-sxm")
    base = cluster.gpu.efficiency
    eager = cluster.for_stack("eager").gpu.efficiency
    assert base.stacks["eager"].matmul_max == eager.matmul_max < base.matmul_max
    assert eager.sources["matmul_max"].startswith("eager stack:")
    assert (eager.intra_node_bw, eager.inter_node_bw) == (base.intra_node_bw, base.inter_node_bw)  # links: hardware's
    assert cluster.for_stack("compile").gpu.efficiency.matmul_max == eager.matmul_max
    fused = cluster.for_stack("fused")
    assert fused.gpu.efficiency.matmul_max == base.matmul_max
    assert fused.for_stack("fused") is fused
    with pytest.raises(ValueError, match="already priced"):
        fused.for_stack("eager")
    cpu = load("2xcpu")  # no stack of its own: every stack is the profile's one set
    assert cpu.for_stack("fused").gpu.efficiency.matmul_max == cpu.for_stack("eager").gpu.efficiency.matmul_max
