"""The Transformer's inference: prefill the prompt, then greedy decoding one token per step from a KV cache.

The cache keeps ``[L, B_data, S, K_model, H]`` (batch over the rules' batch axes, kv_heads over theirs) in the
compute dtype; each decode step writes its new k, v at ``pos`` and attends over the whole cache, positions after
``pos`` masked, so every step reads all ``S`` positions (what the inference estimator prices for this program).
:func:`build_decode` is the one path from a :class:`lab.core.plan.Plan` to a runnable generation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from kernels.mesh import make_mesh
from kernels.program import Built
from kernels.transformer.model import (
    HEADS,
    RESIDUAL,
    Cache,
    Params,
    _attend,
    _embed,
    _forward,
    _Layout,
    _logits,
    _mlp,
    _qkv,
    _rms_norm,
    abstract,
    cache_info,
    compute_dtype,
    init_params,
    param_info,
    shardings,
    synthetic_tokens,
    token_sharding,
    validate,
)
from lab.core.attention import Attention, check_backend, from_options
from lab.core.errors import UserError
from lab.core.models import ModelConfig
from lab.core.plan import Plan
from lab.core.rules import PRESETS, ShardingRules


def _cached_out(x: jax.Array, o: jax.Array, p: Params, lay: _Layout) -> jax.Array:
    """A cached step's attention output projected into the residual stream (scope ``out``, inside ``attention``):
    decode's and the paged serving step's, one program."""
    with jax.named_scope("out"):
        return x + lay.constrain(jnp.einsum("btnh,nhd->btd", o, p["wo"].astype(lay.dtype)), RESIDUAL)


def _cached_mlp(x: jax.Array, p: Params, cfg: ModelConfig, lay: _Layout) -> jax.Array:
    """A cached step's MLP half of the block, residual added (scope ``mlp``)."""
    with jax.named_scope("mlp"):
        return x + lay.constrain(_mlp(_rms_norm(x, p["mlp_norm"], cfg.norm_eps), p, cfg, lay), RESIDUAL)


def _layout(
    rules: ShardingRules | None, mesh: Mesh | None, dtype: str, decode: bool = False, attention: Attention | None = None
) -> _Layout:
    return _Layout(rules or PRESETS["single"], mesh, compute_dtype(dtype), decode, attention=attention or Attention())


def prefill(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    rules: ShardingRules | None = None,
    mesh: Mesh | None = None,
    dtype: str = "float32",
    attention: Attention | None = None,
) -> tuple[jax.Array, Cache]:
    """Run the prompt ``[B, T]``: the last position's logits ``[B, 1, V]`` (what sampling reads; serving engines
    make no others) and a KV cache ``[L, B, S, K, H]`` filled up to T."""
    lay = _layout(rules, mesh, dtype, attention=attention)
    logits, (k, v) = _forward(params, tokens, cfg, lay, keep_kv=True, last_only=True)  # k, v: [L, B, T, K, H]
    pad = ((0, 0), (0, 0), (0, cfg.max_seq_len - tokens.shape[1]), (0, 0), (0, 0))
    cache_axes = cache_info(cfg, tokens.shape[0])["k"].logical_axes
    cache = {name: lay.constrain(jnp.pad(a.astype(lay.dtype), pad), cache_axes) for name, a in (("k", k), ("v", v))}
    return logits, cache


def decode_step(
    params: Params,
    cache: Cache,
    token: jax.Array,
    pos: jax.Array | int,
    cfg: ModelConfig,
    rules: ShardingRules | None = None,
    mesh: Mesh | None = None,
    dtype: str = "float32",
    attention: Attention | None = None,
) -> tuple[jax.Array, Cache]:
    """One new token per sequence: ``token [B]`` at position ``pos`` -> logits ``[B, V]`` and the updated cache."""
    lay = _layout(rules, mesh, dtype, decode=True, attention=attention)
    pos = jnp.asarray(pos, jnp.int32)
    positions = pos[None]  # [T=1]
    x = _embed(params, token[:, None], cfg, lay)  # [B, 1, D]
    visible = (jnp.arange(cfg.max_seq_len) <= pos)[None, :]  # [T=1, S]
    zero = jnp.zeros((), jnp.int32)

    def body(x, layer):
        p, ck, cv = layer  # ck, cv: [B, S, K, H]
        x = lay.constrain(x, RESIDUAL)
        with jax.named_scope("attention"):
            h = _rms_norm(x, p["attn_norm"], cfg.norm_eps)
            q, k, v = _qkv(h, p, positions, cfg, lay)
            ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (zero, pos, zero, zero))
            cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (zero, pos, zero, zero))
            o = lay.constrain(_attend_cache(q, ck, cv, pos, visible, cfg, lay), HEADS)
            x = _cached_out(x, o, p, lay)
        return _cached_mlp(x, p, cfg, lay), (ck, cv)

    x, (k, v) = jax.lax.scan(body, x, (params["layers"], cache["k"], cache["v"]))
    cache_axes = cache_info(cfg, token.shape[0])["k"].logical_axes
    cache = {"k": lay.constrain(k, cache_axes), "v": lay.constrain(v, cache_axes)}
    return _logits(params, x, cfg, lay)[:, 0], cache


def _attend_cache(q, ck, cv, pos, visible, cfg: ModelConfig, lay: _Layout) -> jax.Array:
    """The step's attention over the cache: the einsum softmax, or the layout's kernel."""
    if not lay.attention.fused:
        return _attend(q, ck, cv, visible, cfg)
    from kernels.transformer.attention import attend_cache

    with jax.named_scope("scores"):
        return attend_cache(q, ck, cv, pos, lay.attention, lay.rules, lay.mesh)


def generate(
    params: Params,
    prompt: jax.Array,
    steps: int,
    cfg: ModelConfig,
    rules: ShardingRules | None = None,
    mesh: Mesh | None = None,
    dtype: str = "float32",
    attention: Attention | None = None,
) -> jax.Array:
    """Greedy decoding: ``steps`` new tokens ``[B, steps]`` after the prompt ``[B, T]`` (prefill + a scan)."""
    T = prompt.shape[1]
    if T + steps > cfg.max_seq_len + 1:
        raise UserError(f"prompt {T} + {steps} steps exceeds the KV cache (max-seq-len={cfg.max_seq_len})")
    logits, cache = prefill(params, prompt, cfg, rules, mesh, dtype, attention)
    with jax.named_scope("sample"):
        first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)  # [B]

    def body(carry, _):
        cache, tok, pos = carry
        logits, cache = decode_step(params, cache, tok, pos, cfg, rules, mesh, dtype, attention)
        with jax.named_scope("sample"):
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (cache, nxt, pos + 1), tok

    (_, last, _), toks = jax.lax.scan(body, (cache, first, jnp.int32(T)), None, length=steps - 1)
    return jnp.concatenate([toks.T, last[:, None]], axis=1)  # [B, steps]


def make_generate(
    cfg: ModelConfig,
    rules: ShardingRules,
    mesh: Mesh,
    steps: int,
    dtype: str = "float32",
    attention: Attention | None = None,
) -> Callable:
    """Jitted ``(params, prompt) -> tokens [B, steps]`` with pinned input and output shardings."""
    validate(cfg, rules, mesh)
    p_sh = shardings(param_info(cfg), rules, mesh)
    tok_sh = token_sharding(rules, mesh)
    fn = functools.partial(generate, steps=steps, cfg=cfg, rules=rules, mesh=mesh, dtype=dtype, attention=attention)
    return jax.jit(fn, in_shardings=(p_sh, tok_sh), out_shardings=tok_sh)


def build_decode(plan: Plan, mesh: Mesh | None = None, *, seed: int = 0) -> Built:
    """Greedy generation of a validated Plan: ``built.fn(*built.args)`` is ``[batch, steps]`` tokens."""
    plan.validate()
    cfg, rules = plan.model, plan.rules
    assert cfg is not None and rules is not None
    batch, prompt_len, steps = plan.sizes["batch"], plan.sizes["prompt_len"], plan.sizes["steps"]
    m = mesh if mesh is not None else make_mesh(plan.shape, slow=plan.slow_axes)
    attention = from_options(plan.options)
    if attention.fused:  # one line for a kernel these devices cannot run, before anything is traced
        check_backend(attention.impl, m.devices.flat[0].platform)
    fn = make_generate(cfg, rules, m, steps, plan.dtype, attention)
    tok_sh = token_sharding(rules, m)
    spec = (abstract(param_info(cfg), rules, m), jax.ShapeDtypeStruct((batch, prompt_len), "int32", sharding=tok_sh))

    def make_args():
        params = init_params(cfg, rules, m, jax.random.key(seed))
        return params, jax.device_put(synthetic_tokens(cfg, batch, prompt_len, seed), tok_sh)

    return Built(fn, spec, make_args)


__all__ = ["build_decode", "decode_step", "generate", "make_generate", "prefill"]
