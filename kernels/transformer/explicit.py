"""The Transformer in JAX's explicit sharding mode (the Plan's ``sharding_mode = "explicit"``).

In auto mode (the default) the mesh's axes are ``AxisType.Auto``: activations are pinned with
``jax.lax.with_sharding_constraint`` at block boundaries and XLA's partitioner propagates the rest. In explicit
mode the axes are ``AxisType.Explicit`` and every array carries its sharding in its type (``jax.typeof(x)`` prints
``float32[8@data,20,56]``); JAX checks each operation's sharding rule at trace time and the model says itself
what auto mode leaves to propagation:

* a pin is ``jax.sharding.reshard`` (``with_sharding_constraint`` on explicit axes only asserts);
* a contraction whose operands share a sharded contracting dim (the row-parallel ``wo`` and ``w_down``), or whose
  result would use one axis twice (``tp_sp``'s column-parallel inputs, split along T), is given ``out_sharding=``;
* the embedding lookup is ``table.at[tokens].get(out_sharding=...)`` (masked local lookups, summed over the vocab
  axes, as auto mode compiles it);
* FSDP's weights ``W[D_X, ...]`` are contracted as stored: only the weight's contracting dim is sharded, so the
  product takes the activation's type and the partitioner gathers the weight, forward and backward, as in auto
  mode; a norm's scale ``[D_X]`` (an elementwise product, where X would split two dims) is resharded whole inside a
  ``jax.checkpoint`` that gathers it again backward (:func:`scaled`). Gradients come back typed as the weights.

The ``shard_map`` regions run as they are: an attention kernel's and the expert layer's ``shard_map`` take the
explicit-typed operands; context parallelism's K and V are resharded whole along T before attention
(:func:`whole_t`). A pipeline is refused (:func:`lab.core.plan_checks.explicit_rules`): JAX 0.10.2 cannot
transpose the vocab-parallel lookup inside the stages' ``shard_map`` while explicit axes remain there. Every
sharding here names the concrete mesh, and the mesh is also put in context while the step is traced
(``jax.set_mesh``, as JAX documents explicit mode): :func:`on_mesh` wraps the jitted step so that every call,
``lower`` and ``trace`` is. The APIs used are in JAX 0.10.2 and 0.11.2 alike (``jax.set_mesh``,
``jax.sharding.reshard``, ``jax.typeof``, ``out_sharding=``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def is_explicit(mesh: Any) -> bool:
    """Whether ``mesh`` (concrete or abstract) has ``AxisType.Explicit`` axes: the program runs in explicit mode."""
    return mesh is not None and any(t == AxisType.Explicit for t in mesh.axis_types)


def mesh_for(mesh: Mesh, explicit: bool) -> Mesh:
    """``mesh`` with every axis ``Explicit`` (``explicit``) or ``Auto``: the same devices and names."""
    kind = AxisType.Explicit if explicit else AxisType.Auto
    if all(t == kind for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(kind,) * len(mesh.axis_names))


def pin(x: Any, sharding: Any) -> Any:
    """``x`` (a pytree) laid out as ``sharding``: ``reshard`` on explicit axes, a sharding constraint on auto ones."""
    leaf = jax.tree.leaves(sharding)[0]
    if is_explicit(leaf.mesh if isinstance(leaf, NamedSharding) else None):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def lookup(table: jax.Array, tokens: jax.Array, out: NamedSharding) -> jax.Array:
    """Rows of ``table`` at ``tokens``, typed ``out`` (explicit mode: else JAX cannot tell how to shard a gather
    from a vocab-split table; auto mode's ``jnp.take`` stays in the model, where its source line belongs)."""
    return table.at[tokens].get(out_sharding=out)


def _without(x: jax.Array, mesh: Mesh, axes: set[str], dims: tuple[int, ...]) -> jax.Array:
    """``x`` resharded whole over ``axes`` along ``dims``, the rest as its type says."""
    spec = tuple(jax.typeof(x).sharding.spec)
    spec += (None,) * (x.ndim - len(spec))
    kept = []
    for d, entry in enumerate(spec):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        if d in dims:
            names = tuple(a for a in names if a not in axes)
        kept.append(None if not names else names[0] if len(names) == 1 else names)
    return x if tuple(kept) == spec else jax.sharding.reshard(x, NamedSharding(mesh, P(*kept)))


def _gathered(x: jax.Array) -> jax.Array:
    """``x`` resharded whole (replicated) on its explicit mesh."""
    return jax.sharding.reshard(x, NamedSharding(jax.typeof(x).sharding.mesh, P()))


def typed_sharded(x: jax.Array) -> bool:
    """``x`` carries a sharding over explicit mesh axes in its type (in auto mode: never)."""
    typed = jax.typeof(x).sharding
    return is_explicit(typed.mesh) and any(tuple(typed.spec))


def scaled(y: jax.Array, scale: jax.Array) -> jax.Array:
    """``y * scale``: an activation ``[..., D]`` times a norm's scale ``[D_X]`` typed sharded (:func:`typed_sharded`;
    the model multiplies an unsharded one itself). The scale is resharded whole first (the type rules refuse X on two
    dims of the product), inside a ``jax.checkpoint`` that keeps the sharded scale for the backward pass and gathers
    it again there, as auto mode compiles it (the estimators' FSDP gathers, forward and backward)."""
    regather = jax.checkpoint(lambda y, s: y * _gathered(s), policy=jax.checkpoint_policies.nothing_saveable)
    return regather(y, scale)


def whole_t(xs: tuple[jax.Array, ...], mesh: Mesh | None) -> tuple[jax.Array, ...]:
    """On an explicit mesh, activations ``[B, T, ...]`` resharded whole along T: context parallelism's K and V
    gathered for attention (auto mode leaves that to the partitioner). Otherwise as they are."""
    if mesh is None or not is_explicit(mesh):
        return xs
    return tuple(_without(x, mesh, set(mesh.axis_names), dims=(1,)) for x in xs)


def on_mesh(fn: Callable, mesh: Mesh) -> Callable:
    """``fn`` (jitted) called and lowered with ``mesh`` in context (``jax.set_mesh``), as explicit mode needs while
    tracing; an auto mesh's ``fn`` as it is."""
    if not is_explicit(mesh):
        return fn
    return _OnMesh(fn, mesh)


class _OnMesh:
    """A jitted function whose calls, ``lower`` and ``trace`` run under ``jax.set_mesh(mesh)``; the rest of the
    jitted function's attributes as they are."""

    def __init__(self, fn: Callable, mesh: Mesh):
        self._fn, self.mesh = fn, mesh

    def __call__(self, *args, **kwargs):
        with jax.set_mesh(self.mesh):
            return self._fn(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with jax.set_mesh(self.mesh):
            return self._fn.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        with jax.set_mesh(self.mesh):
            return self._fn.trace(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)


__all__ = ["is_explicit", "lookup", "mesh_for", "on_mesh", "pin", "scaled", "typed_sharded", "whole_t"]
