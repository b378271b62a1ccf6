"""The Transformer's training loss: next-token cross entropy of the model's logits, through a GPipe pipeline when
the rules put the layers on a mesh axis (``model``'s docstring, *Pipeline*)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kernels.transformer.model import (
    PRESETS,
    RESIDUAL,
    Params,
    ShardingRules,
    _embed,
    _forward,
    _layer_body,
    _Layout,
    _logits,
    compute_dtype,
)
from lab.core.attention import Attention
from lab.core.models import ModelConfig
from lab.core.programs import MOE_CAPACITY_FACTOR


def loss_fn(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    rules: ShardingRules | None = None,
    mesh: Mesh | None = None,
    remat: str = "none",
    dtype: str = "float32",
    microbatches: int = 1,
    capacity_factor: float = MOE_CAPACITY_FACTOR,
    moe_groups: tuple[int, int] = (1, 1),
    interleave: int = 1,
    stage_split: tuple[int, ...] = (),
    attention: Attention | None = None,
) -> jax.Array:
    """Mean next-token cross entropy (float32): position t predicts token t+1; the last position is masked.

    The target logit is picked with a one-hot product rather than a gather, so vocab-sharded logits reduce
    with one AllReduce over the vocab axes (Megatron's vocab-parallel cross entropy) instead of a gather.
    With the rules' ``layers`` on a mesh axis the loss runs through the GPipe pipeline of
    :func:`pipelined_loss`, the batch cut into ``microbatches`` (``interleave`` > 1: the circular schedule, its
    stacked layers stored as :func:`interleaved_order` says; ``stage_split``: each stage's real layers, its stacked
    rows past them padding the pipeline skips, :func:`split_order`). A mixture of experts routes with
    ``capacity_factor``; without a mesh, ``moe_groups`` (along B, along T) routes the tokens in the groups a
    mesh's devices would (the single-device reference of a sharded run).
    """
    lay = _Layout(
        rules or PRESETS["single"],
        mesh,
        compute_dtype(dtype),
        capacity_factor=capacity_factor,
        moe_groups=tuple(moe_groups),
        stage_split=tuple(stage_split),
        attention=attention or Attention(),
    )
    if mesh is not None and pipeline_stages(lay.rules, mesh) > 1:
        if interleave > 1:
            return circular_loss(params, tokens, cfg, lay, remat, microbatches, interleave)
        return pipelined_loss(params, tokens, cfg, lay, remat, microbatches)
    return _xent(_forward(params, tokens, cfg, lay, remat)[0], tokens, lay)


def _xent(logits: jax.Array, tokens: jax.Array, lay: _Layout | None = None) -> jax.Array:
    """Mean next-token cross entropy of float32 logits ``[B, T, V]`` (the last position masked). The shifted
    targets are pinned whole along T, as the tokens come (``lay``), so a context shard takes its own slice of them
    instead of the partitioner shifting them across the shards."""
    B, T, V = logits.shape
    targets = jnp.roll(tokens, -1, axis=1)
    if lay is not None:
        targets = lay.constrain(targets, ("batch", None))
    mask = (jnp.arange(T) < T - 1).astype(jnp.float32)  # [T]
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
    target_logit = jnp.sum(logits * jax.nn.one_hot(targets, V, dtype=jnp.float32), axis=-1)
    return jnp.sum((lse - target_logit) * mask) / (B * (T - 1))


def pipeline_stages(rules: ShardingRules, mesh: Mesh | Mapping[str, int]) -> int:
    """How many pipeline stages the rules cut the layers into on this mesh (1: no pipeline)."""
    shape = dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh)
    return rules.size("layers", shape)


def pipelined_loss(params, tokens, cfg, lay: _Layout, remat: str, m: int) -> jax.Array:
    """The loss through a GPipe pipeline over the mesh axis of ``layers`` (``model``'s docstring, *Pipeline*).

    A ``shard_map`` manual over that axis and the batch's axes: each stage holds its ``L / p`` layers (the
    stacked weights' leading dim) and each data-parallel replica its sequences; the rest (tensor parallelism) is
    placed by the rules as usual. Every weight is cast to varying over the manual axes once, at the top, so its
    gradient is summed once, after the last microbatch (the data-parallel AllReduce over the batch axes; over the
    stages for the embeddings and the final norm, which every stage holds). The replica's batch is cut into ``m``
    microbatches of every ``m``-th sequence; in step ``s`` of ``m + p - 1`` every stage runs its layers on what
    it holds (stage 0: microbatch ``s``; idle stages on what they hold, which nothing reads) and passes it on with
    one ``ppermute`` (none after the last step). The last stage's outputs go through the final norm, the logits
    and the loss on every stage (the others' on values nothing reads); the loss is the last stage's, summed over
    the replicas.
    """
    return _staged(params, tokens, cfg, lay, remat, m, _gpipe_steps)


def _staged(params, tokens, cfg, lay: _Layout, remat: str, m: int, steps) -> jax.Array:
    """The pipelined loss's ``shard_map`` (:func:`pipelined_loss`): ``steps(params, micro, layer, i, p, inner)``
    runs the schedule on one device and returns the last stage's outputs, microbatch by microbatch."""
    shape = dict(lay.mesh.shape)
    (axis,) = lay.rules.live("layers", shape)
    batch_axes = lay.rules.live("batch", shape)
    p, replicas = shape[axis], lay.rules.size("batch", shape)
    inner = dataclasses.replace(lay, rules=dataclasses.replace(lay.rules, layers=None, batch=None), manual=True)
    stacked = jax.tree.map(lambda _: P(axis), params["layers"])
    specs = {k: (stacked if k == "layers" else jax.tree.map(lambda _: P(), v)) for k, v in params.items()}

    def body(params, tokens):
        B, T = tokens.shape  # this replica's sequences
        i = jax.lax.axis_index(axis)
        if batch_axes:  # the gradients' sum over the replicas: once, the transpose of this
            params = jax.lax.pcast(params, batch_axes, to="varying")
        # the tables every stage holds vary over the stages (only stage 0's lookups and the last stage's logits
        # are read): their gradients, not each microbatch's activations, are what the stages sum
        ends = {k: jax.lax.pcast(params[k], axis, to="varying") for k in params if k != "layers"}
        layer = _layer_body(jnp.arange(T), cfg, inner, remat)
        x = _embed(ends, tokens, cfg, inner)  # [B, T, D]
        micro = x.reshape(B // m, m, T, x.shape[-1])  # microbatch s: sequences s, s + m, ...
        outs = steps(params["layers"], micro, layer, i, p, inner, axis)
        x = inner.constrain(jnp.stack(outs, axis=1).reshape(B, T, -1), RESIDUAL)  # back in the batch's order
        loss = _xent(_logits(ends, x, cfg, inner), tokens) / replicas
        if batch_axes:  # the mean over the replicas' sequences, then the last stage's
            loss = jax.lax.psum(loss, batch_axes)
        return jax.lax.psum(jnp.where(i == p - 1, loss, 0.0), axis)

    in_specs = (specs, P(batch_axes or None))
    return jax.shard_map(body, mesh=lay.mesh, in_specs=in_specs, out_specs=P(), axis_names={axis, *batch_axes})(
        params, tokens
    )


def _gpipe_steps(layers, micro, layer, i, p: int, inner: _Layout, axis: str) -> list:
    """GPipe on one device: in step ``s`` of ``M + p - 1`` stage ``i`` runs its layers on microbatch ``s - i``
    (idle on what it holds otherwise) and passes its output on."""
    m = micro.shape[1]
    if inner.stage_split:  # an uneven split: each stage's rows past its own layers are padding, passed through
        real = jnp.asarray(inner.stage_split)[i]
        plain = layer

        def layer(x, pj):
            w, j = pj
            y, kv = plain(x, w)
            return jnp.where(j < real, y, x), kv

        layers = (layers, jnp.arange(jax.tree.leaves(layers)[0].shape[0]))
    held, outs = None, []
    for s in range(m + p - 1):
        with jax.named_scope("pipeline/stage"), jax.named_scope(f"step_{s}"):
            first = inner.constrain(micro[:, min(s, m - 1)], RESIDUAL)
            h = first if held is None else jnp.where(i == 0, first, held)
            h = jax.lax.scan(layer, h, layers)[0]
        if s >= p - 1:  # the last stage finishes microbatch s - p + 1
            outs.append(h)
        if s < m + p - 2:
            with jax.named_scope(f"pipeline/pass_{s}"):
                held = jax.lax.ppermute(h, axis, [(j, j + 1) for j in range(p - 1)])
    return outs


def split_order(split: tuple[int, ...]) -> np.ndarray:
    """The model layer each stored layer is under an uneven ``stage_split`` (-1: padding): stage ``i`` stores its
    ``split[i]`` layers, then padding up to the largest stage's count."""
    lmax, start, out = max(split), 0, []
    for n in split:
        out += list(range(start, start + n)) + [-1] * (lmax - n)
        start += n
    return np.array(out)


def interleaved_order(layers: int, p: int, v: int) -> np.ndarray:
    """The model layer each stored layer is, under the circular schedule: stage ``i`` holds chunks ``i, p + i, ...,
    (v - 1) p + i`` of ``Lc = L / (p v)`` layers, stored contiguously (its ``v Lc`` rows of the stacked weights, split
    over the stage axis as the even split is), so stored index ``i v Lc + r Lc + l`` is model layer
    ``(r p + i) Lc + l``. ``stacked[np.argsort(order)]`` is the model's order."""
    lc = layers // (p * v)
    return np.array([(r * p + i) * lc + k for i in range(p) for r in range(v) for k in range(lc)])


def _item(j: int, p: int, v: int) -> tuple[int, int]:
    """Item ``j`` of the circular schedule: ``(microbatch, repeat)`` (kernels.pipeline_circular.item's order)."""
    return j % p + p * (j // (p * v)), (j // p) % v


def circular_loss(params, tokens, cfg, lay: _Layout, remat: str, m: int, v: int) -> jax.Array:
    """The loss through the circular (interleaved) schedule of ``kernels.pipeline_circular``, on the Transformer's
    layers: each stage holds ``v`` chunks (:func:`interleaved_order`), a microbatch goes round the ring of stages
    ``v`` times, and the bubble is ``(p - 1) / (v M + p - 1)`` of the steps; ``M`` a multiple of ``p``."""

    def steps(layers, micro, layer, i, p: int, inner: _Layout, axis: str) -> list:
        n = m * v
        lc = jax.tree.leaves(layers)[0].shape[0] // v
        ring = [(j, (j + 1) % p) for j in range(p)]
        held, outs = None, [None] * m
        for s in range(n + p - 1):
            with jax.named_scope("pipeline/stage"), jax.named_scope(f"step_{s}"):
                if s < n and _item(s, p, v)[1] == 0:  # stage 0 starts a fresh microbatch
                    first = inner.constrain(micro[:, _item(s, p, v)[0]], RESIDUAL)
                    h = first if held is None else jnp.where(i == 0, first, held)
                else:  # stage 0 continues what came round the ring
                    h = held
                r = ((s - i) // p) % v  # this stage's repeat in this step (any, when it has no work)
                chunk = jax.tree.map(lambda w, r=r: jax.lax.dynamic_slice_in_dim(w, r * lc, lc), layers)
                h = jax.lax.scan(layer, h, chunk)[0]
            last = s - (p - 1)  # the last stage's item: its output is final at the last repeat
            if 0 <= last < n and _item(last, p, v)[1] == v - 1:
                outs[_item(last, p, v)[0]] = h
            if s < n + p - 2:
                with jax.named_scope(f"pipeline/pass_{s}"):
                    held = jax.lax.ppermute(h, axis, ring)
        return outs

    return _staged(params, tokens, cfg, lay, remat, m, steps)


__all__ = ["circular_loss", "interleaved_order", "loss_fn", "pipeline_stages", "pipelined_loss", "split_order"]
