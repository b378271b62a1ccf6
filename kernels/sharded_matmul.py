"""The scaling book's four sharded-matmul cases, each written twice.

Operands ``A[I, J]`` and ``B[J, K]`` on a mesh with axes ``X`` and ``Y`` (either may have size 1):

========================  ============================================  ===========================
kernel                    notation                                      communication (book rule)
========================  ============================================  ===========================
``case1``                 ``A[I_X, J] * B[J, K_Y] -> C[I_X, K_Y]``      none
``case2``                 ``A[I, J_X] * B[J, K] -> C[I, K]``            AllGather_X A, then multiply
``case3``                 ``A[I, J_X] * B[J_X, K] -> C[I, K]``          multiply, AllReduce_X C{U_X}
``case3_scatter``         ``A[I, J_X] * B[J_X, K] -> C[I, K_X]``        multiply, ReduceScatter_X
``case4``                 ``A[I_X, J] * B[J, K_X] -> C[I, K_X]``        AllGather_X A, then multiply
========================  ============================================  ===========================

Each case comes as

* ``caseN(mesh)``: manual mode, a ``jax.shard_map`` whose body names every collective (``jax.lax``) inside a
  ``jax.named_scope``, so traces and HLO metadata show where the bytes move;
* ``caseN_named(mesh)``: explicit mode, ``jax.jit`` on a copy of the mesh whose axes are ``AxisType.Explicit``.
  Shardings are part of the array type (``jax.typeof(a)`` prints ``float32[56@X,88]``); JAX and XLA insert the
  communication. Where the type rule is ambiguous (case 3: both contracting dims sharded) or illegal (case 4:
  ``C[I_X, K_X]`` would use X twice) JAX raises at trace time, and the kernel says what it wants with
  ``out_sharding=`` or ``jax.sharding.reshard``.

Every builder returns a jitted function of ``(a, b)`` whose inputs must already be placed as the notation says
(``NamedSharding(mesh, lhs_spec)``...); :func:`reference_matmul` is the single-device answer for all of them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# Mesh axes, named once.
X = "X"
Y = "Y"

MatmulFn = Callable[[jax.Array, jax.Array], jax.Array]


def reference_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``C = A @ B`` on the host in float64, returned in the operands' dtype (the single-device answer)."""
    out = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    return out.astype(np.result_type(a.dtype, b.dtype))


def explicit_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis ``AxisType.Explicit`` (sharding in the type)."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * len(mesh.axis_names))


def _manual(mesh: Mesh, body: Callable, in_specs: tuple[P, P], out_specs: P, *, check_vma: bool = True) -> MatmulFn:
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma))


def _named(mesh: Mesh, body: Callable, in_specs: tuple[P, P]) -> MatmulFn:
    """``jax.jit`` with the input shardings pinned, so a wrongly placed operand fails instead of re-laying out."""
    return jax.jit(body, in_shardings=tuple(NamedSharding(mesh, s) for s in in_specs))


# ----- case 1: no contracting dim sharded -----------------------------------------------------------------------

CASE1_SPECS = (
    P(X, None),  # A[I_X, J]
    P(None, Y),  # B[J, K_Y]
)
CASE1_OUT = P(X, Y)  # C[I_X, K_Y]


def case1(mesh: Mesh) -> MatmulFn:
    """``A[I_X, J] * B[J, K_Y] -> C[I_X, K_Y]``: multiply the local blocks; no communication."""

    def body(a_block, b_block):
        # a_block [I/X, J], b_block [J, K/Y] -> c_block [I/X, K/Y]
        return jnp.einsum("ij,jk->ik", a_block, b_block)

    return _manual(mesh, body, CASE1_SPECS, CASE1_OUT)


def case1_named(mesh: Mesh) -> MatmulFn:
    """``A[I_X, J] * B[J, K_Y] -> C[I_X, K_Y]`` in explicit mode: the type rule alone gives ``C[I_X, K_Y]``."""
    mesh = explicit_mesh(mesh)

    def body(a, b):
        # float32[I@X, J] x float32[J, K@Y] -> float32[I@X, K@Y]; no out_sharding needed.
        return jnp.einsum("ij,jk->ik", a, b)

    return _named(mesh, body, CASE1_SPECS)


# ----- case 2: one operand's contracting dim sharded -----------------------------------------------------------

CASE2_SPECS = (
    P(None, X),  # A[I, J_X]
    P(None, None),  # B[J, K]
)
CASE2_OUT = P(None, None)  # C[I, K]


def case2(mesh: Mesh) -> MatmulFn:
    """``A[I, J_X] * B[J, K] -> C[I, K]``: ``AllGather_X A[I, J_X] -> A[I, J]``, then a local matmul."""

    def body(a_block, b_block):
        # a_block [I, J/X], b_block [J, K]
        with jax.named_scope("allgather_lhs"):
            a_full = jax.lax.all_gather(a_block, X, axis=1, tiled=True)  # [I, J]
        return jnp.einsum("ij,jk->ik", a_full, b_block)  # [I, K]

    # jax.lax.all_gather types its result as still varying over X (its transpose is a ReduceScatter), so the
    # replicated C[I, K] cannot pass shard_map's replication check; the invariant gather is not public API.
    return _manual(mesh, body, CASE2_SPECS, CASE2_OUT, check_vma=False)


def case2_named(mesh: Mesh) -> MatmulFn:
    """``A[I, J_X] * B[J, K] -> C[I, K]`` in explicit mode.

    Only one contracting dim is sharded, so the type rule is not ambiguous: the output takes the free dims'
    shardings, ``C[I, K]``, and XLA's partitioner decides how to get there (on CPU it all-gathers A over X,
    the book's rule).
    """
    mesh = explicit_mesh(mesh)

    def body(a, b):
        return jnp.einsum("ij,jk->ik", a, b)  # float32[I, J@X] x float32[J, K] -> float32[I, K]

    return _named(mesh, body, CASE2_SPECS)


# ----- case 3: both contracting dims sharded along the same axis ----------------------------------------------

CASE3_SPECS = (
    P(None, X),  # A[I, J_X]
    P(X, None),  # B[J_X, K]
)
CASE3_OUT = P(None, None)  # C[I, K]
CASE3_SCATTER_OUT = P(None, X)  # C[I, K_X]


def case3(mesh: Mesh) -> MatmulFn:
    """``A[I, J_X] * B[J_X, K] -> C[I, K]``: local matmul gives ``C[I, K]{U_X}``, then ``AllReduce_X``."""

    def body(a_block, b_block):
        # a_block [I, J/X], b_block [J/X, K]
        c_partial = jnp.einsum("ij,jk->ik", a_block, b_block)  # [I, K]{U_X}
        with jax.named_scope("allreduce_out"):
            return jax.lax.psum(c_partial, X)  # [I, K]

    return _manual(mesh, body, CASE3_SPECS, CASE3_OUT)


def case3_scatter(mesh: Mesh) -> MatmulFn:
    """``A[I, J_X] * B[J_X, K] -> C[I, K_X]``: local matmul, then ``ReduceScatter_X`` onto K."""

    def body(a_block, b_block):
        # a_block [I, J/X], b_block [J/X, K]
        c_partial = jnp.einsum("ij,jk->ik", a_block, b_block)  # [I, K]{U_X}
        with jax.named_scope("reducescatter_out"):
            return jax.lax.psum_scatter(c_partial, X, scatter_dimension=1, tiled=True)  # [I, K/X]

    return _manual(mesh, body, CASE3_SPECS, CASE3_SCATTER_OUT)


def case3_named(mesh: Mesh) -> MatmulFn:
    """``A[I, J_X] * B[J_X, K] -> C[I, K]`` in explicit mode.

    Without ``out_sharding`` JAX refuses: "Contracting dimensions are sharded and it is ambiguous how the output
    should be sharded". ``out_sharding=C[I, K]`` asks for the AllReduce.
    """
    mesh = explicit_mesh(mesh)
    out = NamedSharding(mesh, CASE3_OUT)

    def body(a, b):
        return jnp.einsum("ij,jk->ik", a, b, out_sharding=out)

    return _named(mesh, body, CASE3_SPECS)


def case3_scatter_named(mesh: Mesh) -> MatmulFn:
    """``A[I, J_X] * B[J_X, K] -> C[I, K]{U_X} -> C[I, K_X]`` in explicit mode.

    The product is typed unreduced over X (``P(unreduced={X})``, the book's ``{U_X}``) and then resharded to
    ``C[I, K_X]``: a ReduceScatter by construction. Asking for ``out_sharding=C[I, K_X]`` directly leaves the
    plan to XLA, which on a mesh with an idle axis splits K over it and permutes the result instead.
    """
    mesh = explicit_mesh(mesh)
    partial_sums = NamedSharding(mesh, P(None, None, unreduced={X}))  # C[I, K]{U_X}
    out = NamedSharding(mesh, CASE3_SCATTER_OUT)

    def body(a, b):
        c = jnp.einsum("ij,jk->ik", a, b, out_sharding=partial_sums)
        with jax.named_scope("reducescatter_out"):
            return jax.sharding.reshard(c, out)

    return _named(mesh, body, CASE3_SPECS)


# ----- case 4: a free dim of each operand on the same axis ----------------------------------------------------

CASE4_SPECS = (
    P(X, None),  # A[I_X, J]
    P(None, X),  # B[J, K_X]
)
CASE4_OUT = P(None, X)  # C[I, K_X]


def case4(mesh: Mesh) -> MatmulFn:
    """``A[I_X, J] * B[J, K_X] -> C[I, K_X]``: ``C[I_X, K_X]`` is invalid, so ``AllGather_X A -> A[I, J]`` first."""

    def body(a_block, b_block):
        # a_block [I/X, J], b_block [J, K/X]
        with jax.named_scope("allgather_lhs"):
            a_full = jax.lax.all_gather(a_block, X, axis=0, tiled=True)  # [I, J]
        return jnp.einsum("ij,jk->ik", a_full, b_block)  # [I, K/X]

    return _manual(mesh, body, CASE4_SPECS, CASE4_OUT)


def case4_named(mesh: Mesh) -> MatmulFn:
    """``A[I_X, J] * B[J, K_X] -> C[I, K_X]`` in explicit mode.

    A plain product fails: "produces an illegally sharded result: f32[I@X, K@X]". The kernel applies the book's
    rule itself with ``jax.sharding.reshard(a, A[I, J])`` (an AllGather over X) before multiplying. (Passing
    ``out_sharding=C[I, K_X]`` instead also type-checks, but leaves the choice of communication to XLA.)
    """
    mesh = explicit_mesh(mesh)
    a_gathered = NamedSharding(mesh, P(None, None))  # A[I, J]

    def body(a, b):
        with jax.named_scope("allgather_lhs"):
            a = jax.sharding.reshard(a, a_gathered)
        return jnp.einsum("ij,jk->ik", a, b)  # float32[I, J] x float32[J, K@X] -> float32[I, K@X]

    return _named(mesh, body, CASE4_SPECS)


__all__ = [
    "X",
    "Y",
    "case1",
    "case1_named",
    "case2",
    "case2_named",
    "case3",
    "case3_named",
    "case3_scatter",
    "case3_scatter_named",
    "case4",
    "case4_named",
    "explicit_mesh",
    "reference_matmul",
]
