"""Pipeline parallelism, circular (interleaved) schedule: L residual MLP blocks in p x V chunks over ``pipe``.

The layers are cut into ``p * V`` chunks of ``Lc = L / (p V)`` consecutive layers. Stage ``i`` of the ``p`` on
``pipe`` holds V of them, chunks ``i, p + i, 2p + i, ...`` (chunk ``r * p + i`` is its r-th, its "repeat" r): a
microbatch goes round the ring of stages V times, and each stage's V chunks are V non-adjacent pieces of the
model, as in Megatron's interleaved 1F1B and MaxText's circular pipeline. Weights stack as ``W1 [p, V, Lc, D, F]``,
``W2 [p, V, Lc, F, D]`` over ``pipe``; the batch ``x [B, D]`` is split over ``data`` and cut into M microbatches
of ``b = B / (data * M)`` rows; M is a multiple of p (Megatron's condition for interleaving).

The schedule: the work is ``M V`` items, item ``j`` being microbatch ``j mod p + p * (j // (p V))`` at repeat
``(j // p) mod V`` (microbatches go round in groups of p). In step ``s`` of ``M V + p - 1`` stage ``i`` runs its
chunk of the repeat of item ``s - i`` (idle on zeros when there is none), then every stage passes what it holds
to the next with one ``ppermute`` over ``pipe`` that wraps around: the last stage's output of repeat r < V - 1 is
stage 0's input for repeat r + 1 in the next step (item ``j`` follows item ``j - p``), and stage 0 takes a fresh
microbatch at repeat 0. Each stage idles ``p - 1`` of the ``M V + p - 1`` steps: the bubble ``(p - 1) / (V M)``
of the work, V times smaller than GPipe's at the same M. The loss is the mean square of the last stage's outputs
at repeat V - 1; :func:`circular_mlp` is the train step, ``jax.value_and_grad`` through the ``shard_map`` (its
backward runs the schedule in reverse, the permutes transposed) and plain SGD, as :mod:`kernels.pipeline`'s.

Which chunk a stage runs in step ``s`` depends on the stage, so it is chosen on the device: the stages of one
step span at most two repeats (p consecutive items), and each layer's weights are selected between those two with
``jnp.where`` (an elementwise select of ``[D, F]``, no matmul). :func:`reference_loss` is the same layers in order
on one device.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels.pipeline import DATA, LEARNING_RATE, PIPE, StepFn, _block, batch_spec, train_step_program
from kernels.program import Built
from lab.core.errors import UserError
from lab.core.programs import check_circular_sizes

SCOPE = "pipeline/stage"


def weight_spec() -> P:
    """``W[p_pipe, V, Lc, ., .]``: each stage holds its V chunks."""
    return P(PIPE, None, None, None, None)


def check_mesh(mesh: Mesh, sizes: Mapping[str, int]) -> None:
    """The sizes against a JAX mesh (a UserError naming the value and one that would do, before compiling)."""
    if PIPE not in mesh.axis_names:
        raise UserError(
            f"pipeline_circular needs a mesh axis named {PIPE!r}; the mesh has {', '.join(mesh.axis_names)}. "
            f'Give it, e.g. {{"{DATA}": 2, "{PIPE}": 4}}'
        )
    check_circular_sizes("pipeline_circular", dict(mesh.shape), dict(sizes))


def item(j: int, p: int, v: int) -> tuple[int, int]:
    """Item ``j`` of the schedule: ``(microbatch, repeat)``."""
    return j % p + p * (j // (p * v)), (j // p) % v


def _ring(n: int) -> list[tuple[int, int]]:
    """Stage ``j`` sends to ``j + 1``, the last to the first."""
    return [(j, (j + 1) % n) for j in range(n)]


def _weights(chunks, s: int, i, p: int, v: int, n_items: int):
    """Stage ``i``'s layers in step ``s``: its chunk for the repeat of item ``s - i``, selected on the device
    between the (at most two) repeats the step's stages span."""
    repeats = sorted({item(s - k, p, v)[1] for k in range(p) if 0 <= s - k < n_items})
    if len(repeats) == 1:
        return chunks[repeats[0]]
    first, second = repeats
    use_first = ((s - i) // p) % v == first
    return [
        (jnp.where(use_first, a1, a2), jnp.where(use_first, c1, c2))
        for (a1, c1), (a2, c2) in zip(chunks[first], chunks[second], strict=True)
    ]


def _loss_body(p: int, m: int, v: int, data: int | None):
    """The per-device circular forward and loss (module docstring); ``data``: the data axis's size (None: none)."""
    has_data = data is not None
    axes = (DATA, PIPE) if has_data else (PIPE,)
    n_items = m * v

    def body(w1, w2, x):
        w1, w2 = w1[0], w2[0]  # [V, Lc, D, F], [V, Lc, F, D]: this stage's chunks
        if has_data:  # once here: the gradient's sum over data is one psum per weight
            w1, w2 = jax.lax.pcast((w1, w2), DATA, to="varying")
        chunks = [[(w1[r, k], w2[r, k]) for k in range(w1.shape[1])] for r in range(v)]
        i = jax.lax.axis_index(PIPE)
        rows, d = x.shape[0] // m, x.shape[1]
        micro = x.reshape(m, rows, d)
        held = None  # what the previous stage passed
        squares = jnp.zeros((), jnp.float32)
        for s in range(n_items + p - 1):
            with jax.named_scope(SCOPE), jax.named_scope(f"step_{s}"):
                if s < n_items and item(s, p, v)[1] == 0:  # stage 0 starts a fresh microbatch
                    first = micro[item(s, p, v)[0]]
                    h = first if held is None else jnp.where(i == 0, first, held)
                else:  # stage 0 continues what came round the ring
                    h = held
                h = jnp.where((s - i >= 0) & (s - i < n_items), h, jnp.zeros_like(h))  # idle: zeros
                for a, c in _weights(chunks, s, i, p, v, n_items):
                    h = _block(h, a, c)
                last = s - (p - 1)  # the last stage's item: its output counts at the last repeat
                if 0 <= last < n_items and item(last, p, v)[1] == v - 1:
                    squares = squares + jnp.sum(jnp.square(h.astype(jnp.float32)))
            if s < n_items + p - 2:
                with jax.named_scope(f"pipeline/pass_{s}"):
                    held = jax.lax.ppermute(h, PIPE, _ring(p))
        total = jax.lax.psum(jnp.where(i == p - 1, squares, 0.0), axes)
        return total / (x.shape[0] * (data or 1) * d)

    return body


def circular_loss(mesh: Mesh, microbatches: int, repeats: int):
    """The ``shard_map`` loss ``(w1, w2, x) -> mean square of the outputs`` (not jitted)."""
    body = _loss_body(mesh.shape[PIPE], microbatches, repeats, mesh.shape.get(DATA))
    w = weight_spec()
    return jax.shard_map(body, mesh=mesh, in_specs=(w, w, batch_spec(mesh)), out_specs=P())


def circular_mlp(mesh: Mesh, microbatches: int, repeats: int, *, learning_rate: float = LEARNING_RATE) -> StepFn:
    """The jitted train step ``(w1, w2, x) -> (loss, w1', w2')``: value and gradient through the shard_map, SGD."""
    loss_fn = circular_loss(mesh, microbatches, repeats)
    w_sh = NamedSharding(mesh, weight_spec())

    def step(w1, w2, x):
        loss, (g1, g2) = jax.value_and_grad(loss_fn, argnums=(0, 1))(w1, w2, x)
        return loss, w1 - learning_rate * g1, w2 - learning_rate * g2

    return jax.jit(step, out_shardings=(NamedSharding(mesh, P()), w_sh, w_sh))


# ----- weights, the reference, the registry's builder --------------------------------------------------------


def stack_chunks(layers: np.ndarray, p: int, v: int) -> np.ndarray:
    """Per-layer ``[L, ...]`` -> ``[p, V, Lc, ...]``: stage ``i``'s repeat ``r`` is chunk ``r p + i``."""
    layers = np.asarray(layers)
    lc = layers.shape[0] // (p * v)
    return layers.reshape(v, p, lc, *layers.shape[1:]).swapaxes(0, 1)


def unstack_chunks(stacked) -> jax.Array:
    """The inverse of :func:`stack_chunks`: the layers in model order, ``[L, ...]``."""
    p, v, lc = stacked.shape[:3]
    return jnp.swapaxes(stacked, 0, 1).reshape(p * v * lc, *stacked.shape[3:])


def init_inputs(sizes: Mapping[str, int], p: int, dtype=np.float32, seed: int = 0):
    """Chunk-stacked weights and a batch, drawn as :func:`kernels.pipeline.init_inputs` draws them."""
    b, d, f, n_layers, v = (int(sizes[k]) for k in ("B", "D", "F", "L", "V"))
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((n_layers, d, f), dtype=np.float32) / np.sqrt(d)
    w2 = rng.standard_normal((n_layers, f, d), dtype=np.float32) / np.sqrt(f * n_layers)
    x = rng.standard_normal((b, d), dtype=np.float32)
    return tuple(a.astype(dtype) for a in (stack_chunks(w1, p, v), stack_chunks(w2, p, v), x))


def reference_loss(w1, w2, x) -> jax.Array:
    """On one device, float32: every layer in model order, the mean square of the output."""
    h = jnp.asarray(x, jnp.float32)
    w1, w2 = unstack_chunks(jnp.asarray(w1, jnp.float32)), unstack_chunks(jnp.asarray(w2, jnp.float32))
    for a, c in zip(w1, w2, strict=True):
        h = _block(h, a, c, precision="highest")
    return jnp.mean(jnp.square(h))


def reference_step(w1, w2, x, *, learning_rate: float = LEARNING_RATE):
    """What the train step returns, on one device: the loss and the SGD-updated stacked weights."""
    loss, (g1, g2) = jax.value_and_grad(reference_loss, argnums=(0, 1))(w1, w2, x)
    w1, w2 = np.asarray(w1, np.float32), np.asarray(w2, np.float32)
    return np.asarray(loss), w1 - learning_rate * np.asarray(g1), w2 - learning_rate * np.asarray(g2)


def build(mesh: Mesh, sizes: Mapping[str, int], dtype, seed: int = 0) -> Built:
    """The registry's program: the circular train step on ``mesh``, its inputs placed on demand, the reference,
    and the updated weights carried from one call to the next."""
    check_mesh(mesh, sizes)
    b, d, f, n_layers, m, v = (int(sizes[k]) for k in ("B", "D", "F", "L", "M", "V"))
    p = mesh.shape[PIPE]
    lc = n_layers // (p * v)
    shapes = [(p, v, lc, d, f), (p, v, lc, f, d), (b, d)]
    shardings = [NamedSharding(mesh, weight_spec())] * 2 + [NamedSharding(mesh, batch_spec(mesh))]
    host = lambda: init_inputs(sizes, p, dtype, seed)  # noqa: E731
    return train_step_program(circular_mlp(mesh, m, v), shapes, shardings, dtype, host, reference_step)


__all__ = [
    "SCOPE",
    "build",
    "check_mesh",
    "circular_loss",
    "circular_mlp",
    "init_inputs",
    "item",
    "reference_loss",
    "reference_step",
    "stack_chunks",
    "unstack_chunks",
    "weight_spec",
]
