"""Named recomputation policies: which of a layer's tensors the forward pass keeps, and where.

Besides the three classic policies (``none``, ``selective``, ``full``: :mod:`lab.predict.training.memory`), a
layer may be checkpointed by *name*, as JAX programs do with ``jax.checkpoint`` and
``checkpoint_policies.save_only_these_names`` (or ``save_and_offload_only_these_names``). The names here are
MaxText's ``remat_policy`` values, read from its decoder's policy table (MaxText's source code: each name is a set
of saved projection outputs, some offloaded to host memory):

* ``minimal``: every projection output (Q/K/V, attention out, the MLP's first and second matmuls); with
  ``_with_context`` the attention output (``context``) too.
* ``save_dot_with_context_except_mlp``: Q/K/V, context, attention out.
* ``save_dot_except_mlpwi``: Q/K/V, attention out, the MLP's second matmul.
* ``save_dot_except_mlp``: Q/K/V, attention out.
* ``save_qkv_proj``, ``save_out_proj``: those alone.
* ``qkv_proj_offloaded``, ``minimal_offloaded``: as ``save_qkv_proj`` and ``minimal``, kept in host memory.

Every policy also keeps the layer's input (the scan carry). What the backward pass needs and no policy kept is
recomputed: Q/K/V for attention's backward, the context for the attention-out weight gradient (attention run
again), the attention-out output to rebuild the second norm's input, the MLP's first matmul for its activation;
the norms and the MLP's activation always. The MLP's second matmul never is: its output is the next layer's
input, which is kept (JAX's dead-code elimination, as under ``full``).
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.core.errors import UserError

_MINIMAL = frozenset({"qkv", "out_proj", "mlpwi", "mlpwo"})


@dataclass(frozen=True)
class Policy:
    """A named policy: the tensors it keeps and whether they go to host memory."""

    name: str
    saved: frozenset[str]
    offloaded: bool = False


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("minimal", _MINIMAL),
        Policy("minimal_with_context", _MINIMAL | {"context"}),
        Policy("save_dot_with_context_except_mlp", frozenset({"qkv", "context", "out_proj"})),
        Policy("save_dot_except_mlpwi", frozenset({"qkv", "out_proj", "mlpwo"})),
        Policy("save_dot_except_mlp", frozenset({"qkv", "out_proj"})),
        Policy("save_qkv_proj", frozenset({"qkv"})),
        Policy("save_out_proj", frozenset({"out_proj"})),
        Policy("qkv_proj_offloaded", frozenset({"qkv"}), offloaded=True),
        Policy("minimal_offloaded", _MINIMAL, offloaded=True),
    )
}
CLASSIC = ("none", "selective", "full")
ALL = CLASSIC + tuple(POLICIES)


def policy(name: str) -> Policy | None:
    """The named policy, None for a classic one; a :class:`UserError` naming the valid choices otherwise."""
    if name in CLASSIC:
        return None
    if name not in POLICIES:
        raise UserError(f"--remat {name!r} is not a recomputation policy; choose one of {', '.join(ALL)}")
    return POLICIES[name]


def saved_elements(p: Policy, model, tp: int, sp: bool) -> float:
    """Elements per token of one layer the policy keeps on one tensor-parallel rank, the layer input excluded."""
    d = model.d_model
    row = d / (tp if sp else 1)  # a row-parallel output: whole on every rank, or sequence-sharded under SP
    kv = max(model.kv_heads / tp, 1.0) * model.head_dim
    sizes = {
        "qkv": model.q_dim / tp + 2 * kv,
        "context": model.q_dim / tp,
        "out_proj": row,
        "mlpwi": (model.experts_per_token + model.shared_experts) * model.d_ff / tp * (2 if model.gated_mlp else 1),
        "mlpwo": row,
    }
    return sum(sizes[name] for name in p.saved)


def recomputed(p: Policy) -> tuple[str, ...]:
    """The estimator's layer ops (:func:`lab.predict.training.estimate._compute_ops`) the backward runs again."""
    ops = ["norms", "mlp.activation"]
    if "qkv" not in p.saved:
        ops += ["qkv", "rope"]
    if "context" not in p.saved:
        ops += ["attention", "attention.bmm", "attention.softmax"]
    if "out_proj" not in p.saved:
        ops.append("out_proj")
    if "mlpwi" not in p.saved:
        ops.append("mlp.up")
    return tuple(ops)


__all__ = ["ALL", "CLASSIC", "POLICIES", "Policy", "policy", "recomputed", "saved_elements"]
