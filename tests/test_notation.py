import math

import numpy as np
import pytest

from lab.core.errors import UserError
from lab.core.notation import Dim, ShardedArray, parse_array, parse_matmul, parse_mesh, parse_positive_int, parse_sizes


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("A[I_X,J]", "A[I_X, J]"),
        ("A[ I_X , J_Y ]", "A[I_X, J_Y]"),
        ("A[I_XY, J]", "A[I_XY, J]"),
        ("C[I, K]{U_X}", "C[I, K]{U_X}"),
        ("C[I, K_Y]{ U_XZ }", "C[I, K_Y]{U_XZ}"),
        ("W[D_{data,fsdp}, F_{tensor}]", "W[D_{data,fsdp}, F_{tensor}]"),
        ("In[B_X, D_Y]", "In[B_X, D_Y]"),
    ],
)
def test_parse_and_print_round_trip(text, canonical):
    arr = parse_array(text)
    assert str(arr) == canonical
    assert parse_array(str(arr)) == arr


def test_multi_axis_dims_are_major_first():
    arr = parse_array("A[I_XY, J_{data,model}]{U_Z}")
    assert arr.dims == (Dim("I", ("X", "Y")), Dim("J", ("data", "model")))
    assert arr.unreduced == ("Z",)
    assert arr.spec_entries() == (("X", "Y"), ("data", "model"))


def test_partition_specs():
    from jax.sharding import PartitionSpec as P

    assert parse_array("A[I_X, J]").to_partition_spec() == P("X", None)
    assert parse_array("A[I, J_YX]").to_partition_spec() == P(None, ("Y", "X"))
    assert parse_array("C[I, K_Y]{U_X}").to_partition_spec() == P(None, "Y", unreduced={"X"})


@pytest.mark.parametrize(
    ("text", "column", "expected"),
    [
        ("A[I_X,J * B[J,K_Y]", 9, "',' or ']'"),
        ("A[I_X,J] B[J,K_Y]", 10, "'*' between the two operands"),
        ("A[I_X,J] * [J,K_Y]", 12, "an array name"),
        ("A[I_,J] * B[J,K]", 5, "mesh axes after '_'"),
        ("A[] * B[J,K]", 3, "at least one dim"),
        ("A[I,J]{V_X} * B[J,K]", 8, "'U_'"),
        ("A[I,J] * B[J,K] -> ", 20, "an array name"),
        ("A[I,J] * B[J,K] extra", 17, "end of input"),
    ],
)
def test_malformed_notation_points_at_the_column(text, column, expected):
    with pytest.raises(UserError) as err:
        parse_matmul(text)
    msg = str(err.value)
    assert f"at column {column}:" in msg and expected in msg and "example:" in msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("A[I_X, J_X]", "mesh axis 'X' is used twice"),
        ("A[I_X, J]{U_X}", "mesh axis 'X' is used twice"),
        ("A[I, I]", "dim 'I' appears twice"),
    ],
)
def test_invalid_arrays(text, match):
    with pytest.raises(UserError, match=match):
        parse_array(text)


def test_matmul_parts():
    e = parse_matmul("In[B_X, D_Y] *_D W[D_Y, F] -> Out[B_X, F]{U_Y}")
    assert e.contract == ("D",)
    assert str(e.lhs) == "In[B_X, D_Y]" and str(e.out) == "Out[B_X, F]{U_Y}"
    assert parse_matmul("A[I,J] @ B[J,K]").rhs.name == "B"
    with pytest.raises(UserError, match="inputs must be reduced"):
        parse_matmul("A[I,J]{U_X} * B[J,K]")


def test_local_shape_and_divisibility():
    mesh = {"X": 2, "Y": 4}
    arr = parse_array("A[I_XY, J]")
    assert arr.local_shape(mesh, {"I": 56, "J": 11}) == (7, 11)
    assert arr.local_bytes(mesh, {"I": 56, "J": 11}, "bf16") == 7 * 11 * 2
    with pytest.raises(UserError, match=r"dim I=12 does not divide over XxY \(8 shards\); use a multiple of 8"):
        arr.local_shape(mesh, {"I": 12, "J": 11})
    with pytest.raises(UserError, match="no size for dim 'J'"):
        arr.local_shape(mesh, {"I": 56})
    with pytest.raises(UserError, match=r"mesh axis 'Y' is not in the mesh \(X=8\)"):
        arr.local_shape({"X": 8}, {"I": 56, "J": 11})


@pytest.mark.parametrize(("text", "expect"), [("X=2,Y=4", {"X": 2, "Y": 4}), (" data = 8 ", {"data": 8})])
def test_parse_mesh(text, expect):
    assert parse_mesh(text) == expect
    assert list(parse_mesh(text)) == list(expect)  # order is the mesh's major-to-minor order


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("X=0", "must be a positive integer"),
        ("X=-2", "is not a number"),
        ("X", "is not NAME=VALUE"),
        ("X=2,X=4", "'X' is given twice"),
        ("", "--mesh is empty"),
        ("2X=2", "not a valid name"),
    ],
)
def test_bad_mesh(text, match):
    with pytest.raises(UserError, match=match):
        parse_mesh(text)


def test_size_suffixes():
    assert parse_sizes("I=8k,J=2Mi,K=1e3") == {"I": 8000, "J": 2 * 1024**2, "K": 1000}
    with pytest.raises(UserError, match="must be a positive integer"):
        parse_positive_int("1.5", "--b")


def _block_index(arr: ShardedArray, dim: int, coords: dict[str, int], mesh: dict[str, int]) -> int:
    """Which block of ``dim`` the device at ``coords`` holds: axes are major-first (row-major)."""
    idx = 0
    for a in arr.dims[dim].axes:
        idx = idx * mesh[a] + coords[a]
    return idx


MESHES = [{"X": 8}, {"X": 2, "Y": 4}, {"X": 4, "Y": 2}, {"X": 2, "Y": 2, "Z": 2}]
ARRAYS = [
    "A[I_X, J]",
    "A[I, J_X]",
    "A[I_XY, J]",
    "A[I_YX, J]",
    "A[I_X, J_Y]",
    "A[I_Y, J_X]",
    "A[I_XYZ, J]",
    "A[I_Z, J_XY]",
    "A[I, J]",
]


PLACEMENTS = [
    pytest.param(m, t, id=f"{'x'.join(map(str, m.values()))}-{t}")
    for m in MESHES
    for t in ARRAYS
    if set(parse_array(t).mesh_axes()) <= set(m)
]


@pytest.mark.parametrize(("mesh", "text"), PLACEMENTS)
def test_jax_places_each_shard_where_the_notation_says(jax_devices, mesh, text):
    from kernels.mesh import make_mesh, place_zeros, sharding_for

    arr = parse_array(text)
    sizes = {"I": 7 * 8, "J": 11 * 8}
    m = make_mesh(mesh)
    x = place_zeros(arr, sizes, m)
    want = arr.local_shape(mesh, sizes)
    device_coords = {d.id: dict(zip(mesh, np.argwhere(m.devices == d)[0], strict=True)) for d in m.devices.flat}
    for shard in x.addressable_shards:
        assert shard.data.shape == want
        coords = device_coords[shard.device.id]
        for dim, sl in enumerate(shard.index):
            start = sl.start or 0
            assert start == _block_index(arr, dim, coords, mesh) * want[dim], (text, coords, shard.index)
    assert sharding_for(arr, m).shard_shape(tuple(sizes[d] for d in arr.dim_names)) == want
    assert math.prod(want) * math.prod(mesh[a] for a in arr.mesh_axes()) == math.prod(sizes.values())
