"""A mixture-of-experts MLP with expert parallelism: E experts over a mesh axis named ``expert``.

``x [T, D] -> Out[T, D]`` with the tokens split over every device (``T`` over ``data`` x ``expert``; over
``expert`` alone when the mesh has no ``data`` axis) and the experts' SwiGLU weights ``W_gate, W_up [E, D, F]``,
``W_down [E, F, D]`` over ``expert`` (replicated over ``data``). The router ``W_router [D, E]`` is replicated. So
each device holds ``t = T / (data * expert)`` tokens and ``E / expert`` experts, as expert-parallel layers run.

Per device, in four named scopes:

* ``moe/router``: float32 logits ``x W_router``, a softmax over the E experts, the top ``k`` (default 2) of them,
  their probabilities renormalised to sum to one. Every (token, choice) assignment gets a slot in its expert's
  buffer, first come first served in **choice-major order** (every token's first choice, in token order, then
  every token's second choice), so a token's first choice is dropped only when its expert is full of first
  choices. Each expert has ``C = ceil(k * t * capacity_factor / E)`` slots (capacity factor 1.25 by default); an
  assignment past them is dropped: it contributes nothing to its token's output (a token whose every choice is
  dropped gets zero; the residual connection around the layer is the caller's).
* ``moe/dispatch``: the send buffer ``[E, C, D]`` (empty slots stay zero) goes to the experts' devices with one
  ``all_to_all`` over ``expert``: device ``j`` receives the ``[E / expert, C, D]`` block of its experts from every
  device of its expert group.
* ``moe/experts``: each local expert's gated MLP ``(silu(h W_gate) * h W_up) W_down`` on all ``expert * C``
  slots it received, padding included (the compiled program computes every slot; the products accumulate in
  float32).
* ``moe/combine``: a second ``all_to_all`` returns the results to the tokens' devices, in the send buffer's
  layout; each token sums its kept choices weighted by the router.

With ``S`` shared experts (``moe_shared_mlp``, as DeepSeekMoE and its successors run them) every token also goes
through one dense SwiGLU of width ``S * F`` (the shared experts side by side), ``W_sgate, W_sup [D, S F]``, ``W_sdown
[S F, D]`` replicated on every device, in scope ``moe/shared``: no collective, its output added to the routed one.

Capacity, and so dropping, is per device (per group of ``t`` consecutive tokens): :func:`reference_moe` applies the
same rule to the same groups on one device, so outputs agree exactly whether or not tokens are dropped.
:func:`load_report` says how the routing loads the experts. The routing options are the module constants of
``lab.core.programs`` (``MOE_TOPK``, ``MOE_CAPACITY_FACTOR``) unless given here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lab.core.errors import UserError
from lab.core.programs import MOE_AXES, MOE_CAPACITY_FACTOR, MOE_TOPK, check_moe_sizes, moe_capacity

DATA, EXPERT = MOE_AXES
SCOPES = ("moe/router", "moe/dispatch", "moe/experts", "moe/combine", "moe/shared")

MoeFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def token_spec(mesh: Mesh) -> P:
    """``[T_(data, expert), D]``: the layout of x and the output (T over expert alone without a data axis)."""
    return P((DATA, EXPERT) if DATA in mesh.axis_names else EXPERT, None)


def in_specs(mesh: Mesh, shared: bool = False) -> tuple[P, ...]:
    """x, the router ``[D, E]`` (replicated), and ``W_gate, W_up [E_expert, D, F]``, ``W_down [E_expert, F, D]``;
    with ``shared``, the shared experts' ``W_sgate, W_sup [D, S F]``, ``W_sdown [S F, D]`` (replicated)."""
    experts = P(EXPERT, None, None)
    return (token_spec(mesh), P(None, None), experts, experts, experts, *([P(None, None)] * 3 if shared else []))


def _swiglu(
    h: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, spec: str, tag: Callable = lambda x, _: x
) -> jax.Array:
    """``(silu(h W_gate) * h W_up) W_down`` with float32 products; ``spec``: the batch letters of h (``esd`` for
    experts' slots, ``td`` for tokens); ``tag(x, name)`` names the two products (for a remat policy)."""
    b, e = spec[:-1], "e" if spec.startswith("e") else ""
    gate = tag(jnp.einsum(f"{spec},{e}df->{b}f", h, w_gate, preferred_element_type=jnp.float32), "moe_gate")
    up = tag(jnp.einsum(f"{spec},{e}df->{b}f", h, w_up, preferred_element_type=jnp.float32), "moe_up")
    act = (jax.nn.silu(gate) * up).astype(h.dtype)
    return jnp.einsum(f"{b}f,{e}fd->{b}d", act, w_down, preferred_element_type=jnp.float32).astype(h.dtype)


def token_groups(mesh: Mesh) -> int:
    """How many devices split the tokens (each routes its own ``T / groups`` with its own capacity)."""
    shape = dict(mesh.shape)
    return shape.get(DATA, 1) * shape[EXPERT]


def _require_expert(mesh: Mesh) -> None:
    if EXPERT not in mesh.axis_names:
        raise UserError(
            f"moe_mlp needs a mesh axis named {EXPERT!r}; the mesh has {', '.join(mesh.axis_names)}. "
            f'Give a missing axis size 1, e.g. {{"{DATA}": 2, "{EXPERT}": 4}}'
        )


def _route(x: jax.Array, w_router: jax.Array, topk: int) -> tuple[jax.Array, jax.Array]:
    """Router weights ``[t, k]`` (float32, the top-k softmax probabilities renormalised) and experts ``[t, k]``."""
    logits = jnp.einsum("td,de->te", x, w_router, preferred_element_type=jnp.float32)
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), topk)
    return weights / jnp.sum(weights, axis=-1, keepdims=True), experts


def _slots(experts: jax.Array, n_experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Each assignment's slot ``expert * C + position`` in the send buffer (``E * C`` when dropped) and whether it
    is kept, flattened choice-major (``[k * t]``: every first choice, then every second choice)."""
    flat = experts.T.reshape(-1)
    onehot = (flat[:, None] == jnp.arange(n_experts)).astype(jnp.int32)  # [k*t, E]
    earlier = jnp.cumsum(onehot, axis=0) - onehot  # assignments to each expert before this one
    position = jnp.take_along_axis(earlier, flat[:, None], axis=1)[:, 0]
    keep = position < capacity
    return jnp.where(keep, flat * capacity + position, n_experts * capacity), keep


def moe_tokens(x, w_router, w_gate, w_up, w_down, shared, *, k: int, cf: float, ep, tp=(), tag=lambda x, _: x):
    """One device's MoE MLP on its tokens ``x [t, D]`` (module docstring), the standalone program's and the
    Transformer's (``kernels.transformer.moe_layer``): ``ep`` the expert axes of the all-to-alls (empty: all experts
    here), ``tp`` tensor-parallel axes splitting the experts' F (the output summed over them), ``tag(x, name)`` naming
    the slots and products a remat policy may keep."""
    t, d = x.shape
    n = math.prod(jax.lax.axis_size(a) for a in ep) if ep else 1
    local = w_gate.shape[0]
    e = local * n
    c = moe_capacity(t, e, k, cf)
    with jax.named_scope(SCOPES[0]):
        weights, experts = _route(x, w_router, k)
        slot, keep = _slots(experts, e, c)
    with jax.named_scope(SCOPES[1]):
        token = jnp.tile(jnp.arange(t), k)  # the token of each assignment, choice-major
        send = jnp.zeros((e * c, d), x.dtype).at[slot].set(x[token], mode="drop", unique_indices=True)
        recv = send.reshape(e, c, d)
        if ep:  # [E, C, D] split over the expert group by expert; received: [n (source), E/n, C, D]
            recv = jax.lax.all_to_all(recv, ep, 0, 0, tiled=True)
        recv = tag(recv, "moe_recv")
    with jax.named_scope(SCOPES[2]):
        h = recv.reshape(n, local, c, d).transpose(1, 0, 2, 3).reshape(local, n * c, d)
        y = _swiglu(h, w_gate, w_up, w_down, "esd", tag)  # partial sums over the tp axes
        y = y.reshape(local, n, c, d).transpose(1, 0, 2, 3).reshape(e, c, d)
    with jax.named_scope(SCOPES[3]):
        back = tag(jax.lax.all_to_all(y, ep, 0, 0, tiled=True) if ep else y, "moe_back")  # the send buffer's layout
        got = back.reshape(e * c, d)[jnp.where(keep, slot, 0)].astype(jnp.float32)  # [k*t, D]
        w = jnp.where(keep, weights.T.reshape(-1), 0.0)
        out = jnp.sum((w[:, None] * got).reshape(k, t, d), axis=0)
    if shared:
        with jax.named_scope(SCOPES[4]):
            out = out + _swiglu(x, *shared, "td").astype(jnp.float32)
    out = out.astype(x.dtype)
    if tp:
        with jax.named_scope(SCOPES[3]):
            out = jax.lax.psum(out, tp)
    return out


def moe_mlp(
    mesh: Mesh, *, topk: int = MOE_TOPK, capacity_factor: float = MOE_CAPACITY_FACTOR, shared: bool = False
) -> MoeFn:
    """The jitted ``shard_map`` program ``(x, w_router, w_gate, w_up, w_down[, w_sgate, w_sup, w_sdown]) -> out``
    (module docstring); the last three with ``shared``."""
    _require_expert(mesh)

    def body(x, w_router, w_gate, w_up, w_down, *shared_weights):
        # x [t, D]; w_router [D, E]; w_gate, w_up [E/n, D, F]; w_down [E/n, F, D]
        return moe_tokens(x, w_router, w_gate, w_up, w_down, shared_weights, k=topk, cf=capacity_factor, ep=(EXPERT,))

    specs = in_specs(mesh, shared)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=token_spec(mesh)))


# ----- the single-device reference and the load report ---------------------------------------------------------


def _kept(experts: np.ndarray, groups: int, n_experts: int, capacity: int) -> np.ndarray:
    """``[T, k]``: whether each assignment fits its expert's capacity, group by group of ``T / groups`` tokens,
    counting first come first served, every first choice before any second choice (a plain loop)."""
    total, k = experts.shape
    t = total // groups
    kept = np.zeros((total, k), bool)
    for g in range(groups):
        filled = [0] * n_experts
        for j in range(k):
            for i in range(g * t, (g + 1) * t):
                ex = int(experts[i, j])
                if filled[ex] < capacity:
                    filled[ex] += 1
                    kept[i, j] = True
    return kept


def _routing(x, w_router, groups: int, topk: int, capacity_factor: float):
    total, n_experts = x.shape[0], w_router.shape[1]
    if total % groups:
        raise UserError(f"moe_mlp: T={total} does not divide into {groups} token groups")
    capacity = moe_capacity(total // groups, n_experts, topk, capacity_factor)
    weights, experts = _route(jnp.asarray(x), jnp.asarray(w_router), topk)
    return weights, experts, _kept(np.asarray(experts), groups, n_experts, capacity), capacity


def reference_moe_jax(
    x,
    w_router,
    w_gate,
    w_up,
    w_down,
    *,
    groups: int,
    topk: int = MOE_TOPK,
    capacity_factor: float = MOE_CAPACITY_FACTOR,
) -> jax.Array:
    """The layer on one device, float32: every expert applied to every token (dense), each token's kept choices
    summed with the router's weights. ``groups``: how many devices split the tokens in the sharded program (the
    capacity is per group). Differentiable in the expert weights; the routing is read from concrete ``x`` and
    ``w_router`` (do not trace them)."""
    weights, experts, kept, _ = _routing(x, w_router, groups, topk, capacity_factor)
    x32 = jnp.asarray(x, jnp.float32)
    gate = jnp.einsum("td,edf->tef", x32, jnp.asarray(w_gate, jnp.float32), precision="highest")
    up = jnp.einsum("td,edf->tef", x32, jnp.asarray(w_up, jnp.float32), precision="highest")
    y = jnp.einsum("tef,efd->ted", jax.nn.silu(gate) * up, jnp.asarray(w_down, jnp.float32), precision="highest")
    chosen = jnp.take_along_axis(y, experts[:, :, None], axis=1)  # [T, k, D]
    return jnp.sum(jnp.where(kept, weights, 0.0)[:, :, None] * chosen, axis=1)


def reference_shared(x, w_sgate, w_sup, w_sdown) -> jax.Array:
    """The shared experts on one device, float32: one dense SwiGLU of width ``S F`` over every token."""
    x32, g, u, dn = (jnp.asarray(a, jnp.float32) for a in (x, w_sgate, w_sup, w_sdown))
    act = jax.nn.silu(jnp.dot(x32, g, precision="highest")) * jnp.dot(x32, u, precision="highest")
    return jnp.dot(act, dn, precision="highest")


def reference_moe(x, w_router, w_gate, w_up, w_down, *shared, groups: int, **options) -> np.ndarray:
    """:func:`reference_moe_jax` as a numpy array, plus :func:`reference_shared` when the shared weights are given."""
    out = reference_moe_jax(x, w_router, w_gate, w_up, w_down, groups=groups, **options)
    return np.asarray(out + reference_shared(x, *shared) if shared else out)


def load_report(
    x, w_router, *, groups: int, topk: int = MOE_TOPK, capacity_factor: float = MOE_CAPACITY_FACTOR
) -> dict[str, Any]:
    """How the router loads the experts for these inputs: per expert the assignments routed to it and those kept
    (``kept`` sums to ``k * T - dropped``), the fraction of assignments dropped, and the imbalance (the busiest
    expert's routed count over the mean)."""
    _, experts, kept, capacity = _routing(x, w_router, groups, topk, capacity_factor)
    experts = np.asarray(experts)
    n_experts = w_router.shape[1]
    routed = np.bincount(experts.ravel(), minlength=n_experts)
    kept_counts = np.bincount(experts[kept], minlength=n_experts)
    dropped = int(experts.size - kept.sum())
    return {
        "capacity": capacity,
        "groups": groups,
        "routed": routed.tolist(),
        "kept": kept_counts.tolist(),
        "dropped": dropped,
        "dropped_fraction": dropped / experts.size,
        "imbalance": float(routed.max() / routed.mean()),
    }


def check_mesh(mesh: Mesh, sizes: Mapping[str, int]) -> None:
    """The sizes against a JAX mesh: E divides over ``expert``, T over ``data`` x ``expert`` (a UserError)."""
    _require_expert(mesh)
    check_moe_sizes("moe_shared_mlp" if "S" in sizes else "moe_mlp", dict(mesh.shape), dict(sizes))


__all__ = [
    "DATA",
    "EXPERT",
    "SCOPES",
    "check_mesh",
    "in_specs",
    "load_report",
    "moe_mlp",
    "moe_tokens",
    "reference_moe",
    "reference_moe_jax",
    "reference_shared",
    "token_groups",
    "token_spec",
]
