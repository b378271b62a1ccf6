"""Collective matmuls: the communication of a sharded matmul cut into ring steps that overlap the compute.

Two shapes from the scaling book (jax-stuff.md; Wang et al.), each beside its plain blocking version:

* **AllGather-matmul** ``A[I_X, J_Y] * W[J, K_Y] -> Out[I_X, K_Y]`` (the book's
  ``collective_matmul_allgather_lhs_contracting``). Blocking: ``AllGather_Y A -> A[I_X, J]``, one matmul.
  Collective: each device multiplies the lhs chunk it holds by the matching row chunk of its ``W`` block while
  the chunk travels one step around the Y ring (``ppermute``); after ``Y - 1`` steps every chunk has visited.
* **matmul-ReduceScatter** ``A[I, J_Y] * W[J_Y, K] -> Out[I, K_Y]``, the dual. Blocking: local matmul gives
  ``Out[I, K]{U_Y}``, then ``ReduceScatter_Y``. Collective: a partial-sum accumulator for one output column chunk
  travels the ring; each device adds its contribution to that chunk before passing it on, so after ``Y - 1``
  steps each device holds its own chunk fully reduced.

The AllGather-matmul accumulates in fp32 on the device; the ReduceScatter accumulator travels, so it stays in
the operands' dtype, as the blocking ReduceScatter's partial sums do.

The bidirectional variants use both directions of every ring link: half of the chunks a device needs arrive from
each neighbour, so the loop takes ``ceil((Y - 1) / 2)`` steps instead of ``Y - 1``, each moving one chunk each way.

The loops are Python loops (unrolled at trace time): the chunk index is ``axis_index`` plus a static step, and
the HLO holds only ``collective-permute`` ops, never an ``all-gather`` or ``reduce-scatter``. Each ring step runs
inside ``jax.named_scope``. An axis of size 1 degenerates to one local matmul with no communication.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kernels.sharded_matmul import X, Y, reference_matmul

MatmulFn = Callable[[jax.Array, jax.Array], jax.Array]

# A[I_X, J_Y] * W[J, K_Y] -> Out[I_X, K_Y]
ALLGATHER_SPECS = (
    P(X, Y),  # A[I_X, J_Y]: the lhs chunk that travels
    P(None, Y),  # W[J, K_Y]: rows are sliced to match the chunk held
)
ALLGATHER_OUT = P(X, Y)  # Out[I_X, K_Y]

# A[I, J_Y] * W[J_Y, K] -> Out[I, K_Y]
REDUCESCATTER_SPECS = (
    P(None, Y),  # A[I, J_Y]
    P(Y, None),  # W[J_Y, K]: columns are sliced per output chunk
)
REDUCESCATTER_OUT = P(None, Y)  # Out[I, K_Y]


def _shift(n: int, step: int) -> list[tuple[int, int]]:
    """Ring permutation along an axis of size ``n``: device ``j`` sends to ``j + step``."""
    return [(j, (j + step) % n) for j in range(n)]


def _chunk(x: jax.Array, index: jax.Array, size: int, axis: int) -> jax.Array:
    """Chunk number ``index`` (traced) of width ``size`` along ``axis``."""
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=axis)


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` with an fp32 result, for accumulators that stay on the device."""
    return jnp.einsum("ij,jk->ik", a, b, preferred_element_type=jnp.float32)


def _manual(mesh: Mesh, body: Callable, in_specs: tuple[P, P], out_specs: P) -> MatmulFn:
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


# ----- AllGather-matmul ------------------------------------------------------------------------------------------


def matmul_allgather_blocking(mesh: Mesh) -> MatmulFn:
    """``A[I_X, J_Y] * W[J, K_Y] -> Out[I_X, K_Y]``: ``AllGather_Y A[I_X, J_Y] -> A[I_X, J]``, then one matmul."""

    def body(a_block, w_block):
        # a_block [I/X, J/Y], w_block [J, K/Y]
        with jax.named_scope("allgather_lhs"):
            a_rows = jax.lax.all_gather(a_block, Y, axis=1, tiled=True)  # [I/X, J]
        return jnp.einsum("ij,jk->ik", a_rows, w_block)  # [I/X, K/Y]

    return _manual(mesh, body, ALLGATHER_SPECS, ALLGATHER_OUT)


def collective_matmul_allgather(mesh: Mesh) -> MatmulFn:
    """``A[I_X, J_Y] * W[J, K_Y] -> Out[I_X, K_Y]`` with the AllGather_Y cut into ``Y - 1`` ring steps.

    After ``s`` steps device ``y`` holds lhs chunk ``(y + s) % Y`` (chunks move to the left neighbour), which
    multiplies rows ``J`` chunk ``(y + s) % Y`` of ``w_block``. The ppermute of step ``s`` and the matmul of step
    ``s`` both read only the chunk held, so XLA may run them at the same time. The local accumulator is fp32 (it
    never travels), so bf16 inputs round once, as the blocking version's single matmul does.
    """
    n = mesh.shape[Y]

    def body(a_block, w_block):
        # a_block [I/X, J/Y], w_block [J, K/Y]
        cj = a_block.shape[1]
        y = jax.lax.axis_index(Y)
        chunk_block = a_block  # the lhs chunk held now, [I/X, J/Y]
        out_block = None  # [I/X, K/Y] fp32, built from the first product (so it is varying like its inputs)
        for s in range(n - 1):
            with jax.named_scope(f"ring_step_{s}"):
                next_block = jax.lax.ppermute(chunk_block, Y, _shift(n, -1))
                part = _dot(chunk_block, _chunk(w_block, (y + s) % n, cj, axis=0))
                out_block = part if out_block is None else out_block + part
            chunk_block = next_block
        with jax.named_scope("last_chunk"):
            part = _dot(chunk_block, _chunk(w_block, (y + n - 1) % n, cj, axis=0))
        out_block = part if out_block is None else out_block + part
        return out_block.astype(a_block.dtype)

    return _manual(mesh, body, ALLGATHER_SPECS, ALLGATHER_OUT)


def collective_matmul_allgather_bidir(mesh: Mesh) -> MatmulFn:
    """``A[I_X, J_Y] * W[J, K_Y] -> Out[I_X, K_Y]`` with lhs chunks travelling both ways round the Y ring.

    A copy of the chunk goes left and one goes right: after ``s`` steps device ``y`` holds chunks ``y + s`` (from
    the right) and ``y - s`` (from the left). The ``Y - 1`` chunks it needs split as ``Y // 2`` from the right and
    ``(Y - 1) // 2`` from the left, so the loop takes ``Y // 2`` steps instead of ``Y - 1``.
    """
    n = mesh.shape[Y]
    n_right, n_left = n // 2, (n - 1) // 2  # chunks arriving from each side

    def body(a_block, w_block):
        # a_block [I/X, J/Y], w_block [J, K/Y]
        cj = a_block.shape[1]
        y = jax.lax.axis_index(Y)
        out_block = _dot(a_block, _chunk(w_block, y, cj, axis=0))  # own chunk, [I/X, K/Y] fp32
        from_right = from_left = a_block
        for s in range(1, n_right + 1):
            with jax.named_scope(f"ring_step_{s - 1}"):
                from_right = jax.lax.ppermute(from_right, Y, _shift(n, -1))  # chunk (y + s) % n
                if s <= n_left:
                    from_left = jax.lax.ppermute(from_left, Y, _shift(n, +1))  # chunk (y - s) % n
                out_block = out_block + _dot(from_right, _chunk(w_block, (y + s) % n, cj, axis=0))
                if s <= n_left:
                    out_block = out_block + _dot(from_left, _chunk(w_block, (y - s) % n, cj, axis=0))
        return out_block.astype(a_block.dtype)

    return _manual(mesh, body, ALLGATHER_SPECS, ALLGATHER_OUT)


# ----- matmul-ReduceScatter ---------------------------------------------------------------------------------------


def matmul_reducescatter_blocking(mesh: Mesh) -> MatmulFn:
    """``A[I, J_Y] * W[J_Y, K] -> Out[I, K_Y]``: local matmul ``Out[I, K]{U_Y}``, then ``ReduceScatter_Y`` onto K."""

    def body(a_block, w_block):
        # a_block [I, J/Y], w_block [J/Y, K]
        partial = jnp.einsum("ij,jk->ik", a_block, w_block)  # [I, K]{U_Y}
        with jax.named_scope("reducescatter_out"):
            return jax.lax.psum_scatter(partial, Y, scatter_dimension=1, tiled=True)  # [I, K/Y]

    return _manual(mesh, body, REDUCESCATTER_SPECS, REDUCESCATTER_OUT)


def collective_matmul_reducescatter(mesh: Mesh) -> MatmulFn:
    """``A[I, J_Y] * W[J_Y, K] -> Out[I, K_Y]`` with the ReduceScatter_Y cut into ``Y - 1`` ring steps.

    The accumulator moves to the left neighbour each step. The one that ends on device ``d`` starts on ``d - 1``
    and visits every device; at step ``s`` device ``y`` holds the accumulator for output chunk ``(y + 1 + s) % Y``
    and adds ``a_block @ w_block[:, that chunk]`` to it. The next product does not wait for the ppermute.
    """
    n = mesh.shape[Y]

    def body(a_block, w_block):
        # a_block [I, J/Y], w_block [J/Y, K]
        ck = w_block.shape[1] // n
        y = jax.lax.axis_index(Y)
        acc_block = a_block @ _chunk(w_block, (y + 1) % n, ck, axis=1)  # [I, K/Y]{partial}
        for s in range(1, n):
            with jax.named_scope(f"ring_step_{s - 1}"):
                acc_block = jax.lax.ppermute(acc_block, Y, _shift(n, -1))
                acc_block = acc_block + a_block @ _chunk(w_block, (y + 1 + s) % n, ck, axis=1)
        return acc_block  # chunk y, reduced over Y

    return _manual(mesh, body, REDUCESCATTER_SPECS, REDUCESCATTER_OUT)


def collective_matmul_reducescatter_bidir(mesh: Mesh) -> MatmulFn:
    """``A[I, J_Y] * W[J_Y, K] -> Out[I, K_Y]`` with partial sums travelling both ways round the Y ring.

    Output chunk ``d`` collects ``Y // 2`` contributions in an accumulator moving left (from ``d + Y // 2`` down
    to ``d + 1``) and ``(Y - 1) // 2`` in one moving right (from ``d - (Y - 1) // 2`` up to ``d - 1``); device
    ``d`` adds the two and its own product. ``Y // 2`` steps instead of ``Y - 1``.
    """
    n = mesh.shape[Y]
    n_right, n_left = n // 2, (n - 1) // 2  # contributions arriving from each side

    def body(a_block, w_block):
        # a_block [I, J/Y], w_block [J/Y, K]
        ck = w_block.shape[1] // n
        y = jax.lax.axis_index(Y)

        def product(chunk):  # this device's contribution to output chunk `chunk`, [I, K/Y]
            return a_block @ _chunk(w_block, chunk % n, ck, axis=1)

        to_left = to_right = None  # accumulators in flight
        for s in range(n_right):
            with jax.named_scope(f"ring_step_{s}"):
                # to_left at step s is bound for device y - (n_right - s): add that chunk's product, pass left.
                part = product(y - n_right + s)
                to_left = jax.lax.ppermute(part if to_left is None else to_left + part, Y, _shift(n, -1))
                if s < n_left:
                    part = product(y + n_left - s)
                    to_right = jax.lax.ppermute(part if to_right is None else to_right + part, Y, _shift(n, +1))
        out_block = product(y)  # own contribution to own chunk
        for acc in (to_left, to_right):
            if acc is not None:
                out_block = out_block + acc
        return out_block

    return _manual(mesh, body, REDUCESCATTER_SPECS, REDUCESCATTER_OUT)


__all__ = [
    "ALLGATHER_OUT",
    "ALLGATHER_SPECS",
    "REDUCESCATTER_OUT",
    "REDUCESCATTER_SPECS",
    "collective_matmul_allgather",
    "collective_matmul_allgather_bidir",
    "collective_matmul_reducescatter",
    "collective_matmul_reducescatter_bidir",
    "matmul_allgather_blocking",
    "matmul_reducescatter_blocking",
    "reference_matmul",
]
