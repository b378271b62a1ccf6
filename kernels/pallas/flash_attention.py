"""Flash attention in Pallas: blocked grouped-query softmax attention, forward and backward.

The public layout is the Transformer's (``kernels/transformer/model.py`` ``_attend``): q ``[B, T, N, H]``,
k and v ``[B, S, K, H]``, query head ``n`` reading KV head ``n // (N // K)``, scores scaled by ``H**-0.5`` and
softmaxed in float32. The kernels work head-major (``[B, N, T, H]``), so each block is a ``(rows, H)`` tile.

* Forward: grid ``(B, N, T/block_q, S/block_k)``, the key axis innermost; an online softmax keeps each query
  row's running max and sum and an float32 accumulator in VMEM scratch, and writes o and the rows' logsumexp.
* Backward (a ``jax.custom_vjp``): ``D = rowsum(dO * o)`` in plain JAX, then a dq kernel (grid as the forward)
  and a dk/dv kernel (grid ``(B, K, S/block_k, N/K, T/block_q)``: a KV head's gradients sum over its group's
  query heads and the query blocks), both recomputing the probabilities from the saved logsumexp.

Causal attention (query ``t`` sees keys ``s <= t``; needs ``T == S``) skips block pairs wholly above the
diagonal with ``pl.when``, and the index maps point skipped steps at a block already fetched, so neither their
FLOPs nor their bytes are spent: :mod:`lab.core.pallas_cost` counts exactly what is computed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lab.core.errors import UserError
from lab.core.pallas_cost import flash_cost, flash_dkv_cost, flash_dq_cost

MASK = float(jnp.finfo(jnp.float32).min)  # a masked score, as the model's reference attention uses
# Rows of a TPU vreg. Mosaic needs a block's second-minor size (block_q, block_k) to be a multiple of it or the
# whole length (it refuses 4 of 64). The head dimension spans the whole block, so any H tiles (Mosaic compiled
# H = 1, 7, 12, 100 for a v5e; the lab's toy models have 12).
SUBLANE = 8
_PARALLEL, _ARBITRARY = "parallel", "arbitrary"


@dataclass(frozen=True)
class _Config:
    """The static choices of one attention call (hashable: the custom VJP's non-differentiable argument)."""

    causal: bool
    block_q: int
    block_k: int
    interpret: bool | pltpu.InterpretParams


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    block_q: int = 128,
    block_k: int = 128,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """Softmax attention of q ``[B, T, N, H]`` over k, v ``[B, S, K, H]`` -> o ``[B, T, N, H]`` in q's dtype.

    ``block_q`` and ``block_k`` must divide T and S; ``interpret`` runs the kernels in Pallas' interpreter (any
    backend): ``True`` the generic one, a ``pltpu.InterpretParams`` the one that simulates a TPU's memories and
    DMAs (``detect_races=True`` checks the kernels' reads and writes for races). Differentiable in q, k and v (the
    backward is Pallas too). Bad shapes are a :class:`UserError`.
    """
    mode = interpret if isinstance(interpret, pltpu.InterpretParams) else bool(interpret)
    cfg = _Config(bool(causal), int(block_q), int(block_k), mode)
    check_shapes(q.shape, k.shape, v.shape, cfg.causal, cfg.block_q, cfg.block_k)
    heads_major = (0, 2, 1, 3)
    o = _flash(q.transpose(heads_major), k.transpose(heads_major), v.transpose(heads_major), cfg)
    return o.transpose(heads_major)


def check_shapes(q_shape, k_shape, v_shape, causal: bool, block_q: int, block_k: int) -> None:
    """Refuse, in one line each, what the kernels cannot do (a :class:`UserError`)."""
    if len(q_shape) != 4 or len(k_shape) != 4 or tuple(k_shape) != tuple(v_shape):
        raise UserError(
            f"flash_attention needs q [B, T, N, H] and k, v [B, S, K, H]; got {q_shape}, {k_shape}, {v_shape}"
        )
    (b, t, n, h), (bk, s, kv, hk) = q_shape, k_shape
    if (b, h) != (bk, hk):
        raise UserError(f"q {tuple(q_shape)} and k {tuple(k_shape)} differ in batch or head dimension")
    if kv < 1 or n % kv:
        raise UserError(f"kv_heads {kv} does not divide heads {n}; grouped-query attention needs heads % kv_heads == 0")
    for name, block, length, what in (
        ("block_q", block_q, t, "query length T"),
        ("block_k", block_k, s, "key length S"),
    ):
        if block < 1 or length % block:
            raise UserError(f"{name} {block} does not divide the {what} {length}; give a divisor of {length}")
        if block % SUBLANE and block != length:
            raise UserError(
                f"{name} {block} cannot be tiled; it must be a multiple of {SUBLANE} (or the whole {length})"
            )
    if causal and t != s:
        raise UserError(f"causal flash_attention needs T == S (query t sees keys s <= t); got T={t}, S={s}")


def _visible(i, j, cfg: _Config):
    """Whether block pair (query block i, key block j) has an unmasked element (always, without a mask)."""
    if not cfg.causal:
        return True
    return j * cfg.block_k <= i * cfg.block_q + cfg.block_q - 1


def _scores(q, k, i, j, scale: float, cfg: _Config):
    """``q k^T * scale`` in float32 for one block pair, the causal mask applied."""
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    if cfg.causal:
        shape = (cfg.block_q, cfg.block_k)
        rows = i * cfg.block_q + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
        cols = j * cfg.block_k + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
        s = jnp.where(cols <= rows, s, MASK)
    return s


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *, cfg: _Config, scale: float):
    """One (query block, key block) step of the online softmax; the last key block writes o and logsumexp."""
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(_visible(i, j, cfg))
    def _step():
        s = _scores(q_ref[...], k_ref[...], i, j, scale, cfg)
        m_old = m_sc[...]
        m_new = jnp.maximum(m_old, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_old - m_new)
        p = jnp.exp(s - m_new)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]
        acc_sc[...] = alpha * acc_sc[...] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        m_sc[...] = m_new

    @pl.when(j == pl.num_programs(3) - 1)
    def _write():
        o_ref[...] = (acc_sc[...] / l_sc[...]).astype(o_ref.dtype)
        lse_ref[...] = m_sc[...] + jnp.log(l_sc[...])


def _kv_block(cfg: _Config, group: int):
    """Index map of a K/V block for the grid (b, n, i, j): a skipped causal step re-points at the last visible
    key block (already fetched), so it costs no copy."""

    def index(b, n, i, j):
        if cfg.causal:
            j = jnp.minimum(j, (i * cfg.block_q + cfg.block_q - 1) // cfg.block_k)
        return b, n // group, j, 0

    return index


def out_like(x, shape, dtype) -> jax.ShapeDtypeStruct:
    """A pallas_call output ``shape``, ``dtype`` varying over the same manual mesh axes as ``x`` (inside a
    ``jax.shard_map`` with ``check_vma``, Pallas needs to be told; elsewhere there are none)."""
    aval = jax.typeof(x)
    if hasattr(aval, "manual_axis_type"):  # jax >= 0.10
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.manual_axis_type)
    return jax.ShapeDtypeStruct(shape, dtype, vma=aval.vma)


def _row_block(b, n, i, j):
    """Index map of a query-row block (q, o, dO, dq, and the float32 row statistics) for the grid (b, n, i, j)."""
    return b, n, i, 0


def _cost(fn, q, k, cfg: _Config) -> pl.CostEstimate:
    """The pallas_call's estimate from a :mod:`lab.core.pallas_cost` function (head-major q, k)."""
    b, n, t, h = q.shape
    return pl.CostEstimate(
        **fn(b, t, k.shape[2], n, k.shape[1], h, cfg.block_q, cfg.block_k, cfg.causal, q.dtype.itemsize)
    )


def _params(n_parallel: int, n_arbitrary: int):
    """Mosaic's grid semantics: the outer axes independent, the inner (reduction) axes in order."""
    return pltpu.CompilerParams(dimension_semantics=(_PARALLEL,) * n_parallel + (_ARBITRARY,) * n_arbitrary)


def _forward(q, k, v, cfg: _Config):
    """o ``[B, N, T, H]`` and the rows' float32 logsumexp ``[B, N, T, 1]`` (head-major inputs)."""
    b, n, t, h = q.shape
    kv, s = k.shape[1], k.shape[2]
    bq, bk = cfg.block_q, cfg.block_k
    rows = pl.BlockSpec((pl.squeezed, pl.squeezed, bq, h), _row_block)
    keys = pl.BlockSpec((pl.squeezed, pl.squeezed, bk, h), _kv_block(cfg, n // kv))
    kernel = functools.partial(_forward_kernel, cfg=cfg, scale=h**-0.5)
    return pl.pallas_call(
        kernel,
        grid=(b, n, t // bq, s // bk),
        in_specs=[rows, keys, keys],
        out_specs=[rows, pl.BlockSpec((pl.squeezed, pl.squeezed, bq, 1), _row_block)],
        out_shape=[out_like(q, q.shape, q.dtype), out_like(q, (b, n, t, 1), jnp.float32)],
        scratch_shapes=[
            pltpu.VMEM((bq, 1), jnp.float32),
            pltpu.VMEM((bq, 1), jnp.float32),
            pltpu.VMEM((bq, h), jnp.float32),
        ],
        compiler_params=_params(3, 1),
        cost_estimate=_cost(flash_cost, q, k, cfg),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(q, k, v)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, dq_ref, acc_sc, *, cfg: _Config, scale: float):
    """dq of one query block, summed over its visible key blocks: ``ds k`` with ``ds = p * (dO v^T - D)``."""
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(_visible(i, j, cfg))
    def _step():
        k, v = k_ref[...], v_ref[...]
        p = jnp.exp(_scores(q_ref[...], k, i, j, scale, cfg) - lse_ref[...])
        dp = jax.lax.dot_general(do_ref[...], v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - d_ref[...])
        acc_sc[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(3) - 1)
    def _write():
        dq_ref[...] = (acc_sc[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, dk_ref, dv_ref, dk_sc, dv_sc, *, cfg: _Config, scale: float
):
    """dk, dv of one key block of one KV head, summed over the group's query heads g and the query blocks i:
    ``dv = p^T dO`` and ``dk = ds^T q``."""
    j, g, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    contract_rows = (((0,), (0,)), ((), ()))

    @pl.when((g == 0) & (i == 0))
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(_visible(i, j, cfg))
    def _step():
        q, v, do = q_ref[...], v_ref[...], do_ref[...]
        p = jnp.exp(_scores(q, k_ref[...], i, j, scale, cfg) - lse_ref[...])
        dv_sc[...] += jax.lax.dot_general(p.astype(do.dtype), do, contract_rows, preferred_element_type=jnp.float32)
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - d_ref[...])
        dk_sc[...] += jax.lax.dot_general(ds.astype(q.dtype), q, contract_rows, preferred_element_type=jnp.float32)

    @pl.when((g == pl.num_programs(3) - 1) & (i == pl.num_programs(4) - 1))
    def _write():
        dk_ref[...] = (dk_sc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dq(q, k, v, do, lse, d, cfg: _Config):
    """dq ``[B, N, T, H]`` (head-major), by the dq kernel over the forward's grid."""
    b, n, t, h = q.shape
    kv, s = k.shape[1], k.shape[2]
    bq, bk = cfg.block_q, cfg.block_k
    rows = pl.BlockSpec((pl.squeezed, pl.squeezed, bq, h), _row_block)
    stats = pl.BlockSpec((pl.squeezed, pl.squeezed, bq, 1), _row_block)
    keys = pl.BlockSpec((pl.squeezed, pl.squeezed, bk, h), _kv_block(cfg, n // kv))
    return pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, scale=h**-0.5),
        grid=(b, n, t // bq, s // bk),
        in_specs=[rows, keys, keys, rows, stats, stats],
        out_specs=rows,
        out_shape=out_like(q, q.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((bq, h), jnp.float32)],
        compiler_params=_params(3, 1),
        cost_estimate=_cost(flash_dq_cost, q, k, cfg),
        interpret=cfg.interpret,
        name="flash_attention_dq",
    )(q, k, v, do, lse, d)


def _dkv(q, k, v, do, lse, d, cfg: _Config):
    """dk, dv ``[B, K, S, H]`` (head-major), by the dk/dv kernel over ``(B, K, S/block_k, N/K, T/block_q)``."""
    b, n, t, h = q.shape
    kv, s = k.shape[1], k.shape[2]
    bq, bk, group = cfg.block_q, cfg.block_k, n // kv

    def query_block(b, kh, j, g, i):  # a skipped causal step re-points at the first visible query block
        if cfg.causal:
            i = jnp.maximum(i, (j * bk) // bq)
        return b, kh * group + g, i, 0

    rows = pl.BlockSpec((pl.squeezed, pl.squeezed, bq, h), query_block)
    stats = pl.BlockSpec((pl.squeezed, pl.squeezed, bq, 1), query_block)
    keys = pl.BlockSpec((pl.squeezed, pl.squeezed, bk, h), lambda b, kh, j, g, i: (b, kh, j, 0))
    return pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, scale=h**-0.5),
        grid=(b, kv, s // bk, group, t // bq),
        in_specs=[rows, keys, keys, rows, stats, stats],
        out_specs=[keys, keys],
        out_shape=[out_like(k, k.shape, k.dtype), out_like(v, v.shape, v.dtype)],
        scratch_shapes=[pltpu.VMEM((bk, h), jnp.float32), pltpu.VMEM((bk, h), jnp.float32)],
        compiler_params=_params(3, 2),
        cost_estimate=_cost(flash_dkv_cost, q, k, cfg),
        interpret=cfg.interpret,
        name="flash_attention_dkv",
    )(q, k, v, do, lse, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q, k, v, cfg: _Config):
    """Head-major attention with the Pallas backward attached (the custom VJP)."""
    return _forward(q, k, v, cfg)[0]


def _flash_fwd(q, k, v, cfg: _Config):
    """The forward, keeping the inputs, o and the rows' logsumexp for the backward."""
    o, lse = _forward(q, k, v, cfg)
    return o, (q, k, v, o, lse)


def _flash_bwd(cfg: _Config, res, do):
    """``D = rowsum(dO * o)`` in plain JAX, then the dq and dk/dv kernels."""
    q, k, v, o, lse = res
    d = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)  # [B, N, T, 1]
    dq = _dq(q, k, v, do, lse, d, cfg)
    dk, dv = _dkv(q, k, v, do, lse, d, cfg)
    return dq, dk, dv


_flash.defvjp(_flash_fwd, _flash_bwd)

__all__ = ["flash_attention"]
