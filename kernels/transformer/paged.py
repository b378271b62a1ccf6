"""A paged KV cache for the Transformer and the one step that serves it: chunked prefills and decodes of many
sequences in one flat batch of token slots (what :mod:`lab.run.serve` executes for the scheduler of
:mod:`lab.core.serving`).

The pool is ``pages`` pages of ``page_size`` tokens per data-parallel replica; a sequence's page table lists its
pages in order, so its token at position ``pos`` lives at ``(page_table[row, pos // page_size], pos % page_size)``.
In the book's letters (R replicas, P pages, Z page_size, M max_pages_per_seq, Q max_seqs, T token slots per step,
S = M Z a sequence's visible positions; the rest as in :mod:`kernels.transformer.model`)::

    pool k, v       [L, R_X, P, Z, K_Y, H]     (compute dtype; X = the rules' batch axes, Y = their kv_heads axes)
    page_table      [R_X, Q, M]  int32          a sequence's slot row -> its pages (unused entries: any page)
    tokens, positions, rows, valid  [R_X, T]    one token slot each: id, position, page-table row, real or padding

    x[R, T, D]      = Embed[tokens]                                          (a replica's T slots are its "batch row")
    per layer:
      q, k, v       = RMSNorm(x) *_D Wq, Wk, Wv;  RoPE at each slot's own position
      pool[page, off] <- k, v                    every valid slot, before anyone reads (a chunk sees itself)
      kv[R, T, S, K, H] = pool[page_table[row]]  each slot gathers its sequence's pages
      o             = softmax(q *_H kv, positions <= pos) *_S kv             (``_attend``, one slot at a time)
      x            += o *_{N,H} Wo;  x += MLP(RMSNorm(x))                   (Megatron: AllReduce_Y after each)
    next[R, T]      = argmax_V logits                                        (greedy)

Tokens of one prompt chunk and the decode tokens of other sequences share a step: a slot sees exactly the
positions ``<= pos`` of its own sequence, those written in earlier steps and those of its chunk written just
now. Padding slots write nothing (their page index is out of range and the scatter drops it) and their output is
ignored. Pages hold stale keys of freed sequences past a sequence's end: the position mask hides them.

Shapes are fixed by the model and the :class:`lab.core.serving.PoolConfig` (T is its ``token_budget``), so a run
compiles :func:`make_paged_step` once. Layers on a mesh axis (a pipeline) and mixture-of-experts models are
refused: the step is plain data plus tensor parallelism, as the rules' ``tp`` preset places the weights.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from kernels.mesh import make_mesh
from kernels.program import Built
from kernels.transformer.decode import _cached_mlp, _cached_out
from kernels.transformer.model import (
    HEADS,
    RESIDUAL,
    ArrayInfo,
    Cache,
    Params,
    _attend,
    _embed,
    _Layout,
    _logits,
    _qkv,
    _rms_norm,
    abstract,
    check_layout,
    compute_dtype,
    init_params,
    param_info,
    shardings,
    validate,
)
from lab.core.errors import UserError
from lab.core.models import ModelConfig
from lab.core.plan import Plan
from lab.core.rules import ShardingRules
from lab.core.serving import PoolConfig

SLOTS = ("tokens", "positions", "rows", "valid")  # the per-slot inputs, each [R, T]


def replicas(rules: ShardingRules, mesh: Mesh) -> int:
    """Data-parallel replicas R: the product of the rules' batch axes (each holds its own pool and scheduler)."""
    return rules.size("batch", dict(mesh.shape))


def pages_per_seq(cfg: ModelConfig, pool: PoolConfig) -> int:
    """M, a page table row's length: pages for the model's ``max_seq_len`` positions (at most the pool's)."""
    return min(pool.pages, -(-cfg.max_seq_len // pool.page_size))


def pool_info(cfg: ModelConfig, pool: PoolConfig, n_replicas: int, dtype: str = "float32") -> dict[str, ArrayInfo]:
    """The pool: ``k`` and ``v`` of ``[L, R, P, Z, K, H]`` in the compute dtype, R over the batch axes."""
    shape = (cfg.layers, n_replicas, pool.pages, pool.page_size, cfg.kv_heads, cfg.head_dim)
    axes = ("layers", "batch", None, None, "kv_heads", "head_dim")
    cd = compute_dtype(dtype)
    return {"k": ArrayInfo(shape, cd, axes), "v": ArrayInfo(shape, cd, axes)}


def slot_info(cfg: ModelConfig, pool: PoolConfig, n_replicas: int) -> dict[str, ArrayInfo]:
    """One step's inputs: the ``[R, T]`` slots (T = ``token_budget``) and the page table ``[R, Q, M]``."""
    rt = (n_replicas, pool.token_budget)
    out = {name: ArrayInfo(rt, jnp.int32, ("batch", None)) for name in SLOTS}
    out["valid"] = ArrayInfo(rt, jnp.bool_, ("batch", None))
    table = (n_replicas, pool.max_seqs, pages_per_seq(cfg, pool))
    out["page_table"] = ArrayInfo(table, jnp.int32, ("batch", None, None))
    return out


def check(cfg: ModelConfig, rules: ShardingRules, mesh: Mesh, pool: PoolConfig) -> None:
    """Refuse what the paged step does not run, before anything is traced.

    Raises:
        UserError: a mixture of experts, layers on a mesh axis, or a layout the mesh cannot split.
    """
    pool.check()
    if cfg.experts > 1:
        raise UserError(f"the paged serving step runs dense models; {cfg.name} has {cfg.experts} experts")
    if rules.axes("layers"):
        raise UserError("the paged serving step does not pipeline: leave the rules' layers unsharded")
    validate(cfg, rules, mesh)
    r = replicas(rules, mesh)
    check_layout({**pool_info(cfg, pool, r), **slot_info(cfg, pool, r)}, rules, dict(mesh.shape))


def init_pool(cfg: ModelConfig, pool: PoolConfig, rules: ShardingRules, mesh: Mesh, dtype: str = "float32") -> Cache:
    """A zero pool, allocated in place on the mesh (never a full copy on one device)."""
    info = pool_info(cfg, pool, replicas(rules, mesh), dtype)
    sh = shardings(info, rules, mesh)
    zeros = {n: functools.partial(jnp.zeros, i.shape, i.dtype) for n, i in info.items()}
    return jax.jit(lambda: {n: z() for n, z in zeros.items()}, out_shardings=sh)()


# ----- the step -------------------------------------------------------------------------------------------------


def _write(pool_l: jax.Array, page: jax.Array, off: jax.Array, new: jax.Array) -> jax.Array:
    """``pool_l[r, page[r, t], off[r, t]] = new[r, t]``: pool_l ``[R, P, Z, K, H]``, new ``[R, T, K, H]``; a page
    index out of range (padding) is dropped."""
    return jax.vmap(lambda p, pg, of, n: p.at[pg, of].set(n.astype(p.dtype), mode="drop"))(pool_l, page, off, new)


def _gather(pool_l: jax.Array, seq_pages: jax.Array) -> jax.Array:
    """Each slot's sequence, position-ordered: pool_l ``[R, P, Z, K, H]``, seq_pages ``[R, T, M]`` -> ``[R, T, M Z,
    K, H]``."""
    g = jax.vmap(lambda p, idx: p[idx])(pool_l, seq_pages)  # [R, T, M, Z, K, H]
    R, T, M, Z, K, H = g.shape
    return g.reshape(R, T, M * Z, K, H)


def _attend_slots(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, cfg: ModelConfig) -> jax.Array:
    """``model._attend`` for every slot alone: q ``[R, T, N, H]``, k, v ``[R, T, S, K, H]``, visible ``[R, T, S]``
    -> ``[R, T, N, H]``."""

    def one(q1, k1, v1, m1):  # [N, H], [S, K, H], [S, K, H], [S]: a batch of one, a sequence of one
        return _attend(q1[None, None], k1[None], v1[None], m1[None], cfg)[0, 0]

    return jax.vmap(jax.vmap(one))(q, k, v, visible)


def paged_step(params: Params, kv: Cache, batch: dict[str, jax.Array], cfg: ModelConfig, lay: _Layout):
    """One serving step (module docstring): ``batch`` holds :func:`slot_info`'s arrays. Returns the greedy next
    token of every slot ``[R, T]`` (int32; padding slots' are meaningless) and the updated pool."""
    tokens, positions, rows, valid = (batch[n] for n in SLOTS)
    Z, P = kv["k"].shape[3], kv["k"].shape[2]
    seq_pages = jax.vmap(lambda table, r: table[r])(batch["page_table"], rows)  # [R, T, M]
    page = jnp.take_along_axis(seq_pages, (positions // Z)[..., None], axis=-1)[..., 0]  # [R, T]
    page = jnp.where(valid, page, P)  # out of range: the scatter drops padding
    off = positions % Z
    visible = jnp.arange(seq_pages.shape[-1] * Z) <= positions[..., None]  # [R, T, S]
    x = _embed(params, tokens, cfg, lay)  # [R, T, D]

    def body(x, layer):
        p, pk, pv = layer  # pk, pv: [R, P, Z, K, H]
        x = lay.constrain(x, RESIDUAL)
        with jax.named_scope("attention"):
            h = _rms_norm(x, p["attn_norm"], cfg.norm_eps)
            q, k, v = _qkv(h, p, positions, cfg, lay)
            with jax.named_scope("cache"):
                pk, pv = _write(pk, page, off, k), _write(pv, page, off, v)
                ks, vs = _gather(pk, seq_pages), _gather(pv, seq_pages)
            o = lay.constrain(_attend_slots(q, ks.astype(q.dtype), vs.astype(q.dtype), visible, cfg), HEADS)
            x = _cached_out(x, o, p, lay)
        return _cached_mlp(x, p, cfg, lay), (pk, pv)

    x, (k, v) = jax.lax.scan(body, x, (params["layers"], kv["k"], kv["v"]))
    axes = ("layers", "batch", None, None, "kv_heads", "head_dim")
    with jax.named_scope("sample"):
        nxt = jnp.argmax(_logits(params, x, cfg, lay), axis=-1).astype(jnp.int32)  # [R, T]
    return nxt, {"k": lay.constrain(k, axes), "v": lay.constrain(v, axes)}


def _step_shardings(cfg: ModelConfig, rules: ShardingRules, mesh: Mesh, pool: PoolConfig, dtype: str):
    """``(in_shardings, out_shardings)`` of the step: weights, pool and slots in; next tokens and pool out."""
    r = replicas(rules, mesh)
    p_sh = shardings(param_info(cfg), rules, mesh)
    kv_sh = shardings(pool_info(cfg, pool, r, dtype), rules, mesh)
    b_sh = shardings(slot_info(cfg, pool, r), rules, mesh)
    return (p_sh, kv_sh, b_sh), (b_sh["tokens"], kv_sh)


def make_paged_step(
    cfg: ModelConfig, rules: ShardingRules, mesh: Mesh, pool: PoolConfig, dtype: str = "float32", donate: bool = True
) -> Callable:
    """Jitted ``(params, kv, batch) -> (next [R, T], kv)`` with pinned shardings; the pool ``kv`` is donated (the
    engine's steps), or not (``donate=False``: a profiled step called again on the same arguments).

    One program for the whole run: every shape is fixed by ``cfg`` and ``pool`` (T = ``pool.token_budget``).
    """
    check(cfg, rules, mesh, pool)
    lay = _Layout(rules, mesh, compute_dtype(dtype), decode=True)  # the slots are no one sequence: T stays whole
    ins, outs = _step_shardings(cfg, rules, mesh, pool, dtype)
    fn = functools.partial(paged_step, cfg=cfg, lay=lay)
    return jax.jit(fn, in_shardings=ins, out_shardings=outs, donate_argnums=1 if donate else ())


def make_dispatch_probe(
    cfg: ModelConfig, rules: ShardingRules, mesh: Mesh, pool: PoolConfig, dtype: str = "float32"
) -> Callable:
    """A program with the step's arguments, shardings and donation that computes nothing (the slots' tokens back,
    the pool as it was): its time is what launching the step costs the host, whatever the model."""
    ins, outs = _step_shardings(cfg, rules, mesh, pool, dtype)
    return jax.jit(
        lambda params, kv, batch: (batch["tokens"] + 0, kv), in_shardings=ins, out_shardings=outs, donate_argnums=1
    )


def pool_of(plan: Plan) -> PoolConfig:
    """The pool a ``serve`` Plan's sizes describe."""
    z = plan.sizes
    return PoolConfig(z["pages"], z["page_size"], z["max_seqs"], z["token_budget"])


def full_batch(cfg: ModelConfig, pool: PoolConfig, n_replicas: int) -> dict[str, np.ndarray]:
    """A step with every slot real: slot t of a replica is a token of sequence row ``t % max_seqs`` at position
    ``t // max_seqs``, each row's page table a run of pages. What a profiled step computes is the same for any
    batch (the shapes are fixed); this one writes and reads pages as a loaded step does."""
    T, Q, M, P = pool.token_budget, pool.max_seqs, pages_per_seq(cfg, pool), pool.pages
    t = np.arange(T)
    row = np.broadcast_to(t % Q, (n_replicas, T)).astype(np.int32)
    pos = np.broadcast_to(np.minimum(t // Q, cfg.max_seq_len - 1), (n_replicas, T)).astype(np.int32)
    table = (np.arange(Q)[:, None] * M + np.arange(M)[None, :]) % P
    return {
        "tokens": np.broadcast_to(t % cfg.vocab, (n_replicas, T)).astype(np.int32),
        "positions": pos,
        "rows": row,
        "valid": np.ones((n_replicas, T), np.bool_),
        "page_table": np.broadcast_to(table, (n_replicas, Q, M)).astype(np.int32),
    }


def build_serve(plan: Plan, mesh: Mesh | None = None, *, seed: int = 0) -> Built:
    """One serving step of a validated ``serve`` Plan on a full batch of slots (:func:`full_batch`), not donating
    its pool: what the run profiles and audits. The load itself runs through :mod:`lab.run.serve`."""
    plan.validate()
    cfg, rules = plan.model, plan.rules
    assert cfg is not None and rules is not None
    pool = pool_of(plan)
    m = mesh if mesh is not None else make_mesh(plan.shape, slow=plan.slow_axes)
    fn = make_paged_step(cfg, rules, m, pool, plan.dtype, donate=False)
    r = replicas(rules, m)
    kv_info, slots = pool_info(cfg, pool, r, plan.dtype), slot_info(cfg, pool, r)
    spec = (abstract(param_info(cfg), rules, m), abstract(kv_info, rules, m), abstract(slots, rules, m))

    def make_args():
        params = init_params(cfg, rules, m, jax.random.key(seed))
        batch = jax.device_put(full_batch(cfg, pool, r), shardings(slots, rules, m))
        return params, init_pool(cfg, pool, rules, m, plan.dtype), batch

    return Built(fn, spec, make_args)


def pool_bytes_per_device(cfg: ModelConfig, pool: PoolConfig, rules: ShardingRules, mesh: Mesh, dtype: str) -> float:
    """Bytes of K and V one device holds."""
    sizes = dict(mesh.shape)
    return sum(i.bytes_per_device(rules, sizes) for i in pool_info(cfg, pool, replicas(rules, mesh), dtype).values())


__all__ = [
    "SLOTS",
    "build_serve",
    "check",
    "full_batch",
    "init_pool",
    "make_dispatch_probe",
    "make_paged_step",
    "paged_step",
    "pages_per_seq",
    "pool_bytes_per_device",
    "pool_info",
    "pool_of",
    "replicas",
    "slot_info",
]
