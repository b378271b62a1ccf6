"""Ragged paged-attention decode in Pallas: one new query token per sequence over its own pages of K/V cache.

q ``[B, N, H]`` (the token's query heads), k_pages and v_pages ``[P, page_size, K, H]`` (a pool of pages shared by
the batch), page_table ``[B, M]`` int32 (sequence b's m-th page is ``k_pages[page_table[b, m]]``) and lengths
``[B]`` int32 (sequence b attends over its first ``lengths[b]`` tokens only; ``lengths[b] <= M * page_size``).

The grid is ``(B, M / pages_per_block)``; each step brings ``pages_per_block`` whole pages (every KV head) into
VMEM and folds them, page by page, into an online softmax (running max, sum and float32 accumulator per query
head). The page table and lengths are scalar-prefetched (``PrefetchScalarGridSpec``) so the index maps read them:
a page past a sequence's length re-points at its last page (already fetched, so no copy) and is skipped with
``pl.when``; the last page is masked token by token. A sequence of length 0 gets zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.pallas.flash_attention import MASK, out_like
from lab.core.errors import UserError
from lab.core.pallas_cost import paged_decode_cost


def paged_decode(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    pages_per_block: int = 1,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """One decode step's attention: o ``[B, N, H]`` in q's dtype (scores and softmax in float32, scaled by
    ``H**-0.5``). ``pages_per_block`` pages are processed per grid step and must divide M; bad shapes are a
    :class:`UserError`. ``interpret``: as :func:`kernels.pallas.flash_attention.flash_attention`'s."""
    check_shapes(q.shape, k_pages.shape, v_pages.shape, page_table.shape, lengths.shape, pages_per_block)
    b, n, h = q.shape
    page_size, kv = k_pages.shape[1], k_pages.shape[2]
    m = page_table.shape[1]
    ppb = int(pages_per_block)
    pages = [pl.BlockSpec((pl.squeezed, page_size, kv, h), _page_block(p, ppb, page_size)) for p in range(ppb)]
    one_seq = pl.BlockSpec((pl.squeezed, n, h), lambda b, blk, table, lens: (b, 0, 0))
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, m // ppb),
        in_specs=[one_seq, *pages, *pages],
        out_specs=one_seq,
        scratch_shapes=[
            pltpu.VMEM((n, 1), jnp.float32),
            pltpu.VMEM((n, 1), jnp.float32),
            pltpu.VMEM((n, h), jnp.float32),
        ],
    )
    cost = paged_decode_cost(b, n, kv, h, m, page_size, q.dtype.itemsize)
    kernel = functools.partial(_decode_kernel, ppb=ppb, page_size=page_size, kv=kv, scale=h**-0.5)
    return pl.pallas_call(
        kernel,
        grid_spec=grid,
        out_shape=out_like(q, q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(**cost),
        interpret=interpret,
        name="paged_decode",
    )(page_table.astype(jnp.int32), lengths.astype(jnp.int32), q, *([k_pages] * ppb), *([v_pages] * ppb))


def check_shapes(q_shape, k_shape, v_shape, table_shape, lengths_shape, pages_per_block: int) -> None:
    """Refuse, in one line each, what the kernel cannot do (a :class:`UserError`)."""
    if len(q_shape) != 3 or len(k_shape) != 4 or tuple(k_shape) != tuple(v_shape):
        raise UserError(f"paged_decode needs q [B, N, H] and k, v pages [P, page_size, K, H]; got {q_shape}, {k_shape}")
    (b, n, h), kv = q_shape, k_shape[2]
    if len(table_shape) != 2 or table_shape[0] != b or tuple(lengths_shape) != (b,):
        raise UserError(f"page_table must be [B, M] and lengths [B] for B={b}; got {table_shape}, {lengths_shape}")
    if k_shape[3] != h:
        raise UserError(f"q's head dimension {h} differs from the pages' {k_shape[3]}")
    if kv < 1 or n % kv:
        raise UserError(f"kv_heads {kv} does not divide heads {n}; grouped-query attention needs heads % kv_heads == 0")
    if pages_per_block < 1 or table_shape[1] % pages_per_block:
        raise UserError(
            f"pages_per_block {pages_per_block} does not divide the page table's {table_shape[1]} pages per sequence"
        )


def _page_block(p: int, ppb: int, page_size: int):
    """Index map of the p-th page of a grid step: its pool index from the page table; a page past the sequence's
    length re-points at the sequence's last page (fetched already, so the step costs no copy)."""

    def index(b, blk, table, lens):
        last = jnp.maximum((lens[b] + page_size - 1) // page_size - 1, 0)
        return table[b, jnp.minimum(blk * ppb + p, last)], 0, 0, 0

    return index


def _decode_kernel(table_ref, lens_ref, q_ref, *refs, ppb: int, page_size: int, kv: int, scale: float):
    """Fold this step's pages into the running softmax; the last step writes o."""
    k_refs, v_refs = refs[:ppb], refs[ppb : 2 * ppb]
    o_ref, m_sc, l_sc, acc_sc = refs[2 * ppb :]
    b, blk = pl.program_id(0), pl.program_id(1)
    length = lens_ref[b]

    @pl.when(blk == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    for p in range(ppb):
        start = (blk * ppb + p) * page_size
        pl.when(start < length)(
            functools.partial(_fold_page, q_ref, k_refs[p], v_refs[p], start, length, m_sc, l_sc, acc_sc, kv, scale)
        )

    @pl.when(blk == pl.num_programs(1) - 1)
    def _write():
        total = l_sc[...]
        o_ref[...] = (acc_sc[...] / jnp.where(total == 0.0, 1.0, total)).astype(o_ref.dtype)


def _fold_page(q_ref, k_ref, v_ref, start, length, m_sc, l_sc, acc_sc, kv: int, scale: float):
    """One page (all KV heads): the scores of each KV head's query group, masked past the length, then one
    online-softmax update of every query head."""
    q, kp, vp = q_ref[...], k_ref[...], v_ref[...]
    group = q.shape[0] // kv
    contract_h = (((1,), (1,)), ((), ()))
    s = (
        jnp.concatenate(
            [
                jax.lax.dot_general(
                    q[g * group : (g + 1) * group], kp[:, g, :], contract_h, preferred_element_type=jnp.float32
                )
                for g in range(kv)
            ],
            axis=0,
        )
        * scale
    )  # [N, page_size]
    pos = start + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where(pos < length, s, MASK)
    m_old = m_sc[...]
    m_new = jnp.maximum(m_old, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_old - m_new)
    w = jnp.exp(s - m_new)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(w, axis=1, keepdims=True)
    w = w.astype(vp.dtype)
    pv = [jnp.dot(w[g * group : (g + 1) * group], vp[:, g, :], preferred_element_type=jnp.float32) for g in range(kv)]
    acc_sc[...] = alpha * acc_sc[...] + jnp.concatenate(pv, axis=0)
    m_sc[...] = m_new


__all__ = ["paged_decode"]
