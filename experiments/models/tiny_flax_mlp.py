"""A small flax nnx model for `experiments/user_flax_mlp.toml`: the user's own code, as a flax user writes it.

Two MLP blocks with a residual, weights annotated with logical axis names (``nnx.with_partitioning``) that the
experiment's [rules] map to mesh axes. ``build(sizes)`` returns the module and its inputs as
``(shape, dtype, logical axes)``; shardlab builds it abstractly, shards it, and compiles, audits, profiles and
reports one train step of it.
"""

import jax
import jax.numpy as jnp
from flax import nnx


class Block(nnx.Module):
    def __init__(self, d: int, f: int, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, f, use_bias=False, kernel_init=nnx.with_partitioning(init, ("embed", "ffw")), rngs=rngs)
        self.down = nnx.Linear(
            f, d, use_bias=False, kernel_init=nnx.with_partitioning(init, ("ffw", "embed")), rngs=rngs
        )

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class TinyMLP(nnx.Module):
    def __init__(self, d: int, f: int, blocks: int, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(d, f, rngs) for _ in range(blocks)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def build(sizes):
    model = TinyMLP(sizes["d"], sizes["f"], sizes.get("blocks", 2), rngs=nnx.Rngs(0))
    return model, [((sizes["batch"], sizes["d"]), jnp.float32, ("batch", "act_embed"))]
