"""Collective microkernels for benchmarking and calibration, over any subset of the mesh axes.

Every kernel is a ``jax.shard_map`` over the whole mesh with one collective inside a ``jax.named_scope``. The
collective spans the axes ``axes`` (a tuple such as ``("X",)`` or ``("X", "Z")``; the group is their product,
``G`` devices, ordered major-first as given). The other mesh axes (``R`` devices in all) each run an independent
copy on their own data, as in a real program that gathers over X while sharded over Y.

Global arrays are 1-D. An input laid out ``P((*rest, *axes))`` gives each device one contiguous block of ``N``
elements; ``rest`` is the other mesh axes in mesh order. Per device, with ``N`` elements in:

===================  =================  ======================================================================
kernel               out per device     what it computes (book notation, per copy over ``rest``)
===================  =================  ======================================================================
``all_gather``       ``[G * N]``        ``AllGather: [N_G] -> [N]``: every block of the group, in group order
``reduce_scatter``   ``[N / G]``        ``ReduceScatter: [N]{U_G} -> [N_G]``: slice ``g`` of the group's sum
``all_reduce``       ``[N]``            ``AllReduce: [N]{U_G} -> [N]``: the group's sum
``all_to_all``       ``[N]``            ``AllToAll``: slice ``j`` (of ``G``, ``N / G`` each) goes to member ``j``;
                                        member ``g`` receives slice ``g`` of every member, in group order
``permute``          ``[N]``            ``Permute``: member ``g`` sends its block to member ``(g + 1) % G``
===================  =================  ======================================================================

``reduce_scatter`` and ``all_to_all`` need ``N`` divisible by ``G``. The ``reference_*`` functions compute the
same global result on the host from the global input.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lab.core.errors import UserError

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "permute")


def check_axes(mesh: Mesh, axes: Sequence[str] | None) -> tuple[str, ...]:
    """``axes`` as a tuple of existing, distinct mesh axes (default: every mesh axis)."""
    if axes is None:
        return tuple(mesh.axis_names)
    if isinstance(axes, str):
        axes = (axes,)
    axes = tuple(axes)
    valid = ", ".join(mesh.axis_names)
    if not axes:
        raise UserError(f"a collective needs at least one mesh axis; valid: {valid}")
    for a in axes:
        if a not in mesh.axis_names:
            raise UserError(f"mesh axis {a!r} is not in the mesh; valid: {valid}")
    if len(set(axes)) != len(axes):
        raise UserError(f"mesh axes {axes} name an axis twice; name each once")
    return axes


def group_size(mesh: Mesh, axes: Sequence[str]) -> int:
    """``G``: the number of devices a collective over ``axes`` spans."""
    return math.prod(mesh.shape[a] for a in axes)


def rest_axes(mesh: Mesh, axes: Sequence[str]) -> tuple[str, ...]:
    """The mesh axes a collective over ``axes`` does not span, in mesh order."""
    return tuple(a for a in mesh.axis_names if a not in axes)


def _spec(names: tuple[str, ...]) -> P:
    return P(names if names else None)


def layout(kind: str, mesh: Mesh, axes: Sequence[str], n: int) -> tuple[int, P, int, P]:
    """``(global input length, input spec, global output length, output spec)`` for ``kind`` with ``N = n``."""
    axes = tuple(axes)
    rest = rest_axes(mesh, axes)
    g, r = group_size(mesh, axes), group_size(mesh, rest)
    sharded = _spec(rest + axes)  # a distinct block of N on every device
    if kind == "all_gather":
        return r * g * n, sharded, r * g * n, _spec(rest)
    if kind == "reduce_scatter":
        return r * g * n, sharded, r * n, sharded
    if kind == "all_reduce":
        return r * g * n, sharded, r * n, _spec(rest)
    if kind in ("all_to_all", "permute"):
        return r * g * n, sharded, r * g * n, sharded
    raise UserError(f"unknown collective {kind!r}; valid: {', '.join(KINDS)}")


def ring_perm(mesh: Mesh, axes: Sequence[str]) -> list[tuple[int, int]]:
    """``ppermute`` pairs for a ring shift by one, member ``g`` to ``g + 1`` in the group order of ``axes``.

    ``jax.lax.ppermute`` numbers the members of a multi-axis group in mesh order whatever order ``axes`` names
    them in (``all_gather``, ``psum_scatter`` and ``all_to_all`` follow the order given), so the ring written in
    ``axes`` order is translated to mesh-order indices here.
    """
    axes = tuple(axes)
    sizes = [mesh.shape[a] for a in axes]
    in_mesh_order = sorted(axes, key=list(mesh.axis_names).index)
    mesh_sizes = [mesh.shape[a] for a in in_mesh_order]

    def mesh_index(g: int) -> int:
        coords = dict(zip(axes, np.unravel_index(g, sizes), strict=True))
        return int(np.ravel_multi_index([coords[a] for a in in_mesh_order], mesh_sizes))

    g = math.prod(sizes)
    return [(mesh_index(j), mesh_index((j + 1) % g)) for j in range(g)]


def _body(kind: str, axes: tuple[str, ...], perm: list[tuple[int, int]]) -> Callable[[jax.Array], jax.Array]:
    def all_gather(x_block):  # [N] -> [G * N]
        with jax.named_scope("all_gather"):
            return jax.lax.all_gather(x_block, axes, axis=0, tiled=True)

    def reduce_scatter(x_block):  # [N] -> [N / G]
        with jax.named_scope("reduce_scatter"):
            return jax.lax.psum_scatter(x_block, axes, scatter_dimension=0, tiled=True)

    def all_reduce(x_block):  # [N] -> [N]
        with jax.named_scope("all_reduce"):
            return jax.lax.psum(x_block, axes)

    def all_to_all(x_block):  # [N] -> [N]
        with jax.named_scope("all_to_all"):
            return jax.lax.all_to_all(x_block, axes, split_axis=0, concat_axis=0, tiled=True)

    def permute(x_block):  # [N] -> [N]
        with jax.named_scope("permute"):
            return jax.lax.ppermute(x_block, axes, perm)

    return {
        "all_gather": all_gather,
        "reduce_scatter": reduce_scatter,
        "all_reduce": all_reduce,
        "all_to_all": all_to_all,
        "permute": permute,
    }[kind]


def collective(kind: str, mesh: Mesh, axes: Sequence[str] | None = None) -> Callable[[jax.Array], jax.Array]:
    """A jitted ``shard_map`` running collective ``kind`` over ``axes`` (default: every axis); see the module."""
    if kind not in KINDS:
        raise UserError(f"unknown collective {kind!r}; valid: {', '.join(KINDS)}")
    axes = check_axes(mesh, axes)
    _, in_spec, _, out_spec = layout(kind, mesh, axes, 1)
    body = _body(kind, axes, ring_perm(mesh, axes))
    # all_gather's result is typed as varying over the gathered axes (its transpose is a ReduceScatter), so its
    # replicated output cannot pass shard_map's replication check; the invariant gather is not public API.
    check_vma = kind != "all_gather"
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=check_vma))


def all_gather(mesh: Mesh, axes: Sequence[str] | None = None):
    """``AllGather`` over ``axes``: ``[N]`` per device in, ``[G * N]`` out."""
    return collective("all_gather", mesh, axes)


def reduce_scatter(mesh: Mesh, axes: Sequence[str] | None = None):
    """``ReduceScatter`` over ``axes``: ``[N]`` per device in, ``[N / G]`` out."""
    return collective("reduce_scatter", mesh, axes)


def all_reduce(mesh: Mesh, axes: Sequence[str] | None = None):
    """``AllReduce`` over ``axes``: ``[N]`` per device in, ``[N]`` out."""
    return collective("all_reduce", mesh, axes)


def all_to_all(mesh: Mesh, axes: Sequence[str] | None = None):
    """``AllToAll`` over ``axes``: ``[N]`` per device in, ``[N]`` out (``N / G`` to each member)."""
    return collective("all_to_all", mesh, axes)


def permute(mesh: Mesh, axes: Sequence[str] | None = None):
    """Ring shift by one over ``axes``: ``[N]`` per device in, ``[N]`` out (from member ``g - 1``)."""
    return collective("permute", mesh, axes)


def reference(kind: str, x: np.ndarray, r: int, g: int) -> np.ndarray:
    """The global output of ``kind`` for global input ``x`` (``r`` copies of ``g`` blocks), on the host.

    Sums run in float64 and are cast back to ``x``'s dtype.
    """
    blocks = np.asarray(x).reshape(r, g, -1)  # [rest, group, N]
    n = blocks.shape[2]
    if kind in ("all_gather", "permute", "all_to_all"):
        if kind == "permute":
            blocks = np.roll(blocks, 1, axis=1)  # member g now holds member g - 1's block
        elif kind == "all_to_all":
            # [rest, src, dst, N/G] -> [rest, dst, src, N/G]
            blocks = blocks.reshape(r, g, g, n // g).transpose(0, 2, 1, 3)
        return blocks.reshape(-1)  # all_gather: the global array is already what each member gets
    total = blocks.astype(np.float64).sum(axis=1).astype(x.dtype)  # [rest, N]
    if kind in ("all_reduce", "reduce_scatter"):
        return total.reshape(-1)  # reduce_scatter: member g holds slice g, which is this layout
    raise UserError(f"unknown collective {kind!r}; valid: {', '.join(KINDS)}")


__all__ = [
    "KINDS",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "check_axes",
    "collective",
    "group_size",
    "layout",
    "permute",
    "reduce_scatter",
    "reference",
    "rest_axes",
    "ring_perm",
]
