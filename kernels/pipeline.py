"""Pipeline parallelism: a stack of L residual MLP blocks in stages over a mesh axis named ``pipe``, GPipe schedule.

Each block is ``h + W2 gelu(W1 h)`` with ``W1 [D, F]``, ``W2 [F, D]``. Stage ``i`` of the ``p`` on ``pipe`` holds
``split[i]`` consecutive layers (default ``L / p`` each); every stage is padded with identity layers to the largest,
``Lmax`` (zero weights make a residual block the identity, and keep its gradients zero), so the weights stack as
``W1 [p, Lmax, D, F]`` and ``W2 [p, Lmax, F, D]`` sharded over ``pipe`` on their first dim. The batch ``x [B, D]``
is split over ``data`` (replicated over ``pipe``; only stage 0 reads it), and each device cuts its ``B / data``
rows into M microbatches of ``b = B / (data * M)`` rows.

The schedule (GPipe, all forwards then all backwards): for step ``s`` in ``0 .. M + p - 2`` every stage runs its
``Lmax`` layers on what it holds (stage ``i`` works on microbatch ``s - i`` when ``0 <= s - i < M``; otherwise it
idles on zeros, computed like any step: the program is the same on every device), then passes its activation to
stage ``i + 1`` with one ``ppermute`` over ``pipe`` (a shift by one, no wrap-around). The last stage's output is
collected, not passed, and after the last step nothing is passed (nobody would receive it): ``M + p - 2`` permutes
of ``[b, D]``. The loss is the mean square of the last stage's outputs (float32, summed over ``data`` and ``pipe``
with one scalar psum). :func:`pipeline_mlp` is the train step: ``jax.value_and_grad`` of that loss through the
``shard_map`` (the backward's permutes are the forward's transposed: another ``M + p - 2`` of ``[b, D]``
cotangents, the other way), then plain SGD. The weights are cast to varying over ``data`` once, at the top, so
their gradients are summed over ``data`` by one psum each (the data-parallel AllReduce), not once per use.

The steps and layers are Python loops (unrolled at trace time); each step's compute runs in ``jax.named_scope``
``pipeline/stage/step_{s}`` (the step, so a trace tells the bubble's compute from the work:
``lab.measure.bubble``), each pass in ``pipeline/pass_{s}``. :func:`reference_loss` is the same layers in sequence on
one device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels.program import Built
from lab.core.errors import UserError
from lab.core.programs import PIPELINE_AXES, check_pipeline_sizes

DATA, PIPE = PIPELINE_AXES
SCOPE = "pipeline/stage"
LEARNING_RATE = 1e-2

StepFn = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]


def weight_spec() -> P:
    """``W[p_pipe, Lmax, ., .]``: each stage holds its own (padded) layers."""
    return P(PIPE, None, None, None)


def batch_spec(mesh: Mesh) -> P:
    """``x[B_data, D]`` (B replicated without a data axis)."""
    return P(DATA if DATA in mesh.axis_names else None, None)


def _require_pipe(mesh: Mesh) -> None:
    if PIPE not in mesh.axis_names:
        raise UserError(
            f"pipeline_mlp needs a mesh axis named {PIPE!r}; the mesh has {', '.join(mesh.axis_names)}. "
            f'Give a missing axis size 1, e.g. {{"{DATA}": 2, "{PIPE}": 4}}'
        )


def check_mesh(mesh: Mesh, sizes: Mapping[str, int], split: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The sizes and split against a JAX mesh (a UserError naming them, before anything compiles); the split."""
    _require_pipe(mesh)
    return check_pipeline_sizes("pipeline_mlp", dict(mesh.shape), dict(sizes), split)


def _block(h: jax.Array, w1: jax.Array, w2: jax.Array, precision=None) -> jax.Array:
    """One residual MLP block ``h + W2 gelu(W1 h)`` (rows of h)."""
    return h + jnp.dot(jax.nn.gelu(jnp.dot(h, w1, precision=precision)), w2, precision=precision)


def _shift(n: int) -> list[tuple[int, int]]:
    """Stage ``j`` sends to ``j + 1``; the last stage sends nothing (no ring)."""
    return [(j, j + 1) for j in range(n - 1)]


def _loss_body(p: int, m: int, data: int | None):
    """The per-device GPipe forward and loss (module docstring); ``data``: the data axis's size (None: no axis)."""
    has_data = data is not None
    axes = (DATA, PIPE) if has_data else (PIPE,)

    def body(w1, w2, x):
        # w1 [1, Lmax, D, F], w2 [1, Lmax, F, D]: this stage's layers; x [B/data, D]
        w1, w2 = w1[0], w2[0]
        if has_data:  # once here, so the gradient's sum over data is one psum per weight (the transpose of this)
            w1, w2 = jax.lax.pcast((w1, w2), DATA, to="varying")
        # each layer sliced once, here: its gradient is summed over the steps as [D, F], then placed in the stack
        # once (a slice inside the loop would pad every step's contribution to the whole stack)
        layers = [(w1[k], w2[k]) for k in range(w1.shape[0])]
        i = jax.lax.axis_index(PIPE)
        rows, d = x.shape[0] // m, x.shape[1]
        if rows * m != x.shape[0]:
            raise UserError(f"pipeline_mlp: {x.shape[0]} rows per device do not cut into M={m} microbatches")
        micro = x.reshape(m, rows, d)
        held = None  # the activation received from the previous stage
        squares = jnp.zeros((), jnp.float32)
        for s in range(m + p - 1):
            with jax.named_scope(SCOPE), jax.named_scope(f"step_{s}"):
                first = micro[min(s, m - 1)]  # stage 0's input
                h = first if held is None else jnp.where(i == 0, first, held)
                h = jnp.where((s - i >= 0) & (s - i < m), h, jnp.zeros_like(h))  # idle: zeros
                for a, c in layers:
                    h = _block(h, a, c)
                if s >= p - 1:  # the last stage finishes microbatch s - p + 1 (counted on the last stage only)
                    squares = squares + jnp.sum(jnp.square(h.astype(jnp.float32)))
            if s < m + p - 2 and p > 1:
                with jax.named_scope(f"pipeline/pass_{s}"):
                    held = jax.lax.ppermute(h, PIPE, _shift(p))
        total = jax.lax.psum(jnp.where(i == p - 1, squares, 0.0), axes)
        return total / (x.shape[0] * (data or 1) * d)  # the mean over all B x D outputs

    return body


def pipeline_loss(mesh: Mesh, microbatches: int) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """The ``shard_map`` loss ``(w1, w2, x) -> mean square of the last stage's outputs`` (not jitted)."""
    _require_pipe(mesh)
    body = _loss_body(mesh.shape[PIPE], microbatches, mesh.shape.get(DATA))
    w = weight_spec()
    return jax.shard_map(body, mesh=mesh, in_specs=(w, w, batch_spec(mesh)), out_specs=P())


def pipeline_mlp(mesh: Mesh, microbatches: int, *, learning_rate: float = LEARNING_RATE) -> StepFn:
    """The jitted GPipe train step ``(w1, w2, x) -> (loss, w1', w2')``: value and gradient through the shard_map,
    then ``w - learning_rate * grad``."""
    loss_fn = pipeline_loss(mesh, microbatches)
    w_sh = NamedSharding(mesh, weight_spec())

    def step(w1, w2, x):
        loss, (g1, g2) = jax.value_and_grad(loss_fn, argnums=(0, 1))(w1, w2, x)
        return loss, w1 - learning_rate * g1, w2 - learning_rate * g2

    return jax.jit(step, out_shardings=(NamedSharding(mesh, P()), w_sh, w_sh))


# ----- weights, the reference, the registry's builder --------------------------------------------------------


def stack_layers(w1_layers, w2_layers, split: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer ``W1 [L, D, F]``, ``W2 [L, F, D]`` -> stage-stacked ``[p, Lmax, D, F]``, ``[p, Lmax, F, D]``: stage
    ``i`` holds the next ``split[i]`` layers, then zero (identity) layers up to ``Lmax = max(split)``."""
    w1_layers, w2_layers = np.asarray(w1_layers), np.asarray(w2_layers)
    lmax = max(split)
    w1 = np.zeros((len(split), lmax, *w1_layers.shape[1:]), w1_layers.dtype)
    w2 = np.zeros((len(split), lmax, *w2_layers.shape[1:]), w2_layers.dtype)
    start = 0
    for stage, n in enumerate(split):
        w1[stage, :n], w2[stage, :n] = w1_layers[start : start + n], w2_layers[start : start + n]
        start += n
    return w1, w2


def init_inputs(sizes: Mapping[str, int], split: tuple[int, ...], dtype=np.float32, seed: int = 0):
    """Stage-stacked weights and a batch: ``W1 ~ N(0, 1/D)``, ``W2 ~ N(0, 1/(F L))`` (so L residual blocks keep
    activations of order one), ``x`` standard normal; padding layers zero."""
    b, d, f, n_layers = (int(sizes[k]) for k in ("B", "D", "F", "L"))
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((n_layers, d, f), dtype=np.float32) / np.sqrt(d)
    w2 = rng.standard_normal((n_layers, f, d), dtype=np.float32) / np.sqrt(f * n_layers)
    x = rng.standard_normal((b, d), dtype=np.float32)
    return tuple(a.astype(dtype) for a in (*stack_layers(w1, w2, split), x))


def reference_loss(w1, w2, x, split: tuple[int, ...]) -> jax.Array:
    """On one device, float32: the real layers of the stacked weights in sequence (stage by stage, the first
    ``split[i]`` of stage ``i``), the mean square of the output. Differentiable in ``w1``, ``w2``."""
    h = jnp.asarray(x, jnp.float32)
    w1, w2 = jnp.asarray(w1, jnp.float32), jnp.asarray(w2, jnp.float32)
    for stage, n in enumerate(split):
        for layer in range(n):
            h = _block(h, w1[stage, layer], w2[stage, layer], precision="highest")
    return jnp.mean(jnp.square(h))


def reference_grads(w1, w2, x, split: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reference's loss and its gradients in the stacked layout (zero on padding layers), as numpy."""
    loss, (g1, g2) = jax.value_and_grad(reference_loss, argnums=(0, 1))(w1, w2, x, split)
    return np.asarray(loss), np.asarray(g1), np.asarray(g2)


def reference_step(w1, w2, x, *, split: tuple[int, ...], learning_rate: float = LEARNING_RATE):
    """What the train step returns, on one device: the loss and the SGD-updated stacked weights."""
    loss, g1, g2 = reference_grads(w1, w2, x, split)
    return loss, np.asarray(w1, np.float32) - learning_rate * g1, np.asarray(w2, np.float32) - learning_rate * g2


def train_step_program(step: StepFn, shapes: list, shardings: list, dtype, host, reference) -> Built:
    """A pipelined train step as the registry builds it: ``(w1, w2, x)`` of ``shapes`` placed with ``shardings``
    on demand from ``host()``, the reference, and the updated weights carried from one call to the next (the
    circular schedule's builder shares it)."""
    abstract = tuple(jax.ShapeDtypeStruct(s, dtype, sharding=sh) for s, sh in zip(shapes, shardings, strict=True))

    def place():
        return tuple(jax.device_put(a, sh) for a, sh in zip(host(), shardings, strict=True))

    def carry(out, args):  # train on: the next call starts from the updated weights
        return out[1], out[2], args[2]

    return Built(step, abstract, place, host_args=host, reference=reference, carry=carry)


def build(mesh: Mesh, sizes: Mapping[str, int], dtype, seed: int = 0, split: tuple[int, ...] | None = None) -> Built:
    """The registry's program: the train step on ``mesh`` with its inputs (:func:`init_inputs`) placed on demand,
    the reference, and the updated weights carried from one call to the next."""
    split = check_mesh(mesh, sizes, split)
    b, d, f, m = (int(sizes[k]) for k in ("B", "D", "F", "M"))
    p, lmax = len(split), max(split)
    shapes = [(p, lmax, d, f), (p, lmax, f, d), (b, d)]
    shardings = [NamedSharding(mesh, weight_spec())] * 2 + [NamedSharding(mesh, batch_spec(mesh))]

    def reference(w1, w2, x):
        return reference_step(w1, w2, x, split=split)

    return train_step_program(
        pipeline_mlp(mesh, m), shapes, shardings, dtype, lambda: init_inputs(sizes, split, dtype, seed), reference
    )


__all__ = [
    "DATA",
    "LEARNING_RATE",
    "PIPE",
    "SCOPE",
    "batch_spec",
    "build",
    "check_mesh",
    "init_inputs",
    "pipeline_loss",
    "pipeline_mlp",
    "reference_grads",
    "reference_loss",
    "reference_step",
    "stack_layers",
    "train_step_program",
    "weight_spec",
]
