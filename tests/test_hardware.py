import json
import math

import pytest

from lab.core.errors import UserError
from lab.core.hardware import CATALOG, Catalog, Chip, default_catalog, get_chip, load_hardware_file

CANONICAL = [
    "tpu-v3",
    "tpu-v4",
    "tpu-v5e",
    "tpu-v5p",
    "tpu-v6e",
    "tpu-v7x",
    "a100-40gb",
    "a100-80gb",
    "a800",
    "h100",
    "h100-pcie",
    "h200",
    "h800",
    "h20",
    "b200",
    "gb200",
    "b300",
    "gb300",
    "mi300x",
    "mi325x",
    "mi355x",
    "a10g",
    "a10",
    "l4",
    "l40s",
    "v100",
    "cpu",
]
NUMERIC_FIELDS = [
    "hbm_bytes",
    "hbm_bandwidth",
    "link_bandwidth",
    "hop_latency_s",
    "scaleout_bandwidth",
    "scaleout_latency_s",
    "launch_latency_s",
]


def test_catalog_has_the_canonical_names():
    assert [c.name for c in CATALOG] == CANONICAL


@pytest.mark.parametrize("chip", CATALOG, ids=lambda c: c.name)
def test_every_number_cites_a_source(chip):
    for dt in chip.peak_flops:
        assert chip.sources.get(f"peak_flops.{dt}"), f"{chip.name}: peak_flops.{dt} has no source"
    for f in NUMERIC_FIELDS + (["price_per_hour"] if chip.price_per_hour else []):
        assert chip.sources.get(f), f"{chip.name}: {f} has no source"
    if chip.topology == "torus":
        for f in ("torus_dims", "wraparound_rule", "wraparound_size", "pod_shape"):
            assert chip.sources.get(f), f"{chip.name}: {f} has no source"
    else:
        assert chip.sources.get("node_size")


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("v5e", "tpu-v5e"),
        ("TPU-V5E", "tpu-v5e"),
        ("tpu_v5e", "tpu-v5e"),
        ("v4", "tpu-v4"),
        ("Trillium", "tpu-v6e"),
        ("a100", "a100-80gb"),
        ("A100-40GB", "a100-40gb"),
        ("h100-sxm", "h100"),
        ("H100", "h100"),
        ("h200", "h200"),
        ("host", "cpu"),
        ("tpuv5p", "tpu-v5p"),
    ],
)
def test_names_and_aliases_resolve(alias, name):
    assert get_chip(alias).name == name


def test_unknown_name_lists_valid_ones():
    with pytest.raises(UserError, match=r"unknown hardware 'tpu-v9'.*tpu-v5e.*h100"):
        get_chip("tpu-v9")


def test_book_critical_intensities():
    # roofline.md: v5e 1.97e14 / 8.2e11 = 240 (bf16) and 480 for int8; H100 9.89e14 / 3.35e12 = 295.
    v5e, h100 = get_chip("v5e"), get_chip("h100")
    assert v5e.critical_intensity("bf16") == pytest.approx(240, rel=0.01)
    assert v5e.critical_intensity("int8") == pytest.approx(480, rel=0.01)
    assert h100.critical_intensity("bf16") == pytest.approx(295, rel=0.01)


def test_dense_peaks_not_sparsity_figures():
    # gpus.md: the H100 datasheet's 1.979e15 bf16 assumes 2:4 sparsity; dense is 9.89e14.
    assert get_chip("h100").flops("bf16") == pytest.approx(9.89e14, rel=0.01)
    assert get_chip("b200").flops("bf16") == pytest.approx(2.25e15, rel=0.01)


def test_missing_dtype_is_a_clear_error():
    with pytest.raises(UserError, match=r"tpu-v5e has no fp8 peak.*bf16, int8"):
        get_chip("v5e").flops("fp8")


@pytest.mark.parametrize(
    ("chip", "shape", "expect"),
    [
        ("v5e", (16, 16), (True, True)),
        ("v5e", (8, 16), (False, True)),  # tpus.md: 8x16 wraps on the long axis only
        ("v5e", (4, 4), (False, False)),
        ("v6e", (16, 4), (True, False)),
        ("v5p", (4, 4, 4), (True, True, True)),  # any multiple of a full cube has wraparound
        ("v5p", (4, 4, 8), (True, True, True)),
        ("v5p", (2, 2, 4), (False, False, False)),  # smaller slices have none
        ("v4", (2, 2, 1), (False, False, False)),
    ],
)
def test_wraparound_rules(chip, shape, expect):
    assert get_chip(chip).wraparound(shape) == expect


def test_toml_file_overrides_with_base(tmp_path):
    f = tmp_path / "chips.toml"
    f.write_text(
        'name = "h100-pcie"\nbase = "h100"\nhbm_bandwidth = 2.0e12\nlink_bandwidth = 6.4e10\n'
        '[peak_flops]\nbf16 = 7.56e14\n[sources]\nhbm_bandwidth = "H100 PCIe datasheet"\n'
    )
    cat = default_catalog(f)
    chip = cat.get("H100-PCIe")
    base = cat.get("h100")
    assert chip.hbm_bandwidth == 2.0e12 and chip.flops("bf16") == 7.56e14
    assert chip.flops("fp8") == base.flops("fp8")  # inherited
    assert chip.hbm_bytes == base.hbm_bytes
    assert chip.sources["hbm_bandwidth"] == "H100 PCIe datasheet"
    assert chip.aliases == ()  # the base's aliases still resolve to the base
    assert cat.get("h100-sxm").name == "h100"


def test_json_file_with_several_chips_and_round_trip(tmp_path):
    v5e = get_chip("v5e")
    twin = v5e.fields() | {"name": "my-v5e", "aliases": ["mine"], "hbm_bandwidth": 9e11}
    f = tmp_path / "chips.json"
    f.write_text(json.dumps({"chips": [twin, {"name": "slow-h100", "base": "h100", "link_bandwidth": 1e11}]}))
    cat = default_catalog(f)
    mine = cat.get("mine")
    assert mine == Chip(
        **(v5e.fields() | {"name": "my-v5e", "aliases": ("mine",), "hbm_bandwidth": 9e11, "pod_shape": (16, 16)})
    )
    assert cat.get("slow-h100").link_bandwidth == 1e11


def test_to_dict_json_loads_back(tmp_path):
    # `hardware show --json` output is itself a valid hardware file (the calibration format).
    f = tmp_path / "b200.json"
    f.write_text(json.dumps(get_chip("b200").to_dict() | {"name": "b200-copy", "aliases": []}))
    (copy,) = load_hardware_file(f)
    assert copy.fields() | {"name": "b200", "aliases": list(get_chip("b200").aliases)} == get_chip("b200").fields()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('name = "x"\nbase = "h100"\nwarp_speed = 9\n', r"unknown field 'warp_speed'"),
        ('name = "x"\nkind = "gpu"\n', r"chip 'x' is missing .*peak_flops"),
        ('name = "x"\nbase = "h100"\nhbm_bandwidth = -1.0\n', r"hbm_bandwidth must be > 0"),
        ('name = "x"\nbase = "h100"\nkind = "fpga"\n', r"kind 'fpga' is not one of"),
        ('name = "x"\nbase = "nope"\n', r"unknown hardware 'nope'"),
        ('name = "x"\nbase = "h100"\n[peak_flops]\nbf17 = 1.0\n', r"unknown dtype 'bf17'"),
        ("name = [", r"is not valid TOML"),
    ],
)
def test_bad_hardware_files(tmp_path, text, match):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(UserError, match=match):
        load_hardware_file(f, Catalog())


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_hardware_file(tmp_path / "nope.toml")


def test_calibrated_host_spec_replaces_the_placeholder(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLAB_SPECS_DIR", str(tmp_path))
    assert not get_chip("cpu").calibrated
    (tmp_path / "cpu.json").write_text(
        json.dumps({"name": "cpu", "base": "cpu", "calibrated": True, "peak_flops": {"fp32": 1.23e11}})
    )
    chip = get_chip("cpu")
    assert chip.calibrated and chip.flops("fp32") == 1.23e11


def test_catalog_entries_are_immutable():
    chip = get_chip("h100")
    with pytest.raises(TypeError):
        chip.peak_flops["bf16"] = 1.0  # type: ignore[index]
    assert math.isclose(get_chip("h100").flops("bf16"), 9.89e14)


# Device kinds as JAX reports them (the CUDA device name; libtpu's name), with the memory bytes_limit where the
# kind alone leaves the part open.
@pytest.mark.parametrize(
    ("kind", "memory", "chip"),
    [
        ("NVIDIA H100 80GB HBM3", 79.1e9, "h100"),
        ("NVIDIA H100 PCIe", 79.1e9, "h100-pcie"),
        ("NVIDIA H200", 139.8e9, "h200"),
        ("NVIDIA B200", 178e9, "b200"),
        ("NVIDIA A100-SXM4-80GB", 79.1e9, "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", 39.4e9, "a100-40gb"),
        ("NVIDIA A100", 39.4e9, "a100-40gb"),
        ("NVIDIA A100", 79.1e9, "a100-80gb"),
        ("TPU v4", 32e9, "tpu-v4"),
        ("TPU v5 lite", 15.7e9, "tpu-v5e"),
        ("TPU v5", 95e9, "tpu-v5p"),
        ("TPU v6 lite", 31.2e9, "tpu-v6e"),
        ("TPU7x", 94e9, "tpu-v7x"),
        ("NVIDIA H800", 79.1e9, "h800"),
        ("NVIDIA GB200", 184e9, "gb200"),
        ("AMD Instinct MI300X", 191e9, "mi300x"),
    ],
)
def test_device_kinds_map_to_their_exact_chip(kind, memory, chip):
    from lab.run.environment import chip_for_device

    assert chip_for_device(kind, memory) == chip
    assert Catalog().get(chip).name == chip


@pytest.mark.parametrize("kind", ["NVIDIA H100 NVL", "NVIDIA GH200 480GB", "TPU v8", "NVIDIA A100-PCIE-40GB"])
def test_unknown_device_kinds_name_the_kind_and_the_way_out(kind):
    from lab.run.environment import chip_for_device

    with pytest.raises(UserError, match="--hardware NAME") as e:
        chip_for_device(kind, 80e9)
    assert repr(kind) in str(e.value) and "h100-pcie" in str(e.value)


def test_parts_of_a_measured_die_are_priced_with_its_figures_and_keep_their_own_links():
    from lab.predict import efficiency as eff

    # H800 / A800: the H100 / A100 die with NVLink cut to 200 GB/s one way; GB200: B200's die in a 72-GPU domain
    for part, die, link in (("h800", "h100", 2e11), ("a800", "a100-80gb", 2e11), ("gb200", "b200", 9e11)):
        p, d = get_chip(part), get_chip(die)
        assert eff.gemm_ceiling(p) == eff.gemm_ceiling(d) and eff.hbm_fraction(p) == eff.hbm_fraction(d)
        assert p.link_bandwidth == link
    assert get_chip("gb200").node_size == 72 and get_chip("h100-pcie") is not None
    assert eff.family(get_chip("h20")) == "gpu"  # a cut-down Hopper with no matmul measured: not H100's figures


def test_tpu7x_is_priced_per_chip_with_its_own_matmul_figure():
    from lab.predict import efficiency as eff

    c = get_chip("ironwood")
    assert c.name == "tpu-v7x" and c.flops("bf16") == 2.307e15 and c.hbm_bytes == 192 * 2**30
    assert eff.gemm_ceiling(c) == pytest.approx(956.4 / 1153.5, abs=1e-3)  # T4: one TensorCore's half of the chip
    assert eff.tile(c) == 256.0
    assert eff.gemm_ceiling(get_chip("v6e")) == pytest.approx(727.7 / 918, abs=1e-3)  # T8: v6e's own 8192^3
    assert eff.gemm_ceiling(get_chip("v5p")) == eff.gemm_ceiling(get_chip("v5e"))  # no v5p figure: v5e's carried


def test_a_mesh_node_reaches_one_link_per_peer_in_the_group():
    c = get_chip("mi300x")  # 7 Infinity Fabric links of 64 GB/s one way, one to each peer
    assert c.topology == "mesh" and c.node_size == 8
    assert [c.group_egress(d) for d in (2, 4, 8)] == [6.4e10, 3 * 6.4e10, 7 * 6.4e10]
    assert get_chip("h100").group_egress(2) == get_chip("h100").group_egress(8) == 4.5e11  # a switch: full egress


def test_a_mesh_needs_a_node_size_and_is_no_tpu_fabric(tmp_path):
    f = tmp_path / "m.toml"
    f.write_text('[chip]\nname = "my-amd"\nbase = "mi300x"\nnode_size = 0\n')
    with pytest.raises(UserError, match="node_size = 0 must be a positive integer"):
        load_hardware_file(f)
    f.write_text('[chip]\nname = "my-tpu"\nbase = "tpu-v5e"\ntopology = "mesh"\nnode_size = 8\n')
    with pytest.raises(UserError, match="priced on a torus"):
        load_hardware_file(f)


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("v5p-128", "--hardware tpu-v5p --chips 64"),
        ("v4-8", "--hardware tpu-v4 --chips 4"),
        ("v6e-256", "--chips 256"),
        ("tpu7x-128", "--hardware tpu-v7x --chips 64"),
    ],
)
def test_a_cloud_tpu_slice_name_is_refused_with_its_chip_and_count(name, hint):
    # accelerator types count TensorCores on v4 and v5p (two a chip), chips on v5e and v6e
    with pytest.raises(UserError, match=f"{name} is a slice: .*{hint}"):
        get_chip(name)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('name = "m"\nbase = "mi300x"\ntorus_dims = 2', "torus_dims describes a TPU torus; a mesh has node_size only"),
        ('name = "g"\nbase = "h100"\npod_shape = [4, 4]', "pod_shape describes a TPU torus; a switch has node_size"),
        ('name = "t"\nbase = "tpu-v7x"\nnode_size = 8', "node_size describes a switched node; a torus has pod_shape"),
        ('name = "c"\nbase = "cpu"\ntopology = "mesh"', "a mesh is a GPU node's fabric"),
    ],
)
def test_a_fabric_field_of_another_topology_is_refused(tmp_path, text, match):
    f = tmp_path / "chip.toml"
    f.write_text(text + "\n")
    with pytest.raises(UserError, match=match):
        load_hardware_file(f)


def test_a_slice_of_no_whole_chip_names_its_chip_without_a_count():
    with pytest.raises(UserError, match=r"v5p-3 names a slice of tpu-v5p, of no whole number of chips"):
        get_chip("v5p-3")


def test_a_file_chip_named_as_another_chips_alias_is_refused(tmp_path):
    # it would take the alias over silently: `v7x` would price an H100 copy
    f = tmp_path / "v7x.toml"
    f.write_text('[chip]\nname = "v7x"\nbase = "h100"\n')
    with pytest.raises(UserError, match="name 'v7x' is an alias of tpu-v7x"):
        load_hardware_file(f)
