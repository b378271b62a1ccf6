"""The kernel registry on 8 emulated CPU devices: numerics per shard, output shardings, HLO and errors.

Every (kernel, mesh, axes) is lowered and compiled once (``_run`` is cached for the session); the compiled
executable is both run and read as HLO text. Sizes are prime-ish multiples of 8 so that a transposed or
mis-sharded dim fails at once, and tolerances are fixed.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

from lab.core.errors import UserError

MESHES = {
    "X8": {"X": 8, "Y": 1},  # a mesh without Y, given Y of size 1
    "X2Y4": {"X": 2, "Y": 4},
    "X4Y2": {"X": 4, "Y": 2},
    "X2Y2Z2": {"X": 2, "Y": 2, "Z": 2},
    "Y8": {"X": 1, "Y": 8},  # the longest ring for the collective matmuls
}
SIZES = {"I": 7 * 8, "J": 11 * 8, "K": 13 * 8}
N = 3 * 8  # collective elements per device: divides by every group size below
COLLECTIVE_AXES = {
    "X8": [("X",), ("Y",)],  # ("Y",) is a group of one
    "X2Y4": [("X",), ("Y",), ("X", "Y")],
    "X4Y2": [("Y", "X")],  # group order other than mesh order
    "X2Y2Z2": [("X", "Z"), ("Z",), ("Z", "X"), None],  # None: every mesh axis
    "Y8": [("Y",)],
}
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "permute")

MATMUL_RTOL, MATMUL_ATOL = 1e-5, 1e-4  # fp32, contraction length 88
COLL_RTOL, COLL_ATOL = 1e-5, 1e-5  # fp32 sums of at most 8 terms
CM_RTOL, CM_ATOL = 1e-5, 1e-5  # collective matmul vs its blocking version
BF16_RTOL, BF16_ATOL = 2e-2, 1e-1  # bf16 operands, outputs of magnitude ~10

MATMUL_NAMES = [
    "sharded_matmul_case1",
    "sharded_matmul_case2",
    "sharded_matmul_case3",
    "sharded_matmul_case3_scatter",
    "sharded_matmul_case4",
    "sharded_matmul_case1_named",
    "sharded_matmul_case2_named",
    "sharded_matmul_case3_named",
    "sharded_matmul_case3_scatter_named",
    "sharded_matmul_case4_named",
    "collective_matmul_allgather",
    "collective_matmul_allgather_bidir",
    "matmul_allgather_blocking",
    "collective_matmul_reducescatter",
    "collective_matmul_reducescatter_bidir",
    "matmul_reducescatter_blocking",
]
PAIRS = [  # (collective version, blocking version, the blocking collective)
    ("collective_matmul_allgather", "matmul_allgather_blocking", "all-gather"),
    ("collective_matmul_allgather_bidir", "matmul_allgather_blocking", "all-gather"),
    ("collective_matmul_reducescatter", "matmul_reducescatter_blocking", "reduce-scatter"),
    ("collective_matmul_reducescatter_bidir", "matmul_reducescatter_blocking", "reduce-scatter"),
]
# The op name after its result type (which may be a tuple with spaces), as in "= f32[3]{0} all-gather(".
HLO_COLLECTIVE = re.compile(r" (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


@functools.cache
def _mesh(mesh_id: str):
    from kernels.mesh import make_mesh

    return make_mesh(MESHES[mesh_id])


@functools.cache
def _run(name: str, mesh_id: str, axes: tuple[str, ...] | None = None, dtype: str = "float32"):
    """``(built, output, hlo_text)`` for one kernel on one mesh, compiled once."""
    from kernels.registry import get_kernel

    kernel = get_kernel(name)
    sizes = {"N": N} if kernel.family == "collective" else SIZES
    built = kernel.build(_mesh(mesh_id), sizes, dtype=dtype, axes=axes)
    compiled = built.fn.lower(*built.args).compile()
    out = compiled(*built.args)
    return built, out, compiled.as_text()


@pytest.fixture(scope="module")
def run(jax_devices):
    return _run


def hlo_collectives(hlo: str) -> list[str]:
    return HLO_COLLECTIVE.findall(hlo)


def assert_matches_per_shard(out, ref: np.ndarray, rtol: float, atol: float) -> None:
    """The gathered output and every addressable shard (at its index) equal the reference."""
    assert out.shape == ref.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=rtol, atol=atol)
    for shard in out.addressable_shards:
        np.testing.assert_allclose(
            np.asarray(shard.data, np.float32), np.asarray(ref[shard.index], np.float32), rtol=rtol, atol=atol
        )


def assert_sharding(out, spec, local_shape: tuple[int, ...]) -> None:
    from jax.sharding import NamedSharding

    assert out.sharding.shard_shape(out.shape) == local_shape
    assert out.sharding.is_equivalent_to(NamedSharding(out.sharding.mesh, spec), out.ndim), (out.sharding, spec)


# ----- the registry ----------------------------------------------------------------------------------------------


def test_registry_lists_every_kernel_once(jax_devices):
    from kernels.registry import KERNELS
    from lab.core.notation import parse_matmul

    collectives = [f"collective_{k}" for k in COLLECTIVE_KINDS]
    assert sorted(KERNELS) == sorted([*MATMUL_NAMES, *collectives, "tp_mlp"])
    for name, k in KERNELS.items():
        assert k.name == name and k.description
        if name == "tp_mlp":
            assert (k.family, k.dims) == ("block", ("B", "D", "F"))
        elif name in collectives:
            assert (k.family, k.dims, k.notation) == ("collective", ("N",), None)
        else:
            assert k.family == ("sharded_matmul" if name.startswith("sharded_matmul") else "collective_matmul")
            assert k.dims == ("I", "J", "K")
            assert parse_matmul(k.notation).out is not None, name


def test_inputs_are_deterministic(jax_devices):
    from kernels.registry import get_kernel

    k = get_kernel("sharded_matmul_case1")
    a = k.build(_mesh("X2Y4"), SIZES)
    b = k.build(_mesh("X2Y4"), SIZES)
    c = k.build(_mesh("X2Y4"), SIZES, seed=1)
    for x, y, z in zip(a.host_args, b.host_args, c.host_args, strict=True):
        assert x.dtype == np.float32
        np.testing.assert_array_equal(x, y)
        assert not np.array_equal(x, z)
    np.testing.assert_array_equal(np.asarray(a.args[0]), a.host_args[0])


# ----- numerics and output shardings --------------------------------------------------------------------------


@pytest.mark.parametrize("name", MATMUL_NAMES)
@pytest.mark.parametrize("mesh_id", list(MESHES))
def test_matmul_kernel_matches_reference(run, mesh_id, name):
    from kernels.registry import get_kernel
    from lab.core.notation import parse_matmul

    built, out, _ = run(name, mesh_id)
    ref = built.reference(*built.host_args)
    assert out.dtype == np.float32
    assert_matches_per_shard(out, ref, MATMUL_RTOL, MATMUL_ATOL)
    expected = parse_matmul(get_kernel(name).notation).out
    assert_sharding(out, expected.to_partition_spec(), expected.local_shape(MESHES[mesh_id], SIZES))


@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
@pytest.mark.parametrize(
    ("mesh_id", "axes"), [(m, a) for m, subsets in COLLECTIVE_AXES.items() for a in subsets], ids=str
)
def test_collective_kernel_matches_reference(run, mesh_id, axes, kind):
    from kernels import collectives as coll
    from kernels.registry import get_kernel, output_spec

    name = f"collective_{kind}"
    built, out, hlo = run(name, mesh_id, axes)
    ref = built.reference(*built.host_args)
    assert_matches_per_shard(out, ref, COLL_RTOL, COLL_ATOL)
    mesh = _mesh(mesh_id)
    g = coll.group_size(mesh, coll.check_axes(mesh, axes))
    per_device = {"all_gather": g * N, "reduce_scatter": N // g}.get(kind, N)
    assert_sharding(out, output_spec(get_kernel(name), mesh, axes), (per_device,))
    if g > 1:  # the one collective, spelled the HLO way
        expected = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce"}
        kinds = hlo_collectives(hlo)
        assert kinds == [expected.get(kind, {"all_to_all": "all-to-all", "permute": "collective-permute"}.get(kind))]


# ----- HLO: the predicted collectives, and collective matmuls free of blocking collectives -----------------------


@pytest.mark.parametrize(
    "name",
    [n for n in MATMUL_NAMES if n.startswith("sharded_matmul") and not n.endswith("_named")]
    + ["matmul_allgather_blocking", "matmul_reducescatter_blocking"],
)
@pytest.mark.parametrize("mesh_id", ["X2Y4", "X4Y2", "X2Y2Z2"])
def test_shard_map_hlo_has_the_planned_collectives(run, mesh_id, name):
    """The manual kernels emit exactly the collectives :func:`plan_sharded_matmul` names, over groups of its size."""
    from kernels.registry import get_kernel
    from lab.core.hardware import get_chip
    from lab.predict.program.sharded_matmul import plan_sharded_matmul

    mesh = MESHES[mesh_id]
    # The collectives a plan names do not depend on the chip or dtype (v5e has no fp32 peak, so price bf16).
    plan = plan_sharded_matmul(get_kernel(name).notation, SIZES, mesh, get_chip("v5e"), "bf16")
    _, _, hlo = run(name, mesh_id)
    assert hlo_collectives(hlo) == [c.kind for c in plan.collectives]
    groups = re.findall(r"replica_groups=\{\{([0-9,]+)\}", hlo)
    assert [len(g.split(",")) for g in groups] == [int(np.prod([mesh[a] for a in c.axes])) for c in plan.collectives]


@pytest.mark.parametrize("mesh_id", list(MESHES))
def test_named_case1_needs_no_communication(run, mesh_id):
    _, _, hlo = run("sharded_matmul_case1_named", mesh_id)
    assert hlo_collectives(hlo) == []


@pytest.mark.parametrize(("name", "blocking", "blocking_op"), PAIRS)
@pytest.mark.parametrize("mesh_id", ["X2Y4", "X4Y2", "X2Y2Z2", "Y8"])
def test_collective_matmul_equals_blocking_and_only_permutes(run, mesh_id, name, blocking, blocking_op):
    _, out, hlo = run(name, mesh_id)
    _, out_blocking, hlo_blocking = run(blocking, mesh_id)
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_blocking), rtol=CM_RTOL, atol=CM_ATOL)
    assert out.sharding.is_equivalent_to(out_blocking.sharding, out.ndim)

    n = MESHES[mesh_id]["Y"]
    kinds = hlo_collectives(hlo)
    assert "all-gather" not in kinds and "reduce-scatter" not in kinds and "all-reduce" not in kinds
    assert kinds == ["collective-permute"] * (n - 1)  # one chunk per ring step and direction
    assert hlo_collectives(hlo_blocking) == [blocking_op]
    if name.endswith("_bidir") and n > 2:  # both ring directions are used
        pairs = {p for p in re.findall(r"source_target_pairs=\{([0-9,{}]+)\}", hlo)}
        assert len(pairs) == 2


# ----- explicit mode fails loudly where the book says the product is ambiguous or invalid ------------------------


def test_explicit_mode_refuses_ambiguous_and_invalid_products(jax_devices):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kernels.sharded_matmul import explicit_mesh

    mesh = explicit_mesh(_mesh("X2Y4"))

    def arg(shape, spec):
        return jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec))

    a, b = (SIZES["I"], SIZES["J"]), (SIZES["J"], SIZES["K"])
    product = jax.jit(lambda x, y: x @ y)
    with pytest.raises(Exception, match="ambiguous how the output should be sharded"):  # case 3
        product.lower(arg(a, P(None, "X")), arg(b, P("X", None)))
    with pytest.raises(Exception, match="illegally sharded result"):  # case 4
        product.lower(arg(a, P("X", None)), arg(b, P(None, "X")))


# ----- bf16 ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "axes"), [("sharded_matmul_case3", None), ("collective_all_reduce", ("X", "Y"))])
def test_bf16_inputs_give_bf16_outputs(run, name, axes):
    import jax.numpy as jnp

    built, out, _ = run(name, "X2Y4", axes, "bf16")
    assert built.host_args[0].dtype == jnp.bfloat16 and out.dtype == jnp.bfloat16
    assert_matches_per_shard(out, built.reference(*built.host_args), BF16_RTOL, BF16_ATOL)


# ----- user errors -------------------------------------------------------------------------------------------------


def test_size_that_does_not_divide_raises_user_error(jax_devices):
    from kernels.registry import get_kernel

    with pytest.raises(UserError, match=r"I=57 does not divide over X \(2 shards\)"):
        get_kernel("sharded_matmul_case1").build(_mesh("X2Y4"), {**SIZES, "I": 57})
    with pytest.raises(UserError, match=r"K=102 does not divide over Y \(4 shards\)"):
        get_kernel("collective_matmul_allgather").build(_mesh("X2Y4"), {**SIZES, "K": 102})
    with pytest.raises(UserError, match=r"N=25 does not divide over XxY \(8 devices\)"):
        get_kernel("collective_reduce_scatter").build(_mesh("X2Y4"), {"N": 25})
    with pytest.raises(UserError, match="no size for dim 'K'"):
        get_kernel("sharded_matmul_case2").build(_mesh("X2Y4"), {"I": 8, "J": 8})


def test_bad_mesh_axes_raise_user_error(jax_devices):
    from kernels.mesh import make_mesh
    from kernels.registry import get_kernel

    with pytest.raises(UserError, match=r'"Y": 1'):
        get_kernel("sharded_matmul_case1").build(make_mesh({"X": 8}), SIZES)
    with pytest.raises(UserError, match="mesh axis 'W' is not in the mesh; valid: X, Y"):
        get_kernel("collective_all_gather").build(_mesh("X2Y4"), {"N": N}, axes=("W",))


def test_unknown_kernel_raises_user_error():
    from kernels.registry import get_kernel

    with pytest.raises(UserError, match=r"unknown kernel 'nope'; valid: sharded_matmul_case1, "):
        get_kernel("nope")


@pytest.mark.parametrize(
    "mesh",
    [{"X": 8, "Y": 1}, {"X": 2, "Y": 4}, {"X": 4, "Y": 2}, {"X": 2, "Y": 2, "Z": 2}],
    ids=lambda m: "x".join(map(str, m.values())),
)
def test_tp_mlp_block_matches_reference(jax_devices, mesh):
    from kernels.mesh import make_mesh
    from kernels.registry import get_kernel

    built = get_kernel("tp_mlp").build(make_mesh(mesh), {"B": 7 * 8, "D": 11 * 8, "F": 13 * 8})
    out = built.fn(*built.args)
    np.testing.assert_allclose(np.asarray(out), built.reference(*built.host_args), rtol=1e-5, atol=1e-4)
