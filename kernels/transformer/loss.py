"""The Transformer's training loss: next-token cross entropy of the model's logits, through a GPipe pipeline when
the rules put the layers on a mesh axis (``model``'s docstring, *Pipeline*)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
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
) -> jax.Array:
    """Mean next-token cross entropy (float32): position t predicts token t+1; the last position is masked.

    The target logit is picked with a one-hot product rather than a gather, so vocab-sharded logits reduce
    with one AllReduce over the vocab axes (Megatron's vocab-parallel cross entropy) instead of a gather.
    With the rules' ``layers`` on a mesh axis the loss runs through the GPipe pipeline of
    :func:`pipelined_loss`, the batch cut into ``microbatches``. A mixture of experts routes with
    ``capacity_factor``; without a mesh, ``moe_groups`` (along B, along T) routes the tokens in the groups a
    mesh's devices would (the single-device reference of a sharded run).
    """
    lay = _Layout(rules or PRESETS["single"], mesh, compute_dtype(dtype), capacity_factor=capacity_factor)
    lay = dataclasses.replace(lay, moe_groups=tuple(moe_groups))
    if mesh is not None and pipeline_stages(lay.rules, mesh) > 1:
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
        held, outs = None, []
        for s in range(m + p - 1):
            with jax.named_scope("pipeline/stage"), jax.named_scope(f"step_{s}"):
                first = inner.constrain(micro[:, min(s, m - 1)], RESIDUAL)
                h = first if held is None else jnp.where(i == 0, first, held)
                h = jax.lax.scan(layer, h, params["layers"])[0]
            if s >= p - 1:  # the last stage finishes microbatch s - p + 1
                outs.append(h)
            if s < m + p - 2:
                with jax.named_scope(f"pipeline/pass_{s}"):
                    held = jax.lax.ppermute(h, axis, [(j, j + 1) for j in range(p - 1)])
        x = inner.constrain(jnp.stack(outs, axis=1).reshape(B, T, -1), RESIDUAL)  # back in the batch's order
        loss = _xent(_logits(ends, x, cfg, inner), tokens) / replicas
        if batch_axes:  # the mean over the replicas' sequences, then the last stage's
            loss = jax.lax.psum(loss, batch_axes)
        return jax.lax.psum(jnp.where(i == p - 1, loss, 0.0), axis)

    in_specs = (specs, P(batch_axes or None))
    return jax.shard_map(body, mesh=lay.mesh, in_specs=in_specs, out_specs=P(), axis_names={axis, *batch_axes})(
        params, tokens
    )


__all__ = ["loss_fn", "pipeline_stages", "pipelined_loss"]
