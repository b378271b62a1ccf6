"""Ring attention: causal attention with the sequence sharded over a mesh axis named ``context``.

``q, k, v [B_data, T_context, H, D] -> Out[B_data, T_context, H, D]``. Each device keeps its query block and the
key and value blocks travel round the context ring: K and V are stacked once into one ``[2, B/data, T/c, H, D]``
block, and each of the ``c - 1`` ring steps moves that block one device to the right (``ppermute``) while the
device attends its queries to the block it holds. After ``s`` steps device ``i`` holds the keys and values of
sequence block ``(i - s) % c``; it starts with its own (the diagonal block, so every query row has a key to
attend to from the first step on).

The softmax is online (Milakov and Gimelshein; flash attention): a running max ``m``, running sum ``l`` and
running output ``o`` per query row, all float32, rescaled as each block arrives; the products accumulate in
float32 (``preferred_element_type``), so bf16 inputs round once, at the end.

Causal masking is by global position: query ``i * T/c + r`` sees key ``j * T/c + r'`` when it is not later. A
block entirely in the future (``j > i``) contributes nothing: its update is dropped by a select on the running
state. The device still computes it (which blocks are in the future depends on the device, and the program is the
same on every device), and still passes it on, so the collective pattern is fixed: ``c - 1`` permutes of
``2 * B/data * T/c * H * D`` elements each. The compiled dots therefore do the work of non-causal attention; the
causal saving is not realised by this layout (a zigzag layout would balance it).

The ring is a Python loop (unrolled at trace time); the compute of each block runs in ``jax.named_scope``
``attention/ring``, each pass in ``ring_step_{s}``. A context axis of size 1 degenerates to one local block.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lab.core.errors import UserError
from lab.core.programs import ATTENTION_AXES, check_attention_sizes

DATA, CONTEXT = ATTENTION_AXES
SCOPE = "attention/ring"

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def qkv_spec(mesh: Mesh) -> P:
    """``[B_data, T_context, H, D]``: the layout of q, k, v and the output (B replicated without a data axis)."""
    return P(DATA if DATA in mesh.axis_names else None, CONTEXT, None, None)


def _shift_right(n: int) -> list[tuple[int, int]]:
    """Device ``j`` sends to ``j + 1`` round a ring of ``n``."""
    return [(j, (j + 1) % n) for j in range(n)]


def _require_context(mesh: Mesh) -> None:
    if CONTEXT not in mesh.axis_names:
        raise UserError(
            f"ring_attention needs a mesh axis named {CONTEXT!r}; the mesh has {', '.join(mesh.axis_names)}. "
            f'Give a missing axis size 1, e.g. {{"{DATA}": 2, "{CONTEXT}": 4}}'
        )


def ring_attention(mesh: Mesh, *, causal: bool = True) -> AttentionFn:
    """The jitted ``shard_map`` program ``(q, k, v) -> out`` over the mesh's ``context`` axis (module docstring)."""
    _require_context(mesh)
    n = mesh.shape[CONTEXT]
    spec = qkv_spec(mesh)

    def body(q_block, k_block, v_block):
        # q_block, k_block, v_block [B/data, T/c, H, D]
        tc, d = q_block.shape[1], q_block.shape[3]
        scale = 1.0 / math.sqrt(d)
        i = jax.lax.axis_index(CONTEXT)
        q_pos = i * tc + jnp.arange(tc)  # global positions of this device's queries
        kv_block = jnp.stack([k_block, v_block])  # [2, B/data, T/c, H, D]: one block travels, not two
        # running max and sum [B/data, H, T/c] and output [B/data, H, T/c, D] per query row, float32
        run_max = run_sum = run_out = None
        for s in range(n):
            next_block = None
            if s < n - 1:
                with jax.named_scope(f"ring_step_{s}"):
                    next_block = jax.lax.ppermute(kv_block, CONTEXT, _shift_right(n))
            with jax.named_scope(SCOPE):
                j = (i - s) % n  # the sequence block held now
                scores = scale * jnp.einsum(
                    "bqhd,bkhd->bhqk", q_block, kv_block[0], preferred_element_type=jnp.float32
                )  # [B/data, H, T/c, T/c]
                if causal:
                    k_pos = j * tc + jnp.arange(tc)
                    scores = jnp.where(q_pos[:, None] >= k_pos[None, :], scores, -jnp.inf)
                block_max = jnp.max(scores, axis=-1)
                new_max = block_max if run_max is None else jnp.maximum(run_max, block_max)
                p = jnp.exp(scores - new_max[..., None])  # [B/data, H, T/c, T/c]
                pv = jnp.einsum(
                    "bhqk,bkhd->bhqd", p.astype(kv_block.dtype), kv_block[1], preferred_element_type=jnp.float32
                )
                if run_max is None:  # the diagonal block: every query row has at least one key
                    run_max, run_sum, run_out = new_max, jnp.sum(p, axis=-1), pv
                else:
                    alpha = jnp.exp(run_max - new_max)
                    new = (new_max, alpha * run_sum + jnp.sum(p, axis=-1), alpha[..., None] * run_out + pv)
                    if causal:  # a block entirely in the future: computed, passed on, its update dropped
                        past = j <= i
                        new = tuple(
                            jnp.where(past, a, b) for a, b in zip(new, (run_max, run_sum, run_out), strict=True)
                        )
                    run_max, run_sum, run_out = new
            if next_block is not None:
                kv_block = next_block
        out = run_out / run_sum[..., None]  # [B/data, H, T/c, D]
        return jnp.transpose(out, (0, 2, 1, 3)).astype(q_block.dtype)  # [B/data, T/c, H, D]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec))


def reference_attention(q, k, v, causal: bool = True) -> np.ndarray:
    """Single-device attention ``softmax(q k^T / sqrt(D)) v`` over ``[B, T, H, D]``, in float32."""
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    t, d = q.shape[1], q.shape[3]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / math.sqrt(d)
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    w = jax.nn.softmax(scores, axis=-1)
    return np.asarray(jnp.einsum("bhqk,bkhd->bqhd", w, v, precision="highest"))


def check_mesh(mesh: Mesh, sizes: Mapping[str, int]) -> None:
    """The sizes against a JAX mesh: T divides over ``context``, B over ``data`` (a UserError naming them)."""
    _require_context(mesh)
    check_attention_sizes("ring_attention", dict(mesh.shape), sizes)


__all__ = ["CONTEXT", "DATA", "SCOPE", "check_mesh", "qkv_spec", "reference_attention", "ring_attention"]
