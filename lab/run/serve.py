"""The executed serving engine: the scheduler of :mod:`lab.core.serving` driving the paged Transformer step of
:mod:`kernels.transformer.paged` on real devices, greedy, with real token ids.

:class:`Engine` owns the weights, the pool of K and V pages (one per data-parallel replica, kv_heads split over
the tensor-parallel axes) and the one compiled step; its :meth:`Engine.run` is :func:`lab.core.serving.drive`'s
step runner: it packs each replica's :class:`lab.core.serving.Step` into the fixed ``[R, T]`` slots, runs the step
and reads back the token of every chunk that samples. Every shape is fixed by the model and the
:class:`lab.core.serving.PoolConfig` (T = ``token_budget``), so a run compiles one program, in the constructor,
before any step is timed. :func:`reference_greedy` is the plain path the engine must agree with, token for token:
one sequence through :func:`kernels.transformer.decode.prefill` and ``decode_step``, no pages.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from kernels.transformer import paged
from kernels.transformer.decode import decode_step, prefill
from kernels.transformer.model import Params, init_params, transformer_mesh
from lab.core.errors import UserError
from lab.core.models import ModelConfig
from lab.core.rules import PRESETS, ShardingRules
from lab.core.serving import PoolConfig, Request, Served, Step, drive


class Engine:
    """Weights, pool and the compiled paged step for one model on one mesh (module docstring).

    Args:
        cfg: a dense model.
        mesh: a ``data x model`` mesh, or None for one device.
        rules: where the weights and the pool go; ``tp`` (Megatron inside a replica, the batch over ``data``)
            when None. The rules' batch axes make the replicas.
        pool: pages, page size, sequence slots and the token budget (the step's T) of each replica.
        dtype: compute and pool dtype (parameters stay float32).
        seed: the weights' key (the same values on every mesh).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        mesh: Mesh | None,
        rules: ShardingRules | None,
        pool: PoolConfig,
        dtype: str = "float32",
        seed: int = 0,
    ):
        self.cfg, self.pool, self.dtype = cfg, pool, dtype
        self.mesh = mesh if mesh is not None else transformer_mesh({})
        self.rules = rules if rules is not None else PRESETS["tp"]
        self.step = paged.make_paged_step(cfg, self.rules, self.mesh, pool, dtype)  # checks the layout first
        self.replicas = paged.replicas(self.rules, self.mesh)
        self.pages_per_seq = paged.pages_per_seq(cfg, pool)
        self.params: Params = init_params(cfg, self.rules, self.mesh, jax.random.key(seed))
        self.kv = paged.init_pool(cfg, pool, self.rules, self.mesh, dtype)
        self.warmup()

    def warmup(self) -> None:
        """Compile (and run once) the step on padding only, which writes nothing: no measured step compiles."""
        batch = self.pack([Step(()) for _ in range(self.replicas)])[0]
        nxt, self.kv = self.step(self.params, self.kv, batch)
        jax.block_until_ready(nxt)

    def pack(self, plan: Sequence[Step]) -> tuple[dict[str, np.ndarray], list[tuple[int, int, int]]]:
        """The step's host arrays (:func:`kernels.transformer.paged.slot_info`) from one Step per replica, and
        ``(request id, replica, slot)`` of every chunk that samples (its last token's slot)."""
        R, T, M = self.replicas, self.pool.token_budget, self.pages_per_seq
        if len(plan) != R:
            raise ValueError(f"a plan of {len(plan)} steps for {R} replicas")
        a = {n: np.zeros((R, T), np.int32) for n in paged.SLOTS}
        a["valid"] = np.zeros((R, T), np.bool_)
        a["page_table"] = np.zeros((R, self.pool.max_seqs, M), np.int32)
        picks = []
        for r, step in enumerate(plan):
            t = 0
            for seq, start, count, samples in step.work:
                end = start + count
                if t + count > T or len(seq.pages) > M or end > self.cfg.max_seq_len:
                    raise UserError(
                        f"request {seq.req.rid}: tokens {start}..{end} do not fit the step ({T} slots, {t} taken), "
                        f"its page table ({M} pages) or the model's max_seq_len {self.cfg.max_seq_len}"
                    )
                a["tokens"][r, t : t + count] = seq.tokens[start:end]
                a["positions"][r, t : t + count] = np.arange(start, end)
                a["rows"][r, t : t + count] = seq.slot
                a["valid"][r, t : t + count] = True
                a["page_table"][r, seq.slot, : len(seq.pages)] = seq.pages
                if samples:
                    picks.append((seq.req.rid, r, t + count - 1))
                t += count
        return a, picks

    def run(self, plan: Sequence[Step]) -> tuple[float, dict[int, int]]:
        """Execute one step per replica: wall seconds (packing, the step until ready, reading back) and the new
        token of every request whose chunk samples. :func:`lab.core.serving.drive`'s ``run``."""
        t0 = time.perf_counter()
        batch, picks = self.pack(plan)
        nxt, self.kv = self.step(self.params, self.kv, batch)
        host = np.asarray(jax.device_get(nxt))  # waits for the step
        sampled = {rid: int(host[r, t]) for rid, r, t in picks}
        return time.perf_counter() - t0, sampled


def check_prompts(engine: Engine, requests: Sequence[Request], prompts: dict[int, list[int]]) -> None:
    """Every request has its prompt ids, in the vocabulary, and fits the model's positions.

    Raises:
        UserError: naming the request.
    """
    cfg = engine.cfg
    for req in requests:
        ids = prompts.get(req.rid)
        if ids is None or len(ids) != req.prompt_len:
            got = "none" if ids is None else f"{len(ids)} ids"
            raise UserError(f"request {req.rid}: prompt_len {req.prompt_len} but {got} in prompts")
        if any(not 0 <= int(i) < cfg.vocab for i in ids):
            raise UserError(f"request {req.rid}: prompt ids must lie in [0, {cfg.vocab})")
        if req.prompt_len + req.output_len - 1 > cfg.max_seq_len:
            raise UserError(
                f"request {req.rid}: {req.prompt_len} + {req.output_len} tokens pass the model's max_seq_len "
                f"{cfg.max_seq_len} (the last generated token is never fed back)"
            )


def serve(
    engine: Engine, requests: Sequence[Request], prompts: dict[int, list[int]], concurrency: int | None = None
) -> Served:
    """Serve ``requests`` with their prompt ids on the engine (:func:`lab.core.serving.drive`, its replicas stepped
    together); each sequence's ``tokens`` end with what it generated."""
    check_prompts(engine, requests, prompts)
    return drive(requests, engine.pool, engine.run, engine.replicas, concurrency, prompts)


@functools.cache
def _reference_fns(cfg: ModelConfig, dtype: str):
    """One device, no rules: a jitted prefill (compiled per prompt length) and decode step (compiled once)."""
    pre = jax.jit(functools.partial(prefill, cfg=cfg, dtype=dtype))
    dec = jax.jit(functools.partial(decode_step, cfg=cfg, dtype=dtype))
    return pre, dec


def reference_greedy(engine: Engine, prompt_ids: Sequence[int], n: int) -> list[int]:
    """The ``n`` greedy tokens after ``prompt_ids``, one sequence with a plain ``[L, 1, S, K, H]`` cache
    (:mod:`kernels.transformer.decode`), the engine's weights copied to one device."""
    T = len(prompt_ids)
    if T + n - 1 > engine.cfg.max_seq_len:
        raise UserError(f"prompt {T} + {n} tokens pass max_seq_len {engine.cfg.max_seq_len}")
    pre, dec = _reference_fns(engine.cfg, engine.dtype)
    params = jax.device_put(jax.device_get(engine.params), jax.devices()[0])
    logits, cache = pre(params, np.asarray([prompt_ids], np.int32))
    out = [int(np.argmax(logits[0, -1]))]
    for pos in range(T, T + n - 1):
        logits, cache = dec(params, cache, np.asarray([out[-1]], np.int32), np.int32(pos))
        out.append(int(np.argmax(logits[0])))
    return out


__all__ = ["Engine", "check_prompts", "reference_greedy", "serve"]
