"""A LLaMA-style decoder-only Transformer, sharded by a rules object: train step, prefill, decode.

Every array is first *declared* as an :class:`ArrayInfo` (shape, dtype, logical axes, initializer); a
:class:`ShardingRules` maps logical axes to the mesh axes :data:`DATA` and :data:`MODEL`, and a parallelism
strategy is nothing but another rules instance (:data:`RULES`). Shardings, per-device bytes, the divisibility
checks and the allocation itself all derive from the declarations, so a bad layout is refused with a
:class:`lab.core.errors.UserError` before anything is traced or compiled.

The model, in the book's letters (B batch, T sequence, D d_model, N heads, K kv-heads, G = N/K, H head_dim,
F d_ff, V vocab, L layers, S max_seq_len)::

    x[B, T, D]  = Embed[V, D][tokens]                                          "embed"
    per layer (jax.lax.scan over the stacked weights [L, ...]):
      h         = RMSNorm(x)                                                   "norm"
      q[B,T,N,H] = h *_D Wq[D, N, H];  k, v[B,T,K,H] = h *_D Wk, Wv[D, K, H]   "attention/qkv"
      q, k      = RoPE(q, k)                                                   "attention/rope"
      s[B,K,G,T,T] = q *_H k, causal softmax;  o[B,T,N,H] = s *_T v           "attention/scores"
      x        += o *_{N,H} Wo[N, H, D]                                        "attention/out"
      h         = RMSNorm(x)                                                   "norm"
      u[B,T,F]  = silu(h *_D Wgate[D, F]) . (h *_D Wup[D, F])                  "mlp/up"
      x        += u *_F Wdown[F, D]                                            "mlp/down"
    logits[B, T, V] = RMSNorm(x) *_D Wout[D, V]   (float32)                    "norm", "logits"

Rules, in the book's notation with X = ``data`` and Y = ``model``. ``tp`` is Megatron's column/row split:
``Wq[D, N_Y, H]`` and ``Wup[D, F_Y]`` are column-parallel, ``Wo[N_Y, H, D]`` and ``Wdown[F_Y, D]`` row-parallel,
so each half-block ends in ``AllReduce_Y`` of ``x[B_X, T, D]{U_Y}``; the embedding ``E[V_Y, D]`` is
vocab-parallel (masked local lookups, then ``AllReduce_Y``) and so are the logits ``[B_X, T, V_Y]`` (the loss
reduces max and sum over Y). ``tp_sp`` keeps the residual stream as ``x[B_X, T_Y, D]`` between blocks, so each
AllReduce becomes ``ReduceScatter_Y`` onto T plus an ``AllGather_Y`` before the next column-parallel matmul.
FSDP stores ``W[D_X, ...]``, all-gathers each layer's weights inside the scan (forward, and again in the
backward pass) and reduces their gradients back to ``W[D_X, ...]``:

=========  =====================  =================  ===============================  ==========
rules      batch                  weights' embed     heads, kv_heads, ffw, vocab      sequence
=========  =====================  =================  ===============================  ==========
single     -                      -                  -                                -
dp         (data, model)          -                  -                                -
fsdp       (data, model)          (data, model)      -                                -
tp         data                   -                  model                            -
tp_sp      data                   -                  model                            model
fsdp_tp    data                   data               model                            -
=========  =====================  =================  ===============================  ==========

What XLA's CPU backend compiles this to (read with :mod:`lab.compile.hlo`; see ``tests/test_transformer.py``): the
collectives above, except that every reduce-then-shard (the ``tp_sp`` ReduceScatter, the FSDP gradient
reduction) stays an ``all-reduce`` followed by a ``dynamic-slice``, gradients of several weights are reduced
in one tuple all-reduce, and bfloat16 collectives run in float32 (converted before and after).

Meshes use ``AxisType.Auto``: a whole Transformer under explicit axes would need ``out_sharding=`` on most
einsums, and the sharded-matmul kernels already teach explicit mode; here activations are pinned with
``jax.lax.with_sharding_constraint`` at block boundaries and the partitioner propagates the rest.

Attention is a plain einsum softmax, not a ``shard_map``: with heads sharded over ``model`` every head's
scores are local, so the partitioner inserts no communication there and a manual kernel would teach nothing.

Precision: parameters and AdamW state are float32 (master weights); ``compute_dtype`` (``bfloat16`` for
mixed precision) is what matmuls run in, parameters being cast at use; norms, softmax, logits and the loss are
float32. Activation recomputation (``remat``) uses the training estimator's vocabulary
(:data:`lab.predict.training.REMAT`): ``none``; ``selective`` keeps matmul outputs without batch dims (the
projections) and recomputes the rest, the attention softmax included (Korthikanti et al. 2022);
``full`` keeps only each layer's input.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels.mesh import make_mesh
from lab.core.errors import UserError
from lab.core.models import ModelConfig

# Mesh axes, named once (major to minor).
DATA = "data"
MODEL = "model"
MESH_AXES = (DATA, MODEL)

REMAT = ("none", "selective", "full")  # the same words as lab.predict.training.REMAT
COMPUTE_DTYPES = {"float32": "float32", "fp32": "float32", "f32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}

Axes = str | tuple[str, ...] | None
Params = dict[str, Any]
Cache = dict[str, jax.Array]


# ----- configuration --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformerConfig:
    """Dims of the Transformer this module builds (LLaMA-style: SwiGLU, RoPE, RMSNorm, untied, no biases).

    Attributes:
        vocab, d_model, layers, heads, kv_heads, head_dim, d_ff: V, D, L, N, K, H, F.
        max_seq_len: S, the length of the KV cache (and the longest prompt plus generation).
        rope_theta: base of the rotary frequencies.
        norm_eps: RMSNorm epsilon.
        compute_dtype: ``float32`` or ``bfloat16`` (matmul dtype; params and optimizer state stay float32).
    """

    vocab: int
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    d_ff: int
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    compute_dtype: str = "float32"

    def __post_init__(self) -> None:
        for f in ("vocab", "d_model", "layers", "heads", "kv_heads", "head_dim", "d_ff", "max_seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise UserError(f"transformer: {f.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.heads % self.kv_heads:
            raise UserError(
                f"transformer: heads={self.heads} is not a multiple of kv-heads={self.kv_heads}; "
                f"use a divisor of {self.heads}"
            )
        if self.head_dim % 2:
            raise UserError(f"transformer: head-dim={self.head_dim} must be even for rotary embeddings")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise UserError(f"transformer: compute-dtype {self.compute_dtype!r} is not one of float32, bfloat16")
        object.__setattr__(self, "compute_dtype", COMPUTE_DTYPES[self.compute_dtype])

    @property
    def groups(self) -> int:
        """G = N / K, query heads per KV head."""
        return self.heads // self.kv_heads

    @property
    def dtype(self) -> jnp.dtype:
        """The compute dtype as a JAX dtype."""
        return jnp.dtype(self.compute_dtype)

    @property
    def params(self) -> int:
        """Parameter count (equals :attr:`lab.core.models.ModelConfig.params` for the same dims)."""
        return sum(math.prod(a.shape) for a in jax.tree.leaves(param_info(self), is_leaf=_is_info))

    @classmethod
    def from_model(cls, m: ModelConfig, **kw: Any) -> TransformerConfig:
        """The dims of a catalog model; ``kw`` overrides fields (e.g. ``layers=2, max_seq_len=512``).

        Raises:
            UserError: the model has features this kernel does not build (MoE, GeLU MLP, tied embeddings,
                learned positions, LayerNorm, biases), which would change its parameters and FLOPs.
        """
        unsupported = [
            what
            for what, bad in (
                (f"experts={m.experts}", m.is_moe),
                ("a two-matrix (non-gated) MLP", not m.gated_mlp),
                ("tied embeddings", m.tied_embeddings),
                ("learned positions", m.learned_positions),
                (f"norm={m.norm}", m.norm != "rmsnorm"),
                ("biases", m.biases),
            )
            if bad
        ]
        if unsupported:
            raise UserError(
                f"model {m.name!r} has {', '.join(unsupported)}; kernels.transformer builds LLaMA-style models "
                "only (SwiGLU, RoPE, RMSNorm, untied, no biases, dense)"
            )
        fields = dict(
            vocab=m.vocab,
            d_model=m.d_model,
            layers=m.layers,
            heads=m.heads,
            kv_heads=m.kv_heads,
            head_dim=m.head_dim,
            d_ff=m.d_ff,
            max_seq_len=m.max_seq_len,
        )
        return cls(**(fields | kw))


# Prime-ish multiples of the tensor-parallel degrees 2 and 4 (and of 8 where FSDP shards over both axes), so a
# transposed or mis-sharded dim fails at once: D = 7*8, F = 13*8, V = 11*8, H = 12 (q width 96 != D).
TINY = TransformerConfig(vocab=88, d_model=56, layers=2, heads=8, kv_heads=4, head_dim=12, d_ff=104, max_seq_len=64)


# ----- sharding rules -------------------------------------------------------------------------------------------

# Logical names that are never sharded, accepted for documentation.
UNSHARDED = ("layers", "head_dim", "kv_seq")


@dataclass(frozen=True)
class ShardingRules:
    """Which mesh axes each logical dim is split over (None: replicated).

    Attributes:
        batch: B of activations, tokens and the KV cache.
        sequence: T of the residual stream between blocks (sequence parallelism).
        embed: D of the *weights* (FSDP shards it).
        act_embed: D of activations (normally None).
        heads, kv_heads: N and K of weights, activations and the KV cache.
        ffw: F of the MLP weights and hidden activation.
        vocab: V of the embedding tables and logits.
    """

    batch: Axes = None
    sequence: Axes = None
    embed: Axes = None
    act_embed: Axes = None
    heads: Axes = None
    kv_heads: Axes = None
    ffw: Axes = None
    vocab: Axes = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            ok = v is None or isinstance(v, str) or (isinstance(v, tuple) and all(isinstance(a, str) for a in v))
            if not ok:
                raise UserError(f"sharding rules: {f.name}={v!r} must be a mesh axis name, a tuple of them, or None")

    def axes(self, logical: str | None) -> tuple[str, ...]:
        """Mesh axes of one logical dim, as a tuple (empty when replicated)."""
        if logical is None or logical in UNSHARDED:
            return ()
        if logical not in _RULE_FIELDS:
            raise UserError(f"unknown logical dim {logical!r}; valid: {', '.join(_RULE_FIELDS + UNSHARDED)} (or None)")
        v = getattr(self, logical)
        return () if v is None else ((v,) if isinstance(v, str) else tuple(v))

    def logical_to_physical(self, logical: tuple[str | None, ...], what: str = "an array") -> P:
        """The ``PartitionSpec`` of an array with these logical dims.

        Raises:
            UserError: one mesh axis would serve two logical dims of the array (naming the axis and both dims).
        """
        used: dict[str, str] = {}
        spec: list[Axes] = []
        for name in logical:
            axes = self.axes(name)
            for a in axes:
                if a in used:
                    raise UserError(
                        f"sharding rules map mesh axis {a!r} to both {used[a]!r} and {name!r} of {what} "
                        f"(logical dims {logical}); one mesh axis can split only one dim of an array"
                    )
                used[a] = name
            spec.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
        return P(*spec)


_RULE_FIELDS = tuple(f.name for f in dataclasses.fields(ShardingRules))

_TP = dict(heads=MODEL, kv_heads=MODEL, ffw=MODEL, vocab=MODEL)
RULES: dict[str, ShardingRules] = {
    "single": ShardingRules(),
    "dp": ShardingRules(batch=(DATA, MODEL)),
    "fsdp": ShardingRules(batch=(DATA, MODEL), embed=(DATA, MODEL)),  # ZeRO-3 over every device
    "tp": ShardingRules(batch=DATA, **_TP),  # Megatron: column-parallel in, row-parallel out
    "tp_sp": ShardingRules(batch=DATA, sequence=MODEL, **_TP),  # + the residual stream split along T
    "fsdp_tp": ShardingRules(batch=DATA, embed=DATA, **_TP),
}


def get_rules(name: str) -> ShardingRules:
    """A preset from :data:`RULES` by name."""
    if name not in RULES:
        raise UserError(f"unknown sharding rules {name!r}; valid: {', '.join(RULES)}")
    return RULES[name]


def mesh_shape(axes: Mapping[str, int] | Mesh) -> dict[str, int]:
    """``{"data": ..., "model": ...}`` from a mesh or a partial dict (a missing axis has size 1)."""
    if isinstance(axes, Mesh):
        missing = [a for a in MESH_AXES if a not in axes.axis_names]
        if missing:
            raise UserError(f"mesh axes {axes.axis_names} lack {missing}; the transformer needs {MESH_AXES}")
        return dict(axes.shape)
    unknown = [a for a in axes if a not in MESH_AXES]
    if unknown:
        raise UserError(f"mesh axis {unknown[0]!r} is not one of {', '.join(MESH_AXES)}")
    return {a: int(axes.get(a, 1)) for a in MESH_AXES}


def transformer_mesh(axes: Mapping[str, int] | Mesh) -> Mesh:
    """A ``data x model`` mesh from ``{"data": 2, "model": 4}``; a missing axis has size 1."""
    if isinstance(axes, Mesh):
        mesh_shape(axes)
        return axes
    return make_mesh(mesh_shape(axes))


# ----- abstract arrays ------------------------------------------------------------------------------------------

Init = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


@dataclass(frozen=True)
class ArrayInfo:
    """An array described before it exists: global shape, dtype, one logical name per dim, initializer."""

    shape: tuple[int, ...]
    dtype: Any
    logical_axes: tuple[str | None, ...]
    init: Init | None = None

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.logical_axes):
            raise ValueError(f"shape {self.shape} and logical axes {self.logical_axes} differ in rank")

    def spec(self, rules: ShardingRules, what: str = "an array") -> P:
        return rules.logical_to_physical(self.logical_axes, what)

    def bytes_per_device(self, rules: ShardingRules, mesh_sizes: Mapping[str, int]) -> float:
        """Bytes one device holds: global bytes over the product of the mesh axes splitting it."""
        shards = math.prod(mesh_sizes[a] for name in self.logical_axes for a in rules.axes(name))
        return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize / shards


def _is_info(x: Any) -> bool:
    return isinstance(x, ArrayInfo)


def _normal(stddev: float) -> Init:
    return jax.nn.initializers.normal(stddev)


def param_info(cfg: TransformerConfig) -> dict[str, Any]:
    """Every parameter as an :class:`ArrayInfo`; layer weights stacked on a leading ``layers`` dim."""
    L, D, N, K, H, F, V = cfg.layers, cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab
    f32 = jnp.float32
    ones = jax.nn.initializers.ones
    return {
        "embed": ArrayInfo((V, D), f32, ("vocab", "embed"), _normal(1.0)),
        "layers": {
            "attn_norm": ArrayInfo((L, D), f32, ("layers", "embed"), ones),
            "wq": ArrayInfo((L, D, N, H), f32, ("layers", "embed", "heads", "head_dim"), _normal(D**-0.5)),
            "wk": ArrayInfo((L, D, K, H), f32, ("layers", "embed", "kv_heads", "head_dim"), _normal(D**-0.5)),
            "wv": ArrayInfo((L, D, K, H), f32, ("layers", "embed", "kv_heads", "head_dim"), _normal(D**-0.5)),
            "wo": ArrayInfo((L, N, H, D), f32, ("layers", "heads", "head_dim", "embed"), _normal((N * H) ** -0.5)),
            "mlp_norm": ArrayInfo((L, D), f32, ("layers", "embed"), ones),
            "w_gate": ArrayInfo((L, D, F), f32, ("layers", "embed", "ffw"), _normal(D**-0.5)),
            "w_up": ArrayInfo((L, D, F), f32, ("layers", "embed", "ffw"), _normal(D**-0.5)),
            "w_down": ArrayInfo((L, F, D), f32, ("layers", "ffw", "embed"), _normal(F**-0.5)),
        },
        "final_norm": ArrayInfo((D,), f32, ("embed",), ones),
        "unembed": ArrayInfo((D, V), f32, ("embed", "vocab"), _normal(D**-0.5)),
    }


def activation_info(cfg: TransformerConfig, batch: int, seq: int, *, decode: bool = False) -> dict[str, ArrayInfo]:
    """The activations the model pins with ``with_sharding_constraint`` (and the token inputs).

    In decode (``decode=True``, one new token) the residual stream is not split along T.
    """
    B, T, cd = batch, seq, cfg.dtype
    return {
        "tokens": ArrayInfo((B, T), jnp.int32, ("batch", None)),
        "residual": ArrayInfo((B, T, cfg.d_model), cd, ("batch", None if decode else "sequence", "act_embed")),
        "q": ArrayInfo((B, T, cfg.heads, cfg.head_dim), cd, ("batch", None, "heads", "head_dim")),
        "kv": ArrayInfo((B, T, cfg.kv_heads, cfg.head_dim), cd, ("batch", None, "kv_heads", "head_dim")),
        "mlp_hidden": ArrayInfo((B, T, cfg.d_ff), cd, ("batch", None, "ffw")),
        "logits": ArrayInfo((B, T, cfg.vocab), jnp.float32, ("batch", None, "vocab")),
    }


def cache_info(cfg: TransformerConfig, batch: int) -> dict[str, ArrayInfo]:
    """The KV cache: ``k`` and ``v`` of ``[layers, batch, max_seq, kv_heads, head_dim]`` in the compute dtype."""
    shape = (cfg.layers, batch, cfg.max_seq_len, cfg.kv_heads, cfg.head_dim)
    axes = ("layers", "batch", "kv_seq", "kv_heads", "head_dim")
    return {"k": ArrayInfo(shape, cfg.dtype, axes), "v": ArrayInfo(shape, cfg.dtype, axes)}


def _named(tree: Any) -> list[tuple[str, ArrayInfo]]:
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_info)
    return [(jax.tree_util.keystr(path, simple=True, separator="/"), leaf) for path, leaf in leaves]


def _check_dim(logical: str | None, size: int, rules: ShardingRules, mesh_sizes: Mapping[str, int], where: str):
    axes = rules.axes(logical)
    mesh = ", ".join(f"{k}={v}" for k, v in mesh_sizes.items())
    for a in axes:
        if a not in mesh_sizes:
            raise UserError(f"sharding rules map {logical!r} to mesh axis {a!r}, which the mesh ({mesh}) lacks")
    degree = math.prod(mesh_sizes[a] for a in axes)
    if size % degree:
        ax = f"mesh axis {axes[0]!r}" if len(axes) == 1 else f"mesh axes {axes}"
        raise UserError(
            f"{logical}={size} ({where}) is not divisible by {ax} of size {degree} (mesh {mesh}); "
            f"make {logical} a multiple of {degree} or choose other rules"
        )


def check_layout(infos: Any, rules: ShardingRules, mesh_sizes: Mapping[str, int]) -> None:
    """Refuse a layout before compiling: unknown mesh axes, one axis on two dims, indivisible dims.

    Raises:
        UserError: naming the array, the logical dim, its size, the mesh axes and their size.
    """
    for name, info in _named(infos):
        info.spec(rules, name)  # one mesh axis serving two dims of this array
        for logical, size in zip(info.logical_axes, info.shape, strict=True):
            _check_dim(logical, size, rules, mesh_sizes, f"in {name}")


def validate(
    cfg: TransformerConfig,
    rules: ShardingRules,
    mesh: Mesh | Mapping[str, int],
    *,
    batch: int | None = None,
    seq: int | None = None,
    decode: bool = False,
) -> None:
    """Check the model (and, given ``batch``/``seq``, activations; with ``decode`` the KV cache) against the mesh.

    The model's own dims come first, in a fixed order (heads, kv_heads, ffw, vocab, embed, then batch and
    sequence), so the message names the dim a user would change; then every declared array, for conflicts.

    Raises:
        UserError: before anything is traced or compiled.
    """
    shape = dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh)
    dims = [("heads", cfg.heads), ("kv_heads", cfg.kv_heads), ("ffw", cfg.d_ff), ("vocab", cfg.vocab)]
    dims += [("embed", cfg.d_model), ("act_embed", cfg.d_model)]
    if batch is not None:
        dims.append(("batch", batch))
        if seq is not None:
            dims.append(("sequence", seq))
    for logical, size in dims:
        _check_dim(logical, size, rules, shape, "the model" if logical not in ("batch", "sequence") else "the input")
    check_layout(param_info(cfg), rules, shape)
    if batch is not None:
        check_layout(activation_info(cfg, batch, seq or 1), rules, shape)  # training, or the prefill
        if decode:  # one token at a time into the cache
            check_layout(activation_info(cfg, batch, 1, decode=True), rules, shape)
            check_layout(cache_info(cfg, batch), rules, shape)


def shardings(infos: Any, rules: ShardingRules, mesh: Mesh) -> Any:
    """The ``NamedSharding`` of every :class:`ArrayInfo` in a pytree (same structure)."""
    flat, treedef = jax.tree.flatten(infos, is_leaf=_is_info)
    names = [n for n, _ in _named(infos)]
    return treedef.unflatten([NamedSharding(mesh, i.spec(rules, n)) for n, i in zip(names, flat, strict=True)])


def param_bytes_per_device(cfg: TransformerConfig, rules: ShardingRules, mesh_sizes: Mapping[str, int]) -> float:
    """Float32 parameter bytes one device holds under the rules."""
    return sum(i.bytes_per_device(rules, mesh_sizes) for _, i in _named(param_info(cfg)))


def init_params(cfg: TransformerConfig, rules: ShardingRules, mesh: Mesh, key: jax.Array) -> Params:
    """Allocate every parameter directly with its ``NamedSharding`` (never a full copy on one device).

    Values depend on ``key`` only, not on the rules or mesh (JAX's random bits are sharding-invariant).
    """
    info = param_info(cfg)
    validate(cfg, rules, mesh)
    flat, treedef = jax.tree.flatten(info, is_leaf=_is_info)

    def init(key):
        keys = jax.random.split(key, len(flat))
        return treedef.unflatten([i.init(k, i.shape, i.dtype) for i, k in zip(flat, keys, strict=True)])

    return jax.jit(init, out_shardings=shardings(info, rules, mesh))(key)


# ----- the model ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """Rules plus the mesh they place on; without a mesh nothing is constrained (propagation only)."""

    rules: ShardingRules
    mesh: Mesh | None
    decode: bool = False

    def constrain(self, x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
        if self.mesh is None:
            return x
        if self.decode:  # one token: the residual stream is not split along T
            logical = tuple(None if a == "sequence" else a for a in logical)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.rules.logical_to_physical(logical)))


RESIDUAL = ("batch", "sequence", "act_embed")
HEADS = ("batch", None, "heads", "head_dim")
KV_HEADS = ("batch", None, "kv_heads", "head_dim")


def _rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    with jax.named_scope("norm"):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate pairs ``(x_i, x_{i+H/2})`` by ``position * theta^(-2i/H)``; x ``[B, T, n, H]``, positions ``[T]``."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / x.shape[-1])  # [H/2]
    angle = positions.astype(jnp.float32)[:, None] * freq  # [T, H/2]
    sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]  # [1, T, 1, H/2]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _qkv(h: jax.Array, p: Params, positions: jax.Array, cfg: TransformerConfig, lay: _Layout):
    cd = cfg.dtype
    with jax.named_scope("qkv"):
        q = lay.constrain(jnp.einsum("btd,dnh->btnh", h, p["wq"].astype(cd)), HEADS)  # [B, T, N, H]
        k = lay.constrain(jnp.einsum("btd,dkh->btkh", h, p["wk"].astype(cd)), KV_HEADS)  # [B, T, K, H]
        v = lay.constrain(jnp.einsum("btd,dkh->btkh", h, p["wv"].astype(cd)), KV_HEADS)  # [B, T, K, H]
    with jax.named_scope("rope"):
        q, k = _rope(q, positions, cfg.rope_theta), _rope(k, positions, cfg.rope_theta)
    return q, k, v


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, cfg: TransformerConfig) -> jax.Array:
    """Grouped-query softmax attention: q ``[B, T, N, H]``, k, v ``[B, S, K, H]``, mask ``[T, S]`` -> ``[B, T, N, H]``.

    Query head ``n`` reads KV head ``n // G``; scores and softmax are float32.
    """
    B, T, N, H = q.shape
    with jax.named_scope("scores"):
        qg = q.reshape(B, T, cfg.kv_heads, cfg.groups, H)  # [B, T, K, G, H]: head n = k * G + g
        s = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * H**-0.5
        s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
        w = jax.nn.softmax(s, axis=-1).astype(q.dtype)  # [B, K, G, T, S]
        o = jnp.einsum("bkgts,bskh->btkgh", w, v)
    return o.reshape(B, T, N, H)


def _mlp(h: jax.Array, p: Params, cfg: TransformerConfig, lay: _Layout) -> jax.Array:
    cd = cfg.dtype
    with jax.named_scope("up"):
        gate = jnp.einsum("btd,df->btf", h, p["w_gate"].astype(cd))
        up = jnp.einsum("btd,df->btf", h, p["w_up"].astype(cd))
        u = lay.constrain(jax.nn.silu(gate) * up, ("batch", None, "ffw"))  # [B, T, F]
    with jax.named_scope("down"):
        return jnp.einsum("btf,fd->btd", u, p["w_down"].astype(cd))  # [B, T, D]{U over ffw}


def _block(x: jax.Array, p: Params, positions: jax.Array, cfg: TransformerConfig, lay: _Layout):
    """One pre-norm residual block over the whole sequence (causal). Returns the new x and this layer's k, v."""
    x = lay.constrain(x, RESIDUAL)
    T = x.shape[1]
    with jax.named_scope("attention"):
        h = _rms_norm(x, p["attn_norm"], cfg.norm_eps)
        q, k, v = _qkv(h, p, positions, cfg, lay)
        causal = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]  # [T, S]
        o = lay.constrain(_attend(q, k, v, causal, cfg), HEADS)
        with jax.named_scope("out"):
            x = x + lay.constrain(jnp.einsum("btnh,nhd->btd", o, p["wo"].astype(cfg.dtype)), RESIDUAL)
    with jax.named_scope("mlp"):
        h = _rms_norm(x, p["mlp_norm"], cfg.norm_eps)
        x = x + lay.constrain(_mlp(h, p, cfg, lay), RESIDUAL)
    return x, (k, v)


def _remat_policy(remat: str):
    if remat not in REMAT:
        raise UserError(f"unknown remat {remat!r}; valid: {', '.join(REMAT)}")
    return {
        "none": None,
        # Projections (matmuls against weights, no batch dims) are kept; scores, softmax, AV, norms and the MLP
        # activation are recomputed in the backward pass.
        "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        "full": jax.checkpoint_policies.nothing_saveable,  # only the layer input (the scan carry) is kept
    }[remat]


def _embed(params: Params, tokens: jax.Array, cfg: TransformerConfig, lay: _Layout) -> jax.Array:
    with jax.named_scope("embed"):
        table = lay.constrain(params["embed"], ("vocab", None))  # FSDP: gather D; keep V split (Megatron)
        x = jnp.take(table, tokens, axis=0).astype(cfg.dtype)  # [B, T, D]
        x = lay.constrain(x, ("batch", None, "act_embed"))  # masked local lookups summed over the vocab axes
        return lay.constrain(x, RESIDUAL)


def _logits(params: Params, x: jax.Array, cfg: TransformerConfig, lay: _Layout) -> jax.Array:
    x = _rms_norm(x, params["final_norm"], cfg.norm_eps)
    with jax.named_scope("logits"):
        logits = jnp.einsum(
            "btd,dv->btv", x, params["unembed"].astype(cfg.dtype), preferred_element_type=jnp.float32
        )  # [B, T, V] float32
        return lay.constrain(logits, ("batch", None, "vocab"))


def _forward(params, tokens, cfg, lay, remat="none", *, keep_kv=False):
    T = tokens.shape[1]
    positions = jnp.arange(T)
    x = _embed(params, tokens, cfg, lay)

    def body(x, p):
        x, kv = _block(x, p, positions, cfg, lay)
        return x, (kv if keep_kv else None)

    policy = _remat_policy(remat)
    if remat != "none":
        # prevent_cse=False: scan already keeps the recomputation from being merged with the forward pass.
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    x, kv = jax.lax.scan(body, x, params["layers"])
    return _logits(params, lay.constrain(x, RESIDUAL), cfg, lay), kv


def forward(
    params: Params,
    tokens: jax.Array,
    cfg: TransformerConfig,
    rules: ShardingRules | None = None,
    mesh: Mesh | None = None,
    remat: str = "none",
) -> jax.Array:
    """Logits ``[B, T, V]`` (float32) of int tokens ``[B, T]``; activations pinned when ``mesh`` is given."""
    return _forward(params, tokens, cfg, _Layout(rules or RULES["single"], mesh), remat)[0]


def loss_fn(
    params: Params,
    tokens: jax.Array,
    cfg: TransformerConfig,
    rules: ShardingRules | None = None,
    mesh: Mesh | None = None,
    remat: str = "none",
) -> jax.Array:
    """Mean next-token cross entropy (float32): position t predicts token t+1; the last position is masked.

    The target logit is picked with a one-hot product rather than a gather, so vocab-sharded logits reduce
    with one AllReduce over the vocab axes (Megatron's vocab-parallel cross entropy) instead of a gather.
    """
    logits = forward(params, tokens, cfg, rules, mesh, remat)
    B, T, V = logits.shape
    targets = jnp.roll(tokens, -1, axis=1)
    mask = (jnp.arange(T) < T - 1).astype(jnp.float32)  # [T]
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
    target_logit = jnp.sum(logits * jax.nn.one_hot(targets, V, dtype=jnp.float32), axis=-1)
    return jnp.sum((lse - target_logit) * mask) / (B * (T - 1))


# ----- training -------------------------------------------------------------------------------------------------


def optimizer(learning_rate: float = 1e-2) -> optax.GradientTransformation:
    """AdamW with optax's defaults (b1 0.9, b2 0.999, weight decay 1e-4); state float32 like the params."""
    return optax.adamw(learning_rate)


def opt_state_shardings(tx: optax.GradientTransformation, cfg: TransformerConfig, rules: ShardingRules, mesh: Mesh):
    """Shardings of the optimizer state: every moment like its parameter (FSDP shards it); scalars replicated."""
    p_sh = shardings(param_info(cfg), rules, mesh)
    abstract = jax.eval_shape(
        tx.init, jax.tree.map(lambda i: jax.ShapeDtypeStruct(i.shape, i.dtype), param_info(cfg), is_leaf=_is_info)
    )
    return optax.tree_map_params(
        tx, lambda _, s: s, abstract, p_sh, transform_non_params=lambda _: NamedSharding(mesh, P())
    )


def init_opt_state(params: Params, cfg: TransformerConfig, rules: ShardingRules, mesh: Mesh, learning_rate=1e-2):
    """AdamW state allocated with :func:`opt_state_shardings`."""
    tx = optimizer(learning_rate)
    return jax.jit(tx.init, out_shardings=opt_state_shardings(tx, cfg, rules, mesh))(params)


def make_grads_fn(cfg: TransformerConfig, rules: ShardingRules, mesh: Mesh, remat: str = "none") -> Callable:
    """Jitted ``(params, tokens) -> (loss, grads)``, gradients placed like the parameters."""
    _remat_policy(remat)
    validate(cfg, rules, mesh)
    p_sh = shardings(param_info(cfg), rules, mesh)
    tok_sh = NamedSharding(mesh, rules.logical_to_physical(("batch", None), "tokens"))

    def grads(params, tokens):
        return jax.value_and_grad(loss_fn)(params, tokens, cfg, rules, mesh, remat)

    return jax.jit(grads, in_shardings=(p_sh, tok_sh), out_shardings=(NamedSharding(mesh, P()), p_sh))


def make_train_step(
    cfg: TransformerConfig, rules: ShardingRules, mesh: Mesh, remat: str = "none", learning_rate: float = 1e-2
) -> Callable:
    """Jitted ``step(params, opt_state, tokens) -> (params, opt_state, loss)``: one AdamW step.

    Parameters and optimizer state are donated (updated in place) and keep their shardings; gradients are
    pinned to the parameters' shardings, so under FSDP they leave the backward pass reduce-scattered.
    """
    _remat_policy(remat)
    validate(cfg, rules, mesh)
    tx = optimizer(learning_rate)
    p_sh = shardings(param_info(cfg), rules, mesh)
    o_sh = opt_state_shardings(tx, cfg, rules, mesh)
    tok_sh = NamedSharding(mesh, rules.logical_to_physical(("batch", None), "tokens"))

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, cfg, rules, mesh, remat)
        grads = jax.lax.with_sharding_constraint(grads, p_sh)
        with jax.named_scope("optimizer"):
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    return jax.jit(
        step,
        in_shardings=(p_sh, o_sh, tok_sh),
        out_shardings=(p_sh, o_sh, NamedSharding(mesh, P())),
        donate_argnums=(0, 1),
    )


def synthetic_tokens(cfg: TransformerConfig, batch: int, seq: int, seed: int = 0) -> np.ndarray:
    """A fixed int32 token batch ``[batch, seq]`` (host numpy), the same for every mesh."""
    return np.random.default_rng(seed).integers(0, cfg.vocab, size=(batch, seq), dtype=np.int32)


def build_train(
    cfg: TransformerConfig,
    rules_name: str,
    mesh: Mapping[str, int] | Mesh,
    batch: int,
    seq: int,
    remat: str = "none",
    seed: int = 0,
    learning_rate: float = 1e-2,
):
    """A train step and its placed arguments: ``step, (params, opt_state, tokens)``.

    ``step(*args)`` runs one step (donating params and opt_state); ``step.lower(*args).compile()`` compiles
    it. Everything is validated (:func:`validate`) before anything is traced.
    """
    rules = get_rules(rules_name)
    _remat_policy(remat)
    if seq < 2 or seq > cfg.max_seq_len:
        raise UserError(f"seq={seq} must be between 2 and max-seq-len={cfg.max_seq_len}")
    shape = mesh_shape(mesh)
    validate(cfg, rules, shape, batch=batch, seq=seq)
    m = transformer_mesh(mesh)
    step = make_train_step(cfg, rules, m, remat, learning_rate)
    params = init_params(cfg, rules, m, jax.random.key(seed))
    opt_state = init_opt_state(params, cfg, rules, m, learning_rate)
    tok_sh = NamedSharding(m, rules.logical_to_physical(("batch", None), "tokens"))
    tokens = jax.device_put(synthetic_tokens(cfg, batch, seq, seed), tok_sh)
    return step, (params, opt_state, tokens)


# ----- inference ------------------------------------------------------------------------------------------------


def prefill(
    params: Params,
    tokens: jax.Array,
    cfg: TransformerConfig,
    rules: ShardingRules | None = None,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, Cache]:
    """Run the prompt ``[B, T]``: logits ``[B, T, V]`` and a KV cache ``[L, B, S, K, H]`` filled up to T."""
    lay = _Layout(rules or RULES["single"], mesh)
    logits, (k, v) = _forward(params, tokens, cfg, lay, keep_kv=True)  # k, v: [L, B, T, K, H]
    pad = ((0, 0), (0, 0), (0, cfg.max_seq_len - tokens.shape[1]), (0, 0), (0, 0))
    cache_axes = cache_info(cfg, tokens.shape[0])["k"].logical_axes
    cache = {name: lay.constrain(jnp.pad(a.astype(cfg.dtype), pad), cache_axes) for name, a in (("k", k), ("v", v))}
    return logits, cache


def decode_step(
    params: Params,
    cache: Cache,
    token: jax.Array,
    pos: jax.Array | int,
    cfg: TransformerConfig,
    rules: ShardingRules | None = None,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, Cache]:
    """One new token per sequence: ``token [B]`` at position ``pos`` -> logits ``[B, V]`` and the updated cache.

    The cache keeps ``[L, B_data, S, K_model, H]`` (batch over the rules' batch axes, kv_heads over theirs):
    each layer writes its new k, v at ``pos`` and attends over positions ``<= pos``.
    """
    lay = _Layout(rules or RULES["single"], mesh, decode=True)
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
            o = lay.constrain(_attend(q, ck, cv, visible, cfg), HEADS)
            with jax.named_scope("out"):
                x = x + lay.constrain(jnp.einsum("btnh,nhd->btd", o, p["wo"].astype(cfg.dtype)), RESIDUAL)
        with jax.named_scope("mlp"):
            x = x + lay.constrain(_mlp(_rms_norm(x, p["mlp_norm"], cfg.norm_eps), p, cfg, lay), RESIDUAL)
        return x, (ck, cv)

    x, (k, v) = jax.lax.scan(body, x, (params["layers"], cache["k"], cache["v"]))
    cache_axes = cache_info(cfg, token.shape[0])["k"].logical_axes
    cache = {"k": lay.constrain(k, cache_axes), "v": lay.constrain(v, cache_axes)}
    return _logits(params, x, cfg, lay)[:, 0], cache


def generate(
    params: Params,
    prompt: jax.Array,
    steps: int,
    cfg: TransformerConfig,
    rules: ShardingRules | None = None,
    mesh: Mesh | None = None,
) -> jax.Array:
    """Greedy decoding: ``steps`` new tokens ``[B, steps]`` after the prompt ``[B, T]`` (prefill + a scan)."""
    T = prompt.shape[1]
    if T + steps > cfg.max_seq_len + 1:
        raise UserError(f"prompt {T} + {steps} steps exceeds the KV cache (max-seq-len={cfg.max_seq_len})")
    logits, cache = prefill(params, prompt, cfg, rules, mesh)
    first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)  # [B]

    def body(carry, _):
        cache, tok, pos = carry
        logits, cache = decode_step(params, cache, tok, pos, cfg, rules, mesh)
        return (cache, jnp.argmax(logits, axis=-1).astype(jnp.int32), pos + 1), tok

    (_, last, _), toks = jax.lax.scan(body, (cache, first, jnp.int32(T)), None, length=steps - 1)
    return jnp.concatenate([toks.T, last[:, None]], axis=1)  # [B, steps]


def make_generate(cfg: TransformerConfig, rules: ShardingRules, mesh: Mesh, steps: int) -> Callable:
    """Jitted ``(params, prompt) -> tokens [B, steps]`` with pinned input and output shardings."""
    validate(cfg, rules, mesh)
    p_sh = shardings(param_info(cfg), rules, mesh)
    tok_sh = NamedSharding(mesh, rules.logical_to_physical(("batch", None), "tokens"))
    fn = functools.partial(generate, steps=steps, cfg=cfg, rules=rules, mesh=mesh)
    return jax.jit(fn, in_shardings=(p_sh, tok_sh), out_shardings=tok_sh)


def build_decode(
    cfg: TransformerConfig,
    rules_name: str,
    mesh: Mapping[str, int] | Mesh,
    batch: int,
    prompt_len: int,
    steps: int,
    seed: int = 0,
):
    """Greedy generation and its placed arguments: ``fn, (params, prompt)``; ``fn(*args)`` is ``[B, steps]``."""
    rules = get_rules(rules_name)
    if steps < 1 or prompt_len < 1 or prompt_len + steps > cfg.max_seq_len + 1:
        raise UserError(
            f"prompt-len={prompt_len} + steps={steps} must be positive and fit max-seq-len={cfg.max_seq_len} (+1)"
        )
    shape = mesh_shape(mesh)
    validate(cfg, rules, shape, batch=batch, seq=prompt_len, decode=True)
    m = transformer_mesh(mesh)
    fn = make_generate(cfg, rules, m, steps)
    params = init_params(cfg, rules, m, jax.random.key(seed))
    tok_sh = NamedSharding(m, rules.logical_to_physical(("batch", None), "tokens"))
    prompt = jax.device_put(synthetic_tokens(cfg, batch, prompt_len, seed), tok_sh)
    return fn, (params, prompt)


__all__ = [
    "DATA",
    "MODEL",
    "REMAT",
    "RULES",
    "TINY",
    "ArrayInfo",
    "ShardingRules",
    "TransformerConfig",
    "activation_info",
    "build_decode",
    "build_train",
    "cache_info",
    "check_layout",
    "decode_step",
    "forward",
    "generate",
    "get_rules",
    "init_opt_state",
    "init_params",
    "loss_fn",
    "make_generate",
    "make_grads_fn",
    "make_train_step",
    "mesh_shape",
    "opt_state_shardings",
    "param_bytes_per_device",
    "param_info",
    "prefill",
    "shardings",
    "synthetic_tokens",
    "transformer_mesh",
    "validate",
]
