"""One registry of everything the lab runs: every program of :mod:`lab.core.programs` with its builder.

:func:`build` is the one path from a :class:`lab.core.plan.Plan` to a runnable program (a kernel, the MLP block,
the Transformer's train step or decode). It returns a :class:`kernels.program.Built`: ``built.fn`` lowers with
``built.abstract`` (``ShapeDtypeStruct`` s with shardings: nothing allocated), ``built.args`` places real inputs
when first read, and ``built.reference(*built.host_args)`` is the single-device answer of a kernel.

``get_kernel(name).build(mesh, sizes)`` builds a kernel on a JAX mesh directly: it checks the sizes against
the mesh (a :class:`lab.core.errors.UserError` naming the dim, its size and the divisor, before anything
compiles). Matmul kernels look mesh axes up by name, ``X`` and ``Y``; give a mesh without Y as
``{"X": 8, "Y": 1}``. Collective kernels run over ``axes`` (default: every mesh axis) and take ``N``, the
elements per device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels import blocks, moe
from kernels import collective_matmul as cm
from kernels import collectives as coll
from kernels import pipeline as pp
from kernels import pipeline_circular as pcirc
from kernels import ring_attention as ra
from kernels import sharded_matmul as sm
from kernels.mesh import make_mesh
from kernels.program import Built
from lab.core.errors import UserError
from lab.core.notation import parse_matmul
from lab.core.plan import Plan
from lab.core.programs import PROGRAMS, ProgramSpec
from lab.core.units import numpy_name


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


def _dtype(dtype) -> np.dtype:
    """A numpy dtype from ``np.float32``, ``jnp.bfloat16``, ``"bf16"``, ``"float32"``..."""
    if isinstance(dtype, str):
        with contextlib.suppress(UserError):  # a spelling the lab does not know: jnp.dtype's to take or refuse below
            dtype = numpy_name(dtype)
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


def _placed(
    fn: Callable, shapes: list[tuple[int, ...]], shardings: list, dtype: np.dtype, seed: int, reference
) -> Built:
    """A kernel whose inputs are standard-normal host arrays placed with ``shardings`` when first needed."""
    spec = tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=sh) for shape, sh in zip(shapes, shardings, strict=True))

    def host():
        return _inputs(shapes, dtype, seed)

    def place():
        return tuple(jax.device_put(x, sh) for x, sh in zip(host(), shardings, strict=True))

    return Built(fn, spec, place, host_args=host, reference=reference)


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
    if explicit:
        mesh = sm.explicit_mesh(mesh)
    operands = (expr.lhs, expr.rhs)
    shapes = [tuple(sizes[d] for d in arr.dim_names) for arr in operands]
    shardings = [NamedSharding(mesh, arr.to_partition_spec()) for arr in operands]
    return _placed(make(mesh), shapes, shardings, _dtype(dtype), seed, sm.reference_matmul)


# The builder of each matmul program of lab.core.programs (its notation and description live there).
_MATMULS: dict[str, Callable[[Mesh], Callable]] = {
    "sharded_matmul_case1": sm.case1,
    "sharded_matmul_case2": sm.case2,
    "sharded_matmul_case3": sm.case3,
    "sharded_matmul_case3_scatter": sm.case3_scatter,
    "sharded_matmul_case4": sm.case4,
    "sharded_matmul_case1_named": sm.case1_named,
    "sharded_matmul_case2_named": sm.case2_named,
    "sharded_matmul_case3_named": sm.case3_named,
    "sharded_matmul_case3_scatter_named": sm.case3_scatter_named,
    "sharded_matmul_case4_named": sm.case4_named,
    "collective_matmul_allgather": cm.collective_matmul_allgather,
    "collective_matmul_allgather_bidir": cm.collective_matmul_allgather_bidir,
    "matmul_allgather_blocking": cm.matmul_allgather_blocking,
    "collective_matmul_reducescatter": cm.collective_matmul_reducescatter,
    "collective_matmul_reducescatter_bidir": cm.collective_matmul_reducescatter_bidir,
    "matmul_reducescatter_blocking": cm.matmul_reducescatter_blocking,
}


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
    in_len, in_spec, _, _ = coll.layout(kind, mesh, axes, n)
    reference = partial(coll.reference, kind, r=r, g=g)
    return _placed(
        coll.collective(kind, mesh, axes), [(in_len,)], [NamedSharding(mesh, in_spec)], _dtype(dtype), seed, reference
    )


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
    b, d, f = sizes["B"], sizes["D"], sizes["F"]
    shardings = [NamedSharding(mesh, spec) for spec in blocks.TP_MLP_SPECS]
    return _placed(
        blocks.tp_mlp(mesh), [(b, d), (d, f), (f, d)], shardings, _dtype(dtype), seed, blocks.reference_tp_mlp
    )


def _attention(mesh: Mesh, sizes: Mapping[str, int], dtype: np.dtype, seed: int) -> Built:
    """Ring attention: q, k, v standard-normal ``[B, T, H, D]``, T over ``context``, B over ``data``."""
    ra.check_mesh(mesh, sizes)  # UserError naming T or B and a size that divides, before anything compiles
    shape = tuple(int(sizes[d]) for d in ("B", "T", "H", "D"))
    sharding = NamedSharding(mesh, ra.qkv_spec(mesh))
    return _placed(ra.ring_attention(mesh), [shape] * 3, [sharding] * 3, dtype, seed, ra.reference_attention)


def _moe(mesh: Mesh, sizes: Mapping[str, int], dtype: np.dtype, seed: int) -> Built:
    """The MoE MLP: x ``[T, D]``, router ``[D, E]``, expert weights ``[E, D, F]`` and ``[E, F, D]``, standard-normal;
    T over ``data`` x ``expert``, E over ``expert``."""
    moe.check_mesh(mesh, sizes)  # UserError naming E or T and a size that divides, before anything compiles
    t, d, f, e = (int(sizes[k]) for k in ("T", "D", "F", "E"))
    shared = "S" in sizes  # moe_shared_mlp: S shared experts, one SwiGLU of width S F
    shardings = [NamedSharding(mesh, s) for s in moe.in_specs(mesh, shared)]
    shapes = [(t, d), (d, e), (e, d, f), (e, d, f), (e, f, d)]
    if shared:
        sf = int(sizes["S"]) * f
        shapes += [(d, sf), (d, sf), (sf, d)]
    reference = partial(moe.reference_moe, groups=moe.token_groups(mesh))
    built = _placed(moe.moe_mlp(mesh, shared=shared), shapes, shardings, dtype, seed, reference)
    built.facts = lambda: {"routing": moe.load_report(*built.host_args[:2], groups=moe.token_groups(mesh))}
    return built


def _pipeline(mesh: Mesh, sizes: Mapping[str, int], dtype: np.dtype, seed: int) -> Built:
    """The pipelined MLP's GPipe train step: stage-stacked weights ``[p, Lmax, D, F]``, ``[p, Lmax, F, D]`` over
    ``pipe``, x ``[B, D]`` over ``data``; the even split ``L / p`` (a Plan carries no other). With V chunks per
    stage (``pipeline_circular``, the only one given a V) the circular schedule, weights ``[p, V, Lc, ., .]``."""
    if "V" in sizes:
        return pcirc.build(mesh, sizes, dtype, seed)
    return pp.build(mesh, sizes, dtype, seed)  # UserError naming L, B or M first, before anything compiles


# The kernels over named axes (AXIS_FAMILIES below): their builder and the sizes they take.
_AXIS_BUILDERS: dict[str, Callable[..., Built]] = {"attention": _attention, "moe": _moe, "pipeline": _pipeline}


def _build_axis(
    make: Callable[..., Built],
    name: str,
    dims: tuple[str, ...],
    mesh: Mesh,
    sizes: Mapping[str, int],
    dtype=np.float32,
    axes: tuple[str, ...] | None = None,
    *,
    seed: int = 0,
) -> Built:
    del axes  # placed over their own named axes
    _check_sizes(name, sizes, dims)
    return make(mesh, sizes, _dtype(dtype), seed)


def _kernel(spec: ProgramSpec) -> Kernel:
    if spec.family in _AXIS_BUILDERS:
        build = partial(_build_axis, _AXIS_BUILDERS[spec.family], spec.name, spec.dims)
    elif spec.family == "collective":
        build = partial(_build_collective, spec.name, spec.name.removeprefix("collective_"))
    elif spec.family == "block":
        build = partial(_build_block, spec.name)
    else:
        build = partial(_build_matmul, spec.name, spec.notation, _MATMULS[spec.name], spec.explicit)
    return Kernel(spec.name, spec.family, spec.description, spec.notation, spec.dims, build)


# Programs that need a model are built from their Plan (below); kernels over named axes other than X and Y (ring
# attention: data, context; the MoE MLP: data, expert; the pipelined MLP: data, pipe) are kept apart in
# AXIS_KERNELS, since every entry of KERNELS builds on the X/Y meshes and the I, J, K / B, D, F / N sizes the kernel
# sweeps use.
AXIS_FAMILIES = tuple(_AXIS_BUILDERS)
KERNELS: dict[str, Kernel] = {
    name: _kernel(spec) for name, spec in PROGRAMS.items() if spec.family not in ("transformer", "user", *AXIS_FAMILIES)
}
AXIS_KERNELS: dict[str, Kernel] = {
    name: _kernel(spec) for name, spec in PROGRAMS.items() if spec.family in AXIS_FAMILIES
}


def get_kernel(name: str) -> Kernel:
    """The registered kernel ``name``; a :class:`UserError` listing the valid names otherwise."""
    found = KERNELS.get(name) or AXIS_KERNELS.get(name)
    if found is None:
        raise UserError(f"unknown kernel {name!r}; valid: {', '.join([*KERNELS, *AXIS_KERNELS])}")
    return found


def build(plan: Plan, mesh: Mesh | None = None, *, seed: int = 0) -> Built:
    """Any program of a validated Plan on ``mesh`` (default: the first devices, shaped as the Plan says)."""
    plan.validate()
    if plan.program == "train_step":
        from kernels.transformer.train import build_train

        return build_train(plan, mesh, seed=seed)
    if plan.program == "decode":
        from kernels.transformer.decode import build_decode

        return build_decode(plan, mesh, seed=seed)
    if plan.program == "serve":
        from kernels.transformer.paged import build_serve

        return build_serve(plan, mesh, seed=seed)
    if plan.program == "user_model":
        from kernels.user_model import build_user

        return build_user(plan, mesh, seed=seed)
    jmesh = mesh if mesh is not None else make_mesh(plan.shape, slow=plan.slow_axes)
    return get_kernel(plan.program).build(jmesh, plan.sizes, plan.dtype, plan.axes, seed=seed)


def output_spec(kernel: Kernel, mesh: Mesh, axes: tuple[str, ...] | None = None) -> P:
    """The ``PartitionSpec`` a kernel's output has: the notation's output, or the collective's layout."""
    if kernel.family == "block":
        return blocks.TP_MLP_OUT
    if kernel.family == "attention":
        return ra.qkv_spec(mesh)
    if kernel.family == "moe":
        return moe.token_spec(mesh)
    if kernel.family == "pipeline":  # a train step: the loss (replicated) and the updated weights, laid out so
        return pcirc.weight_spec() if kernel.name == "pipeline_circular" else pp.weight_spec()
    if kernel.notation is not None:
        return parse_matmul(kernel.notation).out.to_partition_spec()
    kind = kernel.name.removeprefix("collective_")
    return coll.layout(kind, mesh, coll.check_axes(mesh, axes), 1)[3]


__all__ = ["AXIS_KERNELS", "KERNELS", "Built", "Kernel", "build", "get_kernel", "output_spec"]
