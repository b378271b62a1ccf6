"""The Transformer's training step: loss and gradients, one AdamW update, built from a Plan.

Parameters and AdamW state are float32 and sharded alike (optimizer moments follow their parameter through
``optax.tree_map_params``); gradients are pinned to the parameters' shardings, so under FSDP they leave the
backward pass reduce-scattered. :func:`build_train` is the one path from a :class:`lab.core.plan.Plan` to a
runnable step: abstract arguments for lowering, real ones only when the step is run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import kernels.transformer.explicit as explicit
from kernels.mesh import make_mesh
from kernels.moe import load_report
from kernels.program import Built
from kernels.transformer.loss import loss_fn
from kernels.transformer.model import (
    PRESETS,
    REMAT,
    _attention_half,
    _block,
    _embed,
    _is_info,
    _Layout,
    _remat_policy,
    _rms_norm,
    abstract,
    init_params,
    param_info,
    shardings,
    synthetic_tokens,
    token_sharding,
    validate,
)
from lab.core.attention import Attention, check_backend, from_options
from lab.core.models import ModelConfig
from lab.core.plan import Plan
from lab.core.plan_checks import explicit_rules
from lab.core.programs import MOE_CAPACITY_FACTOR
from lab.core.rules import ShardingRules


def optimizer(learning_rate: float = 1e-2) -> optax.GradientTransformation:
    """AdamW with optax's defaults (b1 0.9, b2 0.999, weight decay 1e-4); state float32 like the params."""
    return optax.adamw(learning_rate)


def _opt_shapes(tx: optax.GradientTransformation, cfg: ModelConfig):
    """The optimizer state's shapes and dtypes, from the parameters' declarations (nothing allocated)."""
    params = jax.tree.map(lambda i: jax.ShapeDtypeStruct(i.shape, i.dtype), param_info(cfg), is_leaf=_is_info)
    return jax.eval_shape(tx.init, params)


def opt_state_shardings(tx: optax.GradientTransformation, cfg: ModelConfig, rules: ShardingRules, mesh: Mesh):
    """Shardings of the optimizer state: every moment like its parameter (FSDP shards it); scalars replicated."""
    p_sh = shardings(param_info(cfg), rules, mesh)
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(
        tx, lambda _, s: s, _opt_shapes(tx, cfg), p_sh, transform_non_params=lambda _: replicated
    )


def abstract_opt_state(tx: optax.GradientTransformation, cfg: ModelConfig, rules: ShardingRules, mesh: Mesh):
    """The optimizer state as ``ShapeDtypeStruct`` s with shardings (nothing allocated)."""
    sh = opt_state_shardings(tx, cfg, rules, mesh)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), _opt_shapes(tx, cfg), sh)


def init_opt_state(params, cfg: ModelConfig, rules: ShardingRules, mesh: Mesh, learning_rate=1e-2):
    """AdamW state allocated with :func:`opt_state_shardings`."""
    tx = optimizer(learning_rate)
    return jax.jit(tx.init, out_shardings=opt_state_shardings(tx, cfg, rules, mesh))(params)


def make_grads_fn(
    cfg: ModelConfig,
    rules: ShardingRules,
    mesh: Mesh,
    remat: str = "none",
    dtype: str = "float32",
    microbatches: int = 1,
    capacity_factor: float = MOE_CAPACITY_FACTOR,
    interleave: int = 1,
    stage_split: tuple[int, ...] = (),
    attention: Attention | None = None,
) -> Callable:
    """Jitted ``(params, tokens) -> (loss, grads)``, gradients placed like the parameters (``microbatches``: of
    the pipeline, when the rules put the layers on a mesh axis; ``capacity_factor``: a mixture of experts')."""
    _remat_policy(remat)
    validate(cfg, rules, mesh)
    _check_mode(rules, mesh)
    p_sh = shardings(param_info(cfg), rules, mesh)

    def grads(params, tokens):
        loss = jax.value_and_grad(loss_fn)
        options = {"interleave": interleave, "stage_split": stage_split, "attention": attention}
        return loss(params, tokens, cfg, rules, mesh, remat, dtype, microbatches, capacity_factor, **options)

    jitted = jax.jit(
        grads, in_shardings=(p_sh, token_sharding(rules, mesh)), out_shardings=(NamedSharding(mesh, P()), p_sh)
    )
    return explicit.on_mesh(jitted, mesh)


def make_train_step(
    cfg: ModelConfig,
    rules: ShardingRules,
    mesh: Mesh,
    remat: str = "none",
    dtype: str = "float32",
    learning_rate: float = 1e-2,
    microbatches: int = 1,
    interleave: int = 1,
    stage_split: tuple[int, ...] = (),
    attention: Attention | None = None,
) -> Callable:
    """Jitted ``step(params, opt_state, tokens) -> (params, opt_state, loss)``: one AdamW step.

    Parameters and optimizer state are donated (updated in place) and keep their shardings. ``microbatches``:
    of the pipeline, when the rules put the layers on a mesh axis.
    """
    _remat_policy(remat)
    validate(cfg, rules, mesh)
    _check_mode(rules, mesh)
    tx = optimizer(learning_rate)
    p_sh = shardings(param_info(cfg), rules, mesh)
    o_sh = opt_state_shardings(tx, cfg, rules, mesh)

    def step(params, opt_state, tokens):
        options = {"interleave": interleave, "stage_split": stage_split, "attention": attention}
        value_and_grad = jax.value_and_grad(loss_fn)
        loss, grads = value_and_grad(params, tokens, cfg, rules, mesh, remat, dtype, microbatches, **options)
        grads = explicit.pin(grads, p_sh)  # explicit mode: typed so already (the weights' cotangents)
        with jax.named_scope("optimizer"):
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    jitted = jax.jit(
        step,
        in_shardings=(p_sh, o_sh, token_sharding(rules, mesh)),
        out_shardings=(p_sh, o_sh, NamedSharding(mesh, P())),
        donate_argnums=(0, 1),
    )
    return explicit.on_mesh(jitted, mesh)


def _check_mode(rules: ShardingRules, mesh: Mesh) -> None:
    """On an explicit mesh, refuse in one line what explicit mode does not run (a pipeline)."""
    if explicit.is_explicit(mesh):
        explicit_rules(rules, dict(mesh.shape))


def first_layer_routing(params, tokens, cfg: ModelConfig, groups: tuple[int, int]) -> dict[str, Any]:
    """How the first expert layer's router loads the experts with these weights and tokens (``kernels.moe``'s
    :func:`~kernels.moe.load_report`), the tokens routed in the groups the devices route (``groups`` along B and
    T): what a run of the Transformer reports, at its initial weights."""
    lay = _Layout(PRESETS["single"], None)
    host = jax.tree.map(jnp.asarray, params)
    first = jax.tree.map(lambda w: w[0], host["layers"])
    x = _embed(host, jnp.asarray(tokens), cfg, lay)
    positions = jnp.arange(x.shape[1])
    if "dense_layers" in host:  # the leading dense layers come first
        x = jax.lax.scan(lambda x, p: (_block(x, p, positions, cfg, lay)[0], None), x, host["dense_layers"])[0]
    x, _ = _attention_half(x, first, positions, cfg, lay)
    h = _rms_norm(x, first["mlp_norm"], cfg.norm_eps)
    gb, gt = groups
    B, T, D = h.shape
    h = h.reshape(gb, B // gb, gt, T // gt, D).transpose(0, 2, 1, 3, 4).reshape(B * T, D)  # device by device
    k, cf = cfg.experts_per_token, MOE_CAPACITY_FACTOR
    return load_report(h, first["router"], groups=gb * gt, topk=k, capacity_factor=cf) | {"layer": cfg.dense_layers}


def build_train(plan: Plan, mesh: Mesh | None = None, *, seed: int = 0, learning_rate: float = 1e-2) -> Built:
    """The train step of a validated Plan: ``built.fn``, its abstract arguments, and real ones on demand.

    ``built.runner()`` runs one step after another, each on the parameters and optimizer state the last one
    returned (they are donated).
    """
    plan.validate()
    cfg, rules, remat = plan.model, plan.rules, plan.remat
    assert cfg is not None and rules is not None and remat in REMAT
    split = plan.options.stage_split
    cfg = dataclasses.replace(cfg, layers=plan.stored_layers())  # under an uneven split, stages padded
    batch, seq = plan.sizes["batch"], plan.sizes["seq"]
    m = mesh if mesh is not None else make_mesh(plan.shape, slow=plan.slow_axes)
    m = explicit.mesh_for(m, plan.options.sharding_mode == "explicit")  # the Plan's sharding mode
    v = plan.options.interleave if plan.options.pp_schedule == "interleaved" else 1
    attention = from_options(plan.options)
    if attention.fused:  # one line for a kernel these devices cannot run, before anything is traced
        check_backend(attention.impl, m.devices.flat[0].platform)
    step = make_train_step(
        cfg, rules, m, remat, plan.dtype, learning_rate, plan.microbatches(), v, split, attention=attention
    )
    tx = optimizer(learning_rate)
    tok_sh = token_sharding(rules, m)
    spec = (
        abstract(param_info(cfg), rules, m),
        abstract_opt_state(tx, cfg, rules, m),
        jax.ShapeDtypeStruct((batch, seq), "int32", sharding=tok_sh),
    )

    def make_args():
        params = init_params(cfg, rules, m, jax.random.key(seed))
        opt_state = init_opt_state(params, cfg, rules, m, learning_rate)
        return params, opt_state, jax.device_put(synthetic_tokens(cfg, batch, seq, seed), tok_sh)

    def carry(out, args):  # parameters and optimizer state were donated: continue from the step's outputs
        return out[0], out[1], args[2]

    facts = None
    if cfg.is_moe:  # the router's load on the run's tokens at its initial weights (the first expert layer)

        def facts():
            params = jax.device_get(init_params(cfg, rules, m, jax.random.key(seed)))
            groups = (rules.size("batch", plan.shape), rules.size("context", plan.shape))
            return {"routing": first_layer_routing(params, synthetic_tokens(cfg, batch, seq, seed), cfg, groups)}

    return Built(step, spec, make_args, carry=carry, facts=facts)


__all__ = [
    "abstract_opt_state",
    "build_train",
    "init_opt_state",
    "make_grads_fn",
    "make_train_step",
    "opt_state_shardings",
    "optimizer",
]
