"""One registry of the lab's kernels: build any of them on a mesh, with inputs and a reference answer.

``get_kernel(name).build(mesh, sizes)`` checks the sizes against the mesh (a :class:`lab.core.errors.UserError`
naming the dim, its size and the divisor, before anything compiles), makes deterministic inputs, places them
with their shardings and returns a :class:`Built`: ``built.fn(*built.args)`` runs the kernel and
``built.reference(*built.host_args)`` is the single-device answer.

Matmul kernels look mesh axes up by name, ``X`` and ``Y``; give a mesh without Y as ``{"X": 8, "Y": 1}``.
Collective kernels run over ``axes`` (default: every mesh axis) and take ``N``, the elements per device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels import blocks
from kernels import collective_matmul as cm
from kernels import collectives as coll
from kernels import sharded_matmul as sm
from lab.core.errors import UserError
from lab.core.notation import parse_matmul


@dataclass(frozen=True)
class Built:
    """A kernel ready to run.

    Attributes:
        fn: jitted; call ``fn(*args)``.
        args: device arrays placed with their shardings.
        host_args: the same inputs as numpy arrays.
        reference: ``reference(*host_args) -> np.ndarray``, a plain single-device computation.
    """

    fn: Callable
    args: tuple
    host_args: tuple
    reference: Callable


@dataclass(frozen=True)
class Kernel:
    """One registered kernel.

    Attributes:
        name: registry key, e.g. ``sharded_matmul_case3_scatter``.
        family: ``sharded_matmul``, ``collective_matmul`` or ``collective``.
        description: one line.
        notation: the book notation with output for matmul kernels, else None.
        dims: size names ``build`` needs, e.g. ``("I", "J", "K")``; collectives take ``("N",)``.
        build: ``build(mesh, sizes, dtype=np.float32, axes=None, *, seed=0) -> Built``.
    """

    name: str
    family: str
    description: str
    notation: str | None
    dims: tuple[str, ...]
    build: Callable[..., Built]


_DTYPES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16", "f16": "float16"}


def _dtype(dtype) -> np.dtype:
    """A numpy dtype from ``np.float32``, ``jnp.bfloat16``, ``"bf16"``, ``"float32"``..."""
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype.lower(), dtype)
    try:
        return jnp.dtype(dtype)
    except TypeError:
        raise UserError(f"unknown dtype {dtype!r}; use float32 (fp32) or bfloat16 (bf16)") from None


def _inputs(shapes: list[tuple[int, ...]], dtype: np.dtype, seed: int) -> tuple[np.ndarray, ...]:
    """Standard-normal inputs, drawn in float32 from one seeded generator, then cast."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape, dtype=np.float32).astype(dtype) for shape in shapes)


def _check_sizes(name: str, sizes: Mapping[str, int], dims: tuple[str, ...]) -> None:
    for d in dims:
        if d not in sizes:
            raise UserError(f"{name}: no size for dim {d!r}; give {', '.join(f'{x}=<n>' for x in dims)}")
        v = sizes[d]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise UserError(f"{name}: dim {d}={v!r} must be a positive integer")


# ----- matmul kernels --------------------------------------------------------------------------------------------


def _build_matmul(
    name: str,
    notation: str,
    make: Callable[[Mesh], Callable],
    explicit: bool,
    mesh: Mesh,
    sizes: Mapping[str, int],
    dtype=np.float32,
    axes: tuple[str, ...] | None = None,
    *,
    seed: int = 0,
) -> Built:
    del axes  # matmul kernels always use X and Y
    missing = [a for a in (sm.X, sm.Y) if a not in mesh.axis_names]
    if missing:
        raise UserError(
            f"{name} needs mesh axes X and Y; the mesh has {', '.join(mesh.axis_names)}. "
            f'Give a missing axis size 1, e.g. {{"X": 8, "Y": 1}}'
        )
    _check_sizes(name, sizes, ("I", "J", "K"))
    expr = parse_matmul(notation)
    shape = dict(mesh.shape)
    for arr in (expr.lhs, expr.rhs, expr.out):
        arr.check(shape, sizes)  # UserError naming dim, size and shard count
    dtype = _dtype(dtype)
    host = _inputs([tuple(sizes[d] for d in arr.dim_names) for arr in (expr.lhs, expr.rhs)], dtype, seed)
    if explicit:
        mesh = sm.explicit_mesh(mesh)
    args = tuple(
        jax.device_put(x, NamedSharding(mesh, arr.to_partition_spec()))
        for x, arr in zip(host, (expr.lhs, expr.rhs), strict=True)
    )
    return Built(fn=make(mesh), args=args, host_args=host, reference=sm.reference_matmul)


_MATMULS: list[tuple[str, str, str, Callable[[Mesh], Callable], bool, str]] = [
    # (name, family, notation, builder, explicit mode, description)
    (
        "sharded_matmul_case1",
        "sharded_matmul",
        "A[I_X, J] * B[J, K_Y] -> C[I_X, K_Y]",
        sm.case1,
        False,
        "case 1, shard_map: no contracting dim sharded, no communication",
    ),
    (
        "sharded_matmul_case2",
        "sharded_matmul",
        "A[I, J_X] * B[J, K] -> C[I, K]",
        sm.case2,
        False,
        "case 2, shard_map: AllGather_X A, then a local matmul",
    ),
    (
        "sharded_matmul_case3",
        "sharded_matmul",
        "A[I, J_X] * B[J_X, K] -> C[I, K]",
        sm.case3,
        False,
        "case 3, shard_map: local matmul, then AllReduce_X",
    ),
    (
        "sharded_matmul_case3_scatter",
        "sharded_matmul",
        "A[I, J_X] * B[J_X, K] -> C[I, K_X]",
        sm.case3_scatter,
        False,
        "case 3, shard_map: local matmul, then ReduceScatter_X onto K",
    ),
    (
        "sharded_matmul_case4",
        "sharded_matmul",
        "A[I_X, J] * B[J, K_X] -> C[I, K_X]",
        sm.case4,
        False,
        "case 4, shard_map: AllGather_X A, then a local matmul",
    ),
    (
        "sharded_matmul_case1_named",
        "sharded_matmul",
        "A[I_X, J] * B[J, K_Y] -> C[I_X, K_Y]",
        sm.case1_named,
        True,
        "case 1, explicit-mode NamedSharding: the type rule gives C[I_X, K_Y]",
    ),
    (
        "sharded_matmul_case2_named",
        "sharded_matmul",
        "A[I, J_X] * B[J, K] -> C[I, K]",
        sm.case2_named,
        True,
        "case 2, explicit-mode NamedSharding: XLA chooses the communication",
    ),
    (
        "sharded_matmul_case3_named",
        "sharded_matmul",
        "A[I, J_X] * B[J_X, K] -> C[I, K]",
        sm.case3_named,
        True,
        "case 3, explicit-mode NamedSharding: out_sharding=C[I, K] (AllReduce)",
    ),
    (
        "sharded_matmul_case3_scatter_named",
        "sharded_matmul",
        "A[I, J_X] * B[J_X, K] -> C[I, K_X]",
        sm.case3_scatter_named,
        True,
        "case 3, explicit-mode NamedSharding: out_sharding=C[I, K_X] (ReduceScatter)",
    ),
    (
        "sharded_matmul_case4_named",
        "sharded_matmul",
        "A[I_X, J] * B[J, K_X] -> C[I, K_X]",
        sm.case4_named,
        True,
        "case 4, explicit-mode NamedSharding: reshard A to A[I, J], then multiply",
    ),
    (
        "collective_matmul_allgather",
        "collective_matmul",
        "A[I_X, J_Y] * W[J, K_Y] -> Out[I_X, K_Y]",
        cm.collective_matmul_allgather,
        False,
        "AllGather_Y of the lhs overlapped with the matmul: Y-1 ppermute ring steps",
    ),
    (
        "collective_matmul_allgather_bidir",
        "collective_matmul",
        "A[I_X, J_Y] * W[J, K_Y] -> Out[I_X, K_Y]",
        cm.collective_matmul_allgather_bidir,
        False,
        "AllGather_Y-matmul, chunks both ways round the ring: Y//2 steps",
    ),
    (
        "matmul_allgather_blocking",
        "collective_matmul",
        "A[I_X, J_Y] * W[J, K_Y] -> Out[I_X, K_Y]",
        cm.matmul_allgather_blocking,
        False,
        "AllGather_Y of the lhs, then one matmul (the blocking baseline)",
    ),
    (
        "collective_matmul_reducescatter",
        "collective_matmul",
        "A[I, J_Y] * W[J_Y, K] -> Out[I, K_Y]",
        cm.collective_matmul_reducescatter,
        False,
        "matmul overlapped with ReduceScatter_Y: partial sums ppermuted round the ring, Y-1 steps",
    ),
    (
        "collective_matmul_reducescatter_bidir",
        "collective_matmul",
        "A[I, J_Y] * W[J_Y, K] -> Out[I, K_Y]",
        cm.collective_matmul_reducescatter_bidir,
        False,
        "matmul-ReduceScatter_Y, partial sums both ways round the ring: Y//2 steps",
    ),
    (
        "matmul_reducescatter_blocking",
        "collective_matmul",
        "A[I, J_Y] * W[J_Y, K] -> Out[I, K_Y]",
        cm.matmul_reducescatter_blocking,
        False,
        "local matmul, then ReduceScatter_Y (the blocking baseline)",
    ),
]


# ----- collective microkernels -------------------------------------------------------------------------------------


def _build_collective(
    name: str,
    kind: str,
    mesh: Mesh,
    sizes: Mapping[str, int],
    dtype=np.float32,
    axes: tuple[str, ...] | None = None,
    *,
    seed: int = 0,
) -> Built:
    axes = coll.check_axes(mesh, axes)
    _check_sizes(name, sizes, ("N",))
    n = int(sizes["N"])
    g = coll.group_size(mesh, axes)
    r = coll.group_size(mesh, coll.rest_axes(mesh, axes))
    if kind in ("reduce_scatter", "all_to_all") and n % g:
        raise UserError(f"{name}: dim N={n} does not divide over {'x'.join(axes)} ({g} devices); use a multiple of {g}")
    dtype = _dtype(dtype)
    in_len, in_spec, _, _ = coll.layout(kind, mesh, axes, n)
    (host,) = _inputs([(in_len,)], dtype, seed)
    arg = jax.device_put(host, NamedSharding(mesh, in_spec))
    return Built(
        fn=coll.collective(kind, mesh, axes),
        args=(arg,),
        host_args=(host,),
        reference=partial(coll.reference, kind, r=r, g=g),
    )


_COLLECTIVES = {
    "all_gather": "AllGather over the axes: [N] per device in, [G*N] out",
    "reduce_scatter": "ReduceScatter over the axes: [N] per device in, [N/G] out",
    "all_reduce": "AllReduce (psum) over the axes: [N] per device in, [N] out",
    "all_to_all": "AllToAll over the axes: [N] per device in, [N] out, N/G to each member",
    "permute": "ring shift by one over the axes: [N] per device in, [N] out",
}


def _build_block(
    name: str,
    mesh: Mesh,
    sizes: Mapping[str, int],
    dtype=np.float32,
    axes: tuple[str, ...] | None = None,
    *,
    seed: int = 0,
) -> Built:
    del axes
    missing = [a for a in (blocks.X, blocks.Y) if a not in mesh.axis_names]
    if missing:
        raise UserError(f'{name} needs mesh axes X and Y; give a missing axis size 1, e.g. {{"X": 8, "Y": 1}}')
    _check_sizes(name, sizes, ("B", "D", "F"))
    shape = dict(mesh.shape)
    for part in blocks.TP_MLP_NOTATION.split(";"):
        expr = parse_matmul(part)
        for arr in (expr.lhs, expr.rhs, expr.out):
            arr.check(shape, sizes)
    dtype = _dtype(dtype)
    b, d, f = sizes["B"], sizes["D"], sizes["F"]
    host = _inputs([(b, d), (d, f), (f, d)], dtype, seed)
    args = tuple(
        jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip(host, blocks.TP_MLP_SPECS, strict=True)
    )
    return Built(fn=blocks.tp_mlp(mesh), args=args, host_args=host, reference=blocks.reference_tp_mlp)


def _registry() -> dict[str, Kernel]:
    out: dict[str, Kernel] = {}
    for name, family, notation, make, explicit, description in _MATMULS:
        out[name] = Kernel(
            name=name,
            family=family,
            description=description,
            notation=notation,
            dims=("I", "J", "K"),
            build=partial(_build_matmul, name, notation, make, explicit),
        )
    for kind, description in _COLLECTIVES.items():
        name = f"collective_{kind}"
        out[name] = Kernel(
            name=name,
            family="collective",
            description=description,
            notation=None,
            dims=("N",),
            build=partial(_build_collective, name, kind),
        )
    out["tp_mlp"] = Kernel(
        name="tp_mlp",
        family="block",
        description="Megatron MLP block: column-parallel up, GeLU, row-parallel down, AllReduce_Y",
        notation=blocks.TP_MLP_NOTATION,
        dims=("B", "D", "F"),
        build=partial(_build_block, "tp_mlp"),
    )
    return out


KERNELS: dict[str, Kernel] = _registry()


def get_kernel(name: str) -> Kernel:
    """The registered kernel ``name``; a :class:`UserError` listing the valid names otherwise."""
    try:
        return KERNELS[name]
    except KeyError:
        raise UserError(f"unknown kernel {name!r}; valid: {', '.join(KERNELS)}") from None


def output_spec(kernel: Kernel, mesh: Mesh, axes: tuple[str, ...] | None = None) -> P:
    """The ``PartitionSpec`` a kernel's output has: the notation's output, or the collective's layout."""
    if kernel.family == "block":
        return blocks.TP_MLP_OUT
    if kernel.notation is not None:
        return parse_matmul(kernel.notation).out.to_partition_spec()
    kind = kernel.name.removeprefix("collective_")
    return coll.layout(kind, mesh, coll.check_axes(mesh, axes), 1)[3]


__all__ = ["KERNELS", "Built", "Kernel", "get_kernel", "output_spec"]
