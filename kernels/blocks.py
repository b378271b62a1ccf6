"""Composite kernels: a Transformer MLP block under Megatron tensor parallelism.

``tp_mlp``: ``In[B_X, D] * Win[D, F_Y] -> H[B_X, F_Y]`` (column split, no communication), GeLU, then
``H[B_X, F_Y] * Wout[F_Y, D] -> Out[B_X, D]`` (row split: partial sums, ``AllReduce_Y``). Batch over X,
the MLP's hidden dim over Y; the one collective per block is the AllReduce the training estimator
charges tensor parallelism for.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lab.core.programs import MLP_NOTATION

X, Y = "X", "Y"
TP_MLP_NOTATION = MLP_NOTATION  # In[B_X, D] * Win[D, F_Y] -> H[B_X, F_Y]; H * Wout[F_Y, D] -> Out[B_X, D]
TP_MLP_SPECS = (
    P(X, None),  # In[B_X, D]
    P(None, Y),  # Win[D, F_Y]: column-parallel
    P(Y, None),  # Wout[F_Y, D]: row-parallel
)
TP_MLP_OUT = P(X, None)  # Out[B_X, D]


def tp_mlp(mesh: Mesh):
    """The block as one jitted ``shard_map``."""

    def body(x_block, win_block, wout_block):
        # x_block [B/X, D], win_block [D, F/Y], wout_block [F/Y, D]
        with jax.named_scope("mlp/up"):
            h_block = jax.nn.gelu(x_block @ win_block)  # [B/X, F/Y]
        with jax.named_scope("mlp/down"):
            partial = h_block @ wout_block  # [B/X, D]{U_Y}
        with jax.named_scope("allreduce_out"):
            return jax.lax.psum(partial, Y)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=TP_MLP_SPECS, out_specs=TP_MLP_OUT))


def reference_tp_mlp(x: np.ndarray, win: np.ndarray, wout: np.ndarray) -> np.ndarray:
    """Single-device answer."""
    return np.asarray(jax.nn.gelu(jnp.asarray(x) @ jnp.asarray(win)) @ jnp.asarray(wout))
