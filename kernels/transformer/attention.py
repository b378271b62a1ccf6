"""The Transformer's attention as a kernel (the Plan's ``attention`` option, :mod:`lab.core.attention`).

Each kernel runs inside ``jax.shard_map`` with the rules' specs, q ``[B_batch, T, N_heads, H]`` and k, v
``[B_batch, S, K_kv_heads, H]``, so every device attends its own sequences over its own heads (the rules put
kv_heads on the heads' axes: ``lab.core.attention.check_plan``):

* ``pallas``: the lab's flash attention (``kernels.pallas.flash_attention``), causal, with the Plan's block sizes
  clipped to the sequence; a decode step reads the contiguous cache as pages of ``block_k`` positions with the
  lab's paged decode kernel, its length the step's position + 1. Interpreted on the CPU, Mosaic on a TPU.
* ``splash``: JAX's ``splash_attention`` (a causal multi-head mask, q pre-scaled by ``H**-0.5``, vmapped over the
  local batch); its decode steps use the lab's paged decode kernel.
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (causal; a decode step with the cache's
  valid length).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lab.core.attention import Attention, check_backend
from lab.core.rules import ShardingRules

HEADS = ("batch", None, "heads", "head_dim")
KV_HEADS = ("batch", None, "kv_heads", "head_dim")


def platform(mesh: Mesh | None) -> str:
    """The platform of the devices the program is built for (a TPU target's devices say ``tpu``)."""
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def _sharded(fn, rules: ShardingRules, mesh: Mesh | None, n_scalars: int = 0, *, check_vma: bool = True):
    """``fn(q, k, v, *scalars)`` on each device's own batch and heads (the rules' specs); as is without a mesh.
    ``check_vma=False`` for a kernel whose internal outputs do not say which mesh axes they vary over (JAX's
    splash kernel builds its ``ShapeDtypeStruct`` s without one); the specs still place every operand."""
    if mesh is None:
        return fn
    q_spec, kv_spec = P(*rules.spec(HEADS, "q")), P(*rules.spec(KV_HEADS, "k"))
    specs = (q_spec, kv_spec, kv_spec, *(P(),) * n_scalars)
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=check_vma)


def _splash(q, k, v, block_q: int, block_k: int):
    """Causal splash attention of one device's q ``[b, T, n, H]`` over k, v ``[b, S, k, H]``."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    _, t, n, h = q.shape
    s = k.shape[1]
    mask = sm.MultiHeadMask([sm.CausalMask((t, s)) for _ in range(n)])
    sizes = sk.BlockSizes(
        block_q=block_q,
        block_kv=block_k,
        block_kv_compute=block_k,
        block_q_dkv=block_q,
        block_kv_dkv=block_k,
        block_kv_dkv_compute=block_k,
        block_q_dq=block_q,
        block_kv_dq=block_k,
    )
    kernel = sk.make_splash_mha_single_device(mask=mask, block_sizes=sizes)
    heads_major = (0, 2, 1, 3)
    qh = (q * jnp.asarray(h**-0.5, q.dtype)).transpose(heads_major)
    o = jax.vmap(kernel)(qh, k.transpose(heads_major), v.transpose(heads_major))
    return o.transpose(heads_major)


def attend(q, k, v, att: Attention, rules: ShardingRules, mesh: Mesh | None) -> jax.Array:
    """Causal grouped-query attention of q ``[B, T, N, H]`` over k, v ``[B, S, K, H]`` by the kernel ``att``."""
    where = platform(mesh)
    check_backend(att.impl, where)
    block_q, block_k = att.blocks(q.shape[1], k.shape[1])
    if att.impl == "pallas":
        from kernels.pallas.flash_attention import flash_attention

        fn = functools.partial(flash_attention, causal=True, block_q=block_q, block_k=block_k, interpret=where == "cpu")
    elif att.impl == "splash":
        fn = functools.partial(_splash, block_q=block_q, block_k=block_k)
    else:  # cudnn
        fn = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
    return _sharded(fn, rules, mesh, check_vma=att.impl != "splash")(q, k, v)


def attend_cache(q, ck, cv, pos, att: Attention, rules: ShardingRules, mesh: Mesh | None) -> jax.Array:
    """One decode step: q ``[B, 1, N, H]`` over the cache ``[B, S, K, H]``, positions ``<= pos`` visible."""
    where = platform(mesh)
    check_backend(att.impl, where)
    page = att.blocks(1, ck.shape[1])[1]
    if att.impl == "cudnn":

        def fn(q, ck, cv, pos):
            lengths = jnp.full((q.shape[0],), pos + 1, jnp.int32)
            return jax.nn.dot_product_attention(q, ck, cv, key_value_seq_lengths=lengths, implementation="cudnn")

    else:
        from kernels.pallas.paged_decode import paged_decode

        def fn(q, ck, cv, pos):
            b, s, kv, h = ck.shape
            pages = s // page
            table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)  # sequence i's pages, in order
            lengths = jnp.full((b,), pos + 1, jnp.int32)

            def as_pages(c):
                return c.reshape(b * pages, page, kv, h)

            o = paged_decode(q[:, 0], as_pages(ck), as_pages(cv), table, lengths, interpret=where == "cpu")
            return o[:, None]

    return _sharded(fn, rules, mesh, n_scalars=1)(q, ck, cv, pos)


__all__ = ["attend", "attend_cache", "platform"]
