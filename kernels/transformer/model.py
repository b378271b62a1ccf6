"""The LLaMA-style decoder: its arrays and forward pass, placed by sharding rules (the train step and decode
are in ``train`` and ``decode``).

The model is the catalog's :class:`lab.core.models.ModelConfig` (one model config for the estimators and this
kernel); its arrays are declared in :mod:`lab.core.arrays` by shape and logical dims, and here they get a dtype
and an initializer (:class:`ArrayInfo`). A :class:`lab.core.rules.ShardingRules` maps logical dims to mesh
axes, so a parallelism strategy is one more rules instance (:data:`lab.core.rules.PRESETS`). A bad layout is
refused with a :class:`lab.core.errors.UserError` before anything is traced.

In the book's letters (B batch, T sequence, D d_model, N heads, K kv-heads, G = N/K, H head_dim, F d_ff,
V vocab, L layers, S max_seq_len); the quoted names are the ``jax.named_scope`` s the estimators' ops carry::

    x[B, T, D]  = Embed[V, D][tokens]                                          "embed"
    per layer (jax.lax.scan over the stacked weights [L, ...]):
      h         = RMSNorm(x)                                                   "attention/norm"
      q[B,T,N,H] = h *_D Wq[D, N, H];  k, v[B,T,K,H] = h *_D Wk, Wv[D, K, H]   "attention/qkv"
      q, k      = RoPE(q, k)                                                   "attention/rope"
      s[B,K,G,T,T] = q *_H k, causal softmax;  o[B,T,N,H] = s *_T v           "attention/scores"
      x        += o *_{N,H} Wo[N, H, D]                                        "attention/out"
      h         = RMSNorm(x)                                                   "mlp/norm"
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
backward pass) and reduces their gradients back to ``W[D_X, ...]``.

What XLA's CPU backend compiles this to (read with :mod:`lab.compile.hlo`, checked against the training
estimator by ``shardlab audit``): the collectives above, except that every reduce-then-shard (the ``tp_sp``
ReduceScatter, the FSDP gradient reduction) stays an ``all-reduce`` followed by a ``dynamic-slice``, gradients of
several weights are reduced in one tuple all-reduce, and bfloat16 collectives run in float32.

Meshes use ``AxisType.Auto`` by default: activations are pinned with ``jax.lax.with_sharding_constraint`` at block
boundaries and the partitioner propagates the rest. On ``AxisType.Explicit`` axes (the Plan's ``sharding_mode``) the
pins are ``reshard`` s and contractions name their ``out_sharding`` (:mod:`kernels.transformer.explicit`). Attention
is a plain einsum softmax: with heads sharded over ``model`` every head's scores are local.

Precision: parameters and AdamW state are float32 (master weights); the compute dtype (``bfloat16`` for mixed
precision) is what matmuls run in, parameters being cast at use; norms, softmax, logits and the loss are
float32. Activation recomputation (``remat``) uses the estimators' words: ``none``; ``selective`` keeps matmul
outputs without batch dims (the projections) and recomputes the rest, the attention softmax included
(Korthikanti et al. 2022); ``full`` keeps only each layer's input.

Pipeline: rules with ``layers`` on a mesh axis (``layers = "pipe"``) cut the stacked layers into that axis's stages
and the loss runs GPipe over ``microbatches`` (``kernels.transformer.loss.pipelined_loss``): a ``shard_map``
manual over the stage axis and the batch's axes, tensor parallelism placed by the rules inside as above. Every
stage computes in all ``M + p - 1`` steps, the ``p - 1`` idle ones on values nothing reads, and passes its output
on with a ``ppermute`` after each but the last; every stage holds the embeddings and the final norm, whose
gradients the stages sum; each weight's gradient is summed over the data-parallel replicas once, after the last
microbatch. The training estimator prices exactly this with ``spmd_pipeline`` (``lab.predict.training.config``).
Under an uneven ``stage_split`` every stage stacks as many layers as the largest and passes its padding through
(``loss.split_order``). With the interleaved schedule (``interleave = v``) each stage holds ``v`` chunks, stored
together (``loss.interleaved_order``), and the loss runs the circular schedule of ``kernels.pipeline_circular``
(``loss.circular_loss``: ``v M + p - 1`` steps, a wrap-around ``ppermute`` after each but the last).

Mixture of experts: a model with ``experts > 1`` replaces every layer's MLP by the expert layer of
``kernels.transformer.moe_layer`` (router, top-k with a capacity, the routed experts over the rules' ``experts``
axes, which also split the batch, tokens exchanged by two ``all_to_all`` s; shared experts beside them).

Context parallelism: rules with ``context`` on mesh axes split the T of every activation over them (and over the
sequence-parallel axes too between blocks); the partitioner gathers K and V whole for attention, forward and again
backward, reduces their gradients, and sums the weight gradients over the context shards (the all-gather form,
not a ring: priced by the estimator's ``spmd_context``). The shifted targets stay whole along T, so each shard
slices its own.
"""
# Over 500 lines on purpose: the decoder's arrays and forward pass; its layers share the placement helpers of one
# _Layout.

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels.mesh import make_mesh
from kernels.transformer.explicit import is_explicit, lookup, scaled, typed_sharded, whole_t
from kernels.transformer.moe_layer import SAVED as MOE_SAVED
from kernels.transformer.moe_layer import moe_mlp
from lab.core import arrays
from lab.core.attention import Attention
from lab.core.errors import UserError
from lab.core.models import ModelConfig
from lab.core.programs import MOE_CAPACITY_FACTOR
from lab.core.rules import DATA, MESH_AXES, MODEL, PRESETS, ShardingRules, get_rules
from lab.core.units import canonical_dtype

REMAT = ("none", "selective", "full")  # the same words as the estimators'
_JNP = {"fp32": jnp.float32, "bf16": jnp.bfloat16}

Params = dict[str, Any]
Cache = dict[str, jax.Array]

# Prime-ish multiples of the tensor-parallel degrees 2 and 4 (and of 8 where FSDP shards over both axes), so a
# transposed or mis-sharded dim fails at once: D = 7*8, F = 13*8, V = 11*8, H = 12 (q width 96 != D).
TINY = ModelConfig(
    name="tiny",
    vocab=88,
    d_model=56,
    layers=2,
    heads=8,
    kv_heads=4,
    head_dim=12,
    d_ff=104,
    max_seq_len=64,
    source="shardlab test model: prime-ish multiples of the parallel degrees",
)


def compute_dtype(dtype: Any) -> Any:
    """A JAX dtype from ``"float32"``, ``"bf16"``, ``jnp.bfloat16``..."""
    if isinstance(dtype, str):
        dt = canonical_dtype(dtype)
        if dt not in _JNP:
            raise UserError(f"compute dtype {dtype!r} is not one of float32, bfloat16")
        return _JNP[dt]
    return jnp.dtype(dtype)


def partition_spec(rules: ShardingRules, logical: tuple[str | None, ...], what: str = "an array") -> P:
    """The ``PartitionSpec`` of an array with these logical dims under ``rules``."""
    return P(*rules.spec(logical, what))


def mesh_shape(axes: Mapping[str, int] | Mesh) -> dict[str, int]:
    """Axis name -> size of a mesh, or of a partial ``{"data": ..., "model": ...}`` (a missing one is 1)."""
    if isinstance(axes, Mesh):
        return dict(axes.shape)
    unknown = [a for a in axes if a not in MESH_AXES]
    if unknown:
        raise UserError(f"mesh axis {unknown[0]!r} is not one of {', '.join(MESH_AXES)}")
    return {a: int(axes.get(a, 1)) for a in MESH_AXES}


def transformer_mesh(axes: Mapping[str, int] | Mesh) -> Mesh:
    """A ``data x model`` mesh from ``{"data": 2, "model": 4}`` (a missing axis has size 1), or the mesh given."""
    if isinstance(axes, Mesh):
        return axes
    return make_mesh(mesh_shape(axes))


# ----- arrays: the core declarations with a dtype and an initializer --------------------------------------------

Init = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


@dataclass(frozen=True)
class ArrayInfo:
    """An array described before it exists: global shape, dtype, one logical name per dim, initializer."""

    shape: tuple[int, ...]
    dtype: Any
    logical_axes: tuple[str | None, ...]
    init: Init | None = None

    def spec(self, rules: ShardingRules, what: str = "an array") -> P:
        return partition_spec(rules, self.logical_axes, what)

    def bytes_per_device(self, rules: ShardingRules, mesh_sizes: Mapping[str, int]) -> float:
        """Bytes one device holds: global bytes over the product of the mesh axes splitting it."""
        shards = math.prod(mesh_sizes[a] for name in self.logical_axes for a in rules.axes(name))
        return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize / shards


def _is_info(x: Any) -> bool:
    return isinstance(x, ArrayInfo)


def _param_init(name: str, s: arrays.ArraySpec) -> Init:
    """Norm scales start at one, the embedding at N(0, 1), every other weight at N(0, 1 / fan_in)."""
    if name.endswith("norm"):
        return jax.nn.initializers.ones
    if name == "embed":
        fan_in = 1
    elif name == "wo":  # [L, N, H, D]: contracts N and H
        fan_in = s.shape[1] * s.shape[2]
    elif name == "unembed":  # [D, V]
        fan_in = s.shape[0]
    elif len(s.shape) == 4 and s.logical_axes[1] == "experts":  # [L, E, D, F] or [L, E, F, D]: contracts dim 2
        fan_in = s.shape[2]
    else:  # [L, D, ...] or w_down [L, F, D]: contracts dim 1
        fan_in = s.shape[1]
    return jax.nn.initializers.normal(fan_in**-0.5)


def param_info(cfg: ModelConfig) -> dict[str, Any]:
    """Every parameter as an :class:`ArrayInfo` (float32); layer weights stacked on a leading ``layers`` dim."""
    specs = arrays.param_specs(cfg)
    return {
        k: (
            {n: ArrayInfo(s.shape, jnp.float32, s.logical_axes, _param_init(n, s)) for n, s in v.items()}
            if isinstance(v, dict)
            else ArrayInfo(v.shape, jnp.float32, v.logical_axes, _param_init(k, v))
        )
        for k, v in specs.items()
    }


def activation_info(
    cfg: ModelConfig, batch: int, seq: int, *, decode: bool = False, dtype: str = "float32"
) -> dict[str, ArrayInfo]:
    """The activations the model pins with ``with_sharding_constraint`` (and the token inputs)."""
    cd = compute_dtype(dtype)
    kinds = {"tokens": jnp.int32, "logits": jnp.float32}
    specs = arrays.activation_specs(cfg, batch, seq, decode=decode)
    return {k: ArrayInfo(s.shape, kinds.get(k, cd), s.logical_axes) for k, s in specs.items()}


def cache_info(cfg: ModelConfig, batch: int, dtype: str = "float32") -> dict[str, ArrayInfo]:
    """The KV cache: ``k`` and ``v`` of ``[layers, batch, max_seq, kv_heads, head_dim]`` in the compute dtype."""
    cd = compute_dtype(dtype)
    return {k: ArrayInfo(s.shape, cd, s.logical_axes) for k, s in arrays.cache_specs(cfg, batch).items()}


def _named(tree: Any) -> list[tuple[str, ArrayInfo]]:
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_info)
    return [(jax.tree_util.keystr(path, simple=True, separator="/"), leaf) for path, leaf in leaves]


def check_layout(infos: Any, rules: ShardingRules, mesh_sizes: Mapping[str, int]) -> None:
    """Refuse a layout before compiling: unknown mesh axes, one axis on two dims, indivisible dims."""
    specs = {n: arrays.ArraySpec(i.shape, i.logical_axes) for n, i in _named(infos)}
    arrays.check_layout(specs, rules, mesh_sizes)


def validate(
    cfg: ModelConfig,
    rules: ShardingRules,
    mesh: Mesh | Mapping[str, int],
    *,
    batch: int | None = None,
    seq: int | None = None,
    decode: bool = False,
) -> None:
    """The model (and, given ``batch``/``seq``, activations; with ``decode`` the KV cache) against the mesh
    (:func:`lab.core.arrays.check_transformer`).

    Raises:
        UserError: before anything is traced or compiled.
    """
    shape = dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh)
    arrays.check_transformer(cfg, rules, shape, batch=batch, seq=seq, decode=decode)


def shardings(infos: Any, rules: ShardingRules, mesh: Mesh) -> Any:
    """The ``NamedSharding`` of every :class:`ArrayInfo` in a pytree (same structure)."""
    flat, treedef = jax.tree.flatten(infos, is_leaf=_is_info)
    names = [n for n, _ in _named(infos)]
    return treedef.unflatten([NamedSharding(mesh, i.spec(rules, n)) for n, i in zip(names, flat, strict=True)])


def abstract(infos: Any, rules: ShardingRules, mesh: Mesh) -> Any:
    """``jax.ShapeDtypeStruct`` s with their shardings: what lowering needs, without allocating anything."""
    sh = shardings(infos, rules, mesh)
    return jax.tree.map(lambda i, s: jax.ShapeDtypeStruct(i.shape, i.dtype, sharding=s), infos, sh, is_leaf=_is_info)


def param_bytes_per_device(cfg: ModelConfig, rules: ShardingRules, mesh_sizes: Mapping[str, int]) -> float:
    """Float32 parameter bytes one device holds under the rules."""
    return sum(i.bytes_per_device(rules, mesh_sizes) for _, i in _named(param_info(cfg)))


_HOST_INIT: dict[tuple, Callable] = {}  # the one-device init of each parameter layout (emulated CPU devices)
HOST_INIT_MAX_BYTES = 2**28  # drawn on one device up to this size: the full copy is held for a moment beside the shards


def init_params(cfg: ModelConfig, rules: ShardingRules, mesh: Mesh, key: jax.Array) -> Params:
    """Every parameter with its ``NamedSharding``, allocated so directly (never a full copy on one device).

    Values depend on ``key`` only, not on the rules or mesh (JAX's random bits are sharding-invariant). On CPU
    devices of one process, which share the host's memory, parameters of up to ``HOST_INIT_MAX_BYTES`` are drawn
    on one device and then placed: one program per model, whatever the layout, where XLA:CPU compiles the sharded
    draw again for every layout (0.6 s a layout of the tests' tiny models, with their compile flags).
    """
    info = param_info(cfg)
    validate(cfg, rules, mesh)
    flat, treedef = jax.tree.flatten(info, is_leaf=_is_info)

    def init(key):
        keys = jax.random.split(key, len(flat))
        return treedef.unflatten([i.init(k, i.shape, i.dtype) for i, k in zip(flat, keys, strict=True)])

    placed = shardings(info, rules, mesh)
    size = sum(math.prod(i.shape) * np.dtype(i.dtype).itemsize for i in flat)
    if size <= HOST_INIT_MAX_BYTES and jax.process_count() == 1 and all(d.platform == "cpu" for d in mesh.devices.flat):
        # the names and shapes choose every initializer (_param_init): the same layout draws the same values
        layout = (treedef, tuple((i.shape, i.dtype) for i in flat))
        draw = _HOST_INIT.get(layout)
        if draw is None:
            if len(_HOST_INIT) >= 16:  # a sweep over model sizes keeps only the latest few
                _HOST_INIT.clear()
            draw = _HOST_INIT[layout] = jax.jit(init)
        return jax.device_put(draw(key), placed)
    return jax.jit(init, out_shardings=placed)(key)


def synthetic_tokens(cfg: ModelConfig, batch: int, seq: int, seed: int = 0) -> np.ndarray:
    """A fixed int32 token batch ``[batch, seq]`` (host numpy), the same for every mesh."""
    return np.random.default_rng(seed).integers(0, cfg.vocab, size=(batch, seq), dtype=np.int32)


def token_sharding(rules: ShardingRules, mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(rules, ("batch", None), "tokens"))


# ----- the model ------------------------------------------------------------------------------------------------


XLA_ATTENTION = Attention()  # the plain einsum softmax (the default)


@dataclass(frozen=True)
class _Layout:
    """Rules plus the mesh they place on; without a mesh nothing is constrained (propagation only). ``manual``:
    inside the pipeline's ``shard_map`` over its stage axis, where shardings name the abstract mesh."""

    rules: ShardingRules
    mesh: Mesh | None
    dtype: Any = jnp.float32  # the compute dtype matmuls run in
    decode: bool = False
    manual: bool = False
    capacity_factor: float = MOE_CAPACITY_FACTOR  # MoE: slots per expert, ceil(k t cf / E) per routing group
    moe_groups: tuple[int, int] = (1, 1)  # without a mesh: routing groups along B and T, as devices would split them
    stage_split: tuple[int, ...] = ()  # pipelined: each stage's real layers; its stacked rows past them are padding
    attention: Attention = XLA_ATTENTION  # the einsum softmax, or a kernel (kernels.transformer.attention)

    def constrain(self, x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:  # the op's source line: here
        if self.mesh is None:
            return x
        pinned = jax.sharding.reshard if is_explicit(self.mesh) else jax.lax.with_sharding_constraint
        return pinned(x, self.sharding(logical))

    def out(self, logical: tuple[str | None, ...]) -> NamedSharding | None:  # explicit: a result's out_sharding
        return self.sharding(logical) if is_explicit(self.mesh) else None

    def sharding(self, logical: tuple[str | None, ...]) -> NamedSharding:
        if self.decode:  # one token: the residual stream is not split along T
            logical = tuple(None if a == "sequence" else a for a in logical)
        mesh = jax.sharding.get_abstract_mesh() if self.manual else self.mesh
        spec = partition_spec(self.rules, logical)
        ctx = self.rules.axes("context")
        if ctx and not self.decode and len(logical) >= 3:  # an activation [B, T, ...]: T over the context axes too
            seq = self.rules.axes("sequence") if logical[1] == "sequence" else ()
            t = (*ctx, *seq)
            spec = P(spec[0], t if len(t) > 1 else t[0], *spec[2:])
        return NamedSharding(mesh, spec)


RESIDUAL = ("batch", "sequence", "act_embed")
HEADS = ("batch", None, "heads", "head_dim")
KV_HEADS = ("batch", None, "kv_heads", "head_dim")


def _rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    with jax.named_scope("norm"):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        s = scale.astype(jnp.float32)
        return (scaled(y, s) if typed_sharded(s) else y * s).astype(x.dtype)  # explicit mode: FSDP's gather


def _rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate pairs ``(x_i, x_{i+H/2})`` by ``position * theta^(-2i/H)``; x ``[B, T, n, H]``, positions ``[T]``."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / x.shape[-1])  # [H/2]
    angle = positions.astype(jnp.float32)[:, None] * freq  # [T, H/2]
    sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]  # [1, T, 1, H/2]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _qkv(h: jax.Array, p: Params, positions: jax.Array, cfg: ModelConfig, lay: _Layout):
    """q, k, v of ``h`` ``[B, T, D]``, q and k rotated at ``positions``: ``[T]`` for every row, or ``[B, T]`` one
    per row and token (the serving engine's rows hold slots of different sequences)."""
    cd = lay.dtype
    with jax.named_scope("qkv"):
        heads, kv = lay.out(HEADS), lay.out(KV_HEADS)  # explicit mode: tp_sp's h is split along T
        q = lay.constrain(jnp.einsum("btd,dnh->btnh", h, p["wq"].astype(cd), out_sharding=heads), HEADS)  # [B,T,N,H]
        k = lay.constrain(jnp.einsum("btd,dkh->btkh", h, p["wk"].astype(cd), out_sharding=kv), KV_HEADS)  # [B,T,K,H]
        v = lay.constrain(jnp.einsum("btd,dkh->btkh", h, p["wv"].astype(cd), out_sharding=kv), KV_HEADS)  # [B,T,K,H]
    with jax.named_scope("rope"):
        if positions.ndim == 2:  # _rope takes one [T] for the whole batch: mapped over the rows
            rope = jax.vmap(lambda x, pos: _rope(x[None], pos, cfg.rope_theta)[0])
            q, k = rope(q, positions), rope(k, positions)
        else:
            q, k = _rope(q, positions, cfg.rope_theta), _rope(k, positions, cfg.rope_theta)
    return q, k, v


@jax.custom_vjp
def _softmax_rows(s: jax.Array, like: jax.Array) -> jax.Array:
    return jax.nn.softmax(s, axis=-1).astype(like.dtype)


def _softmax_rows_fwd(s, like):
    w = _softmax_rows(s, like)
    return w, (w, like)


def _softmax_rows_bwd(res, g):
    w, like = res
    wf, gf = w.astype(jnp.float32), g.astype(jnp.float32)
    return wf * (gf - jnp.sum(gf * wf, axis=-1, keepdims=True)), jnp.zeros_like(like)


_softmax_rows.defvjp(_softmax_rows_fwd, _softmax_rows_bwd)


def _softmax_to(s: jax.Array, dtype) -> jax.Array:
    """Softmax over the last axis in float32, returned in ``dtype``; its backward pass reads only that output, so
    the scores keep one ``dtype`` copy for the backward pass (as Megatron's fused softmax saves its 16-bit output),
    not float32 scores and probabilities beside the cast."""
    if jnp.dtype(dtype) == jnp.float32:
        return jax.nn.softmax(s, axis=-1)
    return _softmax_rows(s, jnp.zeros((), dtype))


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Grouped-query softmax attention: q ``[B, T, N, H]``, k, v ``[B, S, K, H]``, mask ``[T, S]`` -> ``[B, T, N, H]``.

    Query head ``n`` reads KV head ``n // G``; scores and softmax are float32.
    """
    B, T, N, H = q.shape
    with jax.named_scope("scores"):
        qg = q.reshape(B, T, cfg.kv_heads, cfg.heads // cfg.kv_heads, H)  # [B, T, K, G, H]: head n = k * G + g
        s = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * H**-0.5
        s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
        w = _softmax_to(s, q.dtype)  # [B, K, G, T, S]
        o = jnp.einsum("bkgts,bskh->btkgh", w, v)
    return o.reshape(B, T, N, H)


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, cfg: ModelConfig, lay: _Layout):
    """Causal attention by the layout's implementation: :func:`_attend`, or a kernel inside ``shard_map``."""
    if not lay.attention.fused:
        return _attend(q, *whole_t((k, v), lay.mesh), mask, cfg)  # explicit mode: K, V whole along T
    from kernels.transformer.attention import attend

    with jax.named_scope("scores"):
        return attend(q, k, v, lay.attention, lay.rules, lay.mesh)


def _mlp(h: jax.Array, p: Params, cfg: ModelConfig, lay: _Layout) -> jax.Array:
    cd = lay.dtype
    with jax.named_scope("up"):
        hidden = lay.out(("batch", None, "ffw"))
        gate = jnp.einsum("btd,df->btf", h, p["w_gate"].astype(cd), out_sharding=hidden)
        up = jnp.einsum("btd,df->btf", h, p["w_up"].astype(cd), out_sharding=hidden)
        u = lay.constrain(jax.nn.silu(gate) * up, ("batch", None, "ffw"))  # [B, T, F]
    with jax.named_scope("down"):  # [B, T, D]{U over ffw}; explicit mode: typed as the residual stream
        return jnp.einsum("btf,fd->btd", u, p["w_down"].astype(cd), out_sharding=lay.out(RESIDUAL))


def _block(x: jax.Array, p: Params, positions: jax.Array, cfg: ModelConfig, lay: _Layout):
    """One pre-norm residual block over the whole sequence (causal). Returns the new x and this layer's k, v."""
    x, kv = _attention_half(x, p, positions, cfg, lay)
    with jax.named_scope("mlp"):
        h = _rms_norm(x, p["mlp_norm"], cfg.norm_eps)
        mlp = moe_mlp if "router" in p else _mlp  # an expert layer, or a dense one (leading, or a dense model)
        x = x + lay.constrain(mlp(h, p, cfg, lay), RESIDUAL)
    return x, kv


def _attention_half(x: jax.Array, p: Params, positions: jax.Array, cfg: ModelConfig, lay: _Layout):
    """The block's attention and its residual add: the new x and this layer's k, v."""
    x = lay.constrain(x, RESIDUAL)
    T = x.shape[1]
    with jax.named_scope("attention"):
        h = _rms_norm(x, p["attn_norm"], cfg.norm_eps)
        q, k, v = _qkv(h, p, positions, cfg, lay)
        causal = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]  # [T, S]
        o = lay.constrain(_attention(q, k, v, causal, cfg, lay), HEADS)
        with jax.named_scope("out"):
            o = jnp.einsum("btnh,nhd->btd", o, p["wo"].astype(lay.dtype), out_sharding=lay.out(RESIDUAL))
            x = x + lay.constrain(o, RESIDUAL)
    return x, (k, v)


def _remat_policy(remat: str):
    if remat not in REMAT:
        raise UserError(f"unknown remat {remat!r}; valid: {', '.join(REMAT)}")
    return {
        "none": None,
        # Projections (matmuls against weights, no batch dims) are kept; scores, softmax, AV, norms and the MLP
        # activation are recomputed in the backward pass.
        # An expert layer's slots and products are kept too (moe_layer.SAVED): only attention is recomputed.
        "selective": jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            jax.checkpoint_policies.save_only_these_names(*MOE_SAVED),
        ),
        "full": jax.checkpoint_policies.nothing_saveable,  # only the layer input (the scan carry) is kept
    }[remat]


def _embed(params: Params, tokens: jax.Array, cfg: ModelConfig, lay: _Layout) -> jax.Array:
    with jax.named_scope("embed"):
        table = lay.constrain(params["embed"], ("vocab", None))  # FSDP: gather D; keep V split (Megatron)
        typed = lay.out(("batch", None, "act_embed"))  # explicit mode: the lookup's result typed
        x = (jnp.take(table, tokens, axis=0) if typed is None else lookup(table, tokens, typed)).astype(lay.dtype)
        x = lay.constrain(x, ("batch", None, "act_embed"))  # masked local lookups summed over the vocab axes
        return lay.constrain(x, RESIDUAL)


def _logits(params: Params, x: jax.Array, cfg: ModelConfig, lay: _Layout) -> jax.Array:
    x = _rms_norm(x, params["final_norm"], cfg.norm_eps)
    with jax.named_scope("logits"):
        out = ("batch", None, "vocab")  # explicit mode: tp_sp's x is split along T
        w = params["unembed"].astype(lay.dtype)
        logits = jnp.einsum("btd,dv->btv", x, w, preferred_element_type=jnp.float32, out_sharding=lay.out(out))
        return lay.constrain(logits, out)  # [B, T, V] float32


def _layer_body(positions, cfg, lay, remat, keep_kv=False, single=False):
    """The scan body over stacked layers: one block, under the remat policy (``single``: a stack of one layer, whose
    scan XLA removes, so the recomputation must be kept from merging with the forward pass here)."""

    def body(x, p):
        x, kv = _block(x, p, positions, cfg, lay)
        return x, (kv if keep_kv else None)

    if remat != "none":
        # prevent_cse=False: scan already keeps the recomputation from being merged with the forward pass.
        body = jax.checkpoint(body, policy=_remat_policy(remat), prevent_cse=single)
    return body


def _forward(params, tokens, cfg, lay, remat="none", *, keep_kv=False, last_only=False):
    T = tokens.shape[1]
    positions = jnp.arange(T)
    x = _embed(params, tokens, cfg, lay)
    if "dense_layers" in params:  # a mixture of experts' leading dense layers, then its expert layers
        n = jax.tree.leaves(params["dense_layers"])[0].shape[0]
        x, _ = jax.lax.scan(_layer_body(positions, cfg, lay, remat, single=n == 1), x, params["dense_layers"])
    n = jax.tree.leaves(params["layers"])[0].shape[0]
    x, kv = jax.lax.scan(_layer_body(positions, cfg, lay, remat, keep_kv, single=n == 1), x, params["layers"])
    x = lay.constrain(x, RESIDUAL)
    if last_only:  # a prompt's prefill samples from its last position only: the other logits are never made
        x = x[:, -1:]
    return _logits(params, x, cfg, lay), kv


def forward(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    rules: ShardingRules | None = None,
    mesh: Mesh | None = None,
    remat: str = "none",
    dtype: str = "float32",
    attention: Attention | None = None,
) -> jax.Array:
    """Logits ``[B, T, V]`` (float32) of int tokens ``[B, T]``; activations pinned when ``mesh`` is given.

    ``dtype`` is what the matmuls run in (``bfloat16`` for mixed precision); parameters stay float32.
    ``attention``: the einsum softmax (default) or a kernel (:mod:`lab.core.attention`).
    """
    lay = _Layout(rules or PRESETS["single"], mesh, compute_dtype(dtype), attention=attention or Attention())
    return _forward(params, tokens, cfg, lay, remat)[0]


__all__ = [
    "DATA",
    "MODEL",
    "REMAT",
    "TINY",
    "ArrayInfo",
    "ShardingRules",
    "abstract",
    "activation_info",
    "cache_info",
    "check_layout",
    "compute_dtype",
    "forward",
    "get_rules",
    "init_params",
    "mesh_shape",
    "param_bytes_per_device",
    "param_info",
    "partition_spec",
    "shardings",
    "synthetic_tokens",
    "token_sharding",
    "transformer_mesh",
    "validate",
]
