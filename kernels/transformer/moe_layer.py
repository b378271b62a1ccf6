"""The Transformer's mixture-of-experts MLP: top-k routing, capacity, experts over the rules' ``experts`` axes.

A model with ``experts > 1`` (``lab.core.models.ModelConfig``) replaces every layer's SwiGLU MLP by ``E`` expert
SwiGLUs (``w_gate, w_up [E, D, F]``, ``w_down [E, F, D]``), a router ``[D, E]`` and, with ``S`` shared experts,
one SwiGLU of width ``S F`` every token goes through (DeepSeekMoE's layout). The routing is that of
``kernels.moe`` (top ``k = experts_per_token`` of a float32 softmax, renormalised; ``C = ceil(k t cf / E)`` slots
per expert per device, first come first served, choice-major; what overflows is dropped), on the tokens of one
device.

It runs as a ``shard_map`` manual over the batch's axes, the context axes and the tensor-parallel (``ffw``) axes,
the rest left to the partitioner:

* every device routes its own ``t = B T / (batch x context shards)`` tokens (the input is gathered along T over
  the sequence-parallel axes first, as a dense MLP's is);
* ``moe/dispatch``: the ``[E, C, D]`` send buffer goes to the experts' devices with one ``all_to_all`` over the
  ``experts`` axes (which must also split the batch: expert parallelism carved out of data parallelism, as
  GShard, DeepSpeed-MoE and Megatron-Core place it);
* ``moe/experts``: each local expert on every slot it received; the experts' ``F`` is split over the
  tensor-parallel axes (Megatron's column/row split inside each expert), so these are partial sums;
* ``moe/combine``: the second ``all_to_all`` brings them back, each token sums its kept choices weighted by the
  router, the shared experts' partial output is added, and one ``psum`` over the tensor-parallel axes completes
  the layer's output: the same reduction, of the same ``[t, D]``, as a dense MLP's row-parallel output.

Backward, the transposes add: the two ``all_to_all`` s again; the input's gradient summed over the
tensor-parallel axes (as a dense MLP's); the expert weights' gradients over the batch axes the experts do not use,
the router's and the shared experts' over all of them (the data-parallel reductions); and the router
probabilities' gradient ``[t, k]`` summed over the tensor-parallel axes (the combine weighs partial sums).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from kernels.moe import SCOPES, moe_tokens
from lab.core.models import ModelConfig

# What selective recomputation keeps of an expert layer (besides the projections): the received slots, the experts'
# two products and the returned slots, so neither the experts' matmuls nor the all-to-alls run again.
SAVED = ("moe_recv", "moe_gate", "moe_up", "moe_back")
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")
SHARED_WEIGHTS = ("shared_gate", "shared_up", "shared_down")


def _entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _local_moe(x, w_router, w_gate, w_up, w_down, shared, *, k: int, cf: float, ep, tp):
    """One device's MoE MLP (module docstring): x ``[b, t, D]`` -> ``[b, t, D]``, its ``b t`` tokens routed together
    (``kernels.moe.moe_tokens``, the slots and products named for selective recomputation)."""
    b, t, d = x.shape
    y = moe_tokens(
        x.reshape(b * t, d), w_router, w_gate, w_up, w_down, shared, k=k, cf=cf, ep=ep, tp=tp, tag=checkpoint_name
    )
    return y.reshape(b, t, d)


def _grouped(h, ws, shared, groups: tuple[int, int], options) -> jax.Array:
    """Without a mesh: the tokens routed in ``groups`` (along B, along T), each with its own capacity, as the
    devices of a mesh splitting B and T that many ways route theirs (the single-device reference)."""
    gb, gt = groups
    B, T, D = h.shape
    if B % gb or T % gt:
        raise ValueError(f"moe_groups {groups} do not divide the batch {B} x sequence {T}")
    x = h.reshape(gb, B // gb, gt, T // gt, D).transpose(0, 2, 1, 3, 4).reshape(gb * gt, B // gb, T // gt, D)
    y = jax.vmap(lambda xg: _local_moe(xg, *ws, shared, ep=(), tp=(), **options))(x)
    return y.reshape(gb, gt, B // gb, T // gt, D).transpose(0, 2, 1, 3, 4).reshape(B, T, D)


def moe_mlp(h: jax.Array, p: dict[str, Any], cfg: ModelConfig, lay) -> jax.Array:
    """The MoE MLP of one layer on ``h [B, T, D]`` (after the norm), with ``lay``'s rules and mesh (module
    docstring); ``p``: the layer's weights."""
    cd = lay.dtype
    ws = [p["router"].astype(cd)] + [p[n].astype(cd) for n in EXPERT_WEIGHTS]
    shared = [p[n].astype(cd) for n in SHARED_WEIGHTS] if cfg.shared_experts else []
    options = {"k": cfg.experts_per_token, "cf": lay.capacity_factor}
    if lay.mesh is None:
        return _grouped(h, ws, shared, lay.moe_groups, options)
    shape = dict(lay.mesh.shape)
    rules = lay.rules
    batch, ctx = rules.live("batch", shape), rules.live("context", shape)
    ep, tp = rules.live("experts", shape), rules.live("ffw", shape)
    h = lay.constrain(h, ("batch", None, "act_embed"))  # whole along T but for the context shards
    x_spec = P(_entry(batch), _entry(ctx), None)
    e_in, e_out = P(_entry(ep), None, _entry(tp)), P(_entry(ep), _entry(tp), None)
    specs = (x_spec, P(), e_in, e_in, e_out)
    s_specs = [P(None, _entry(tp)), P(None, _entry(tp)), P(_entry(tp), None)][: len(shared)]

    def body(x, w_router, w_gate, w_up, w_down, *sw):
        if tp:  # every tp rank routes the same tokens: their gradient is summed over tp once, as [t, D]; the
            # router's over tp apart from its data-parallel sum (which joins the other weights')
            x, w_router = jax.lax.pcast((x, w_router), tp, to="varying")
        return _local_moe(x, w_router, w_gate, w_up, w_down, list(sw), ep=ep, tp=tp, **options)

    mapped = jax.shard_map(
        body,
        mesh=lay.mesh,
        in_specs=(*specs, *s_specs),
        out_specs=x_spec,
        axis_names={*batch, *ctx, *ep, *tp},
    )
    return mapped(h, *ws, *shared)


__all__ = ["EXPERT_WEIGHTS", "SAVED", "SCOPES", "SHARED_WEIGHTS", "moe_mlp"]
