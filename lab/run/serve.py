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
from typing import Any

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

    def warmup(self, calls: int = 1) -> None:
        """Compile and run the step ``calls`` times on padding only, which writes nothing: no measured step
        compiles, and with more calls none runs at a fresh program's slower first calls (XLA:CPU's first several
        calls of a program run slower: lab.run.experiment WARMUP)."""
        batch = self.pack([Step(()) for _ in range(self.replicas)])[0]
        for _ in range(calls):
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


# ----- a serve experiment's load: executed beside its simulation --------------------------------------------------


def _prompts(requests: Sequence[Request], vocab: int, seed: int) -> dict[int, list[int]]:
    rng = np.random.default_rng(seed)
    return {r.rid: rng.integers(0, vocab, r.prompt_len).tolist() for r in requests}


def host_step_s(engine: Engine, repeats: int = 20) -> float:
    """The engine's host work per step, measured apart from the model: packing a full step's slots, dispatching a
    program that takes the step's own arguments (weights, donated pool, slots) and computes nothing with them, and
    reading its result back (median of ``repeats``). What the serving simulator adds to each step's device time as
    the stack's overhead."""
    noop = paged.make_dispatch_probe(engine.cfg, engine.rules, engine.mesh, engine.pool, engine.dtype)
    full = [_full_step(engine) for _ in range(engine.replicas)]
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        batch, _ = engine.pack(full)
        nxt, engine.kv = noop(engine.params, engine.kv, batch)
        np.asarray(jax.device_get(nxt))
        if i:  # the first call compiles
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _full_step(engine: Engine) -> Step:
    """A step whose every slot is a decode of its own sequence (what packing a loaded step costs)."""
    from lab.core.serving import Seq, Work

    size, work = engine.pool.page_size, []
    for t in range(min(engine.pool.token_budget, engine.pool.max_seqs)):
        seq = Seq(Request(t, 0.0, size, 2), tokens=[0] * size, known=size, computed=size - 1, pages=[0], slot=t)
        work.append(Work(seq, size - 1, 1, True))
    return Step(tuple(work))


def serve_experiment(exp, plan, chip, step_estimate_s: float, progress) -> dict[str, Any]:
    """Run a ``serve`` experiment's load ([serve]) through the engine, and the same requests through the scheduler
    priced by the estimate of one step (every step computes all its slots: the shapes are fixed) plus the host's
    measured work per step: per request and in aggregate, measured beside predicted."""
    from kernels.mesh import make_mesh
    from lab.core.serving import poisson_requests, summarize

    load = exp.serve
    rate = load.get("rate", float("inf"))
    requests = list(load.get("trace_requests") or ()) or poisson_requests(
        load["requests"], rate, load["prompt_len"], load["output_len"], load["seed"]
    )
    prompts = _prompts(requests, plan.model.vocab, load["seed"])
    pool = paged.pool_of(plan)
    engine = Engine(plan.model, make_mesh(plan.shape, slow=plan.slow_axes), plan.rules, pool, plan.dtype)
    engine.warmup(exp.warmup)  # the experiment's warm-up calls, as its profiled step had
    overhead = host_step_s(engine)
    progress(f"serving {len(requests)} requests on the engine (host work per step {overhead * 1e3:.2f} ms)")
    measured = serve(engine, requests, prompts, load.get("concurrency"))
    price = step_estimate_s + overhead
    predicted = drive(requests, pool, lambda plan_: (price, None), engine.replicas, load.get("concurrency"))
    by_rid = {s.req.rid: s for s in predicted.seqs}
    rows = [_request_row(s, by_rid[s.req.rid]) for s in sorted(measured.seqs, key=lambda s: s.req.rid)]
    return {
        "load": {k: str(v) if k.endswith("_len") else v for k, v in load.items() if k != "trace_requests"},
        "emulated": chip.kind == "cpu",
        "step_s": {
            "estimated_device": step_estimate_s,
            "host_overhead": overhead,
            "predicted": price,
            "measured_median": float(np.median(measured.step_times)) if measured.step_times else None,
        },
        "measured": summarize(measured),
        "predicted": summarize(predicted),
        "requests": rows,
        "pool_trace": {"measured": measured.pool_trace, "predicted": predicted.pool_trace},
    }


def _request_row(m, p) -> dict[str, Any]:
    def lat(s):
        ttft = s.first_token_s - s.req.arrival_s
        tpot = (s.finish_s - s.first_token_s) / (s.req.output_len - 1) if s.req.output_len > 1 else None
        return ttft, tpot, s.finish_s - s.req.arrival_s

    (mt, mp, me), (pt, pp, pe) = lat(m), lat(p)
    r = m.req
    return {
        "rid": r.rid,
        "arrival_s": r.arrival_s,
        "prompt_len": r.prompt_len,
        "output_len": r.output_len,
        "preemptions": m.preemptions,
        "ttft_s": {"measured": mt, "predicted": pt},
        "tpot_s": {"measured": mp, "predicted": pp},
        "e2e_s": {"measured": me, "predicted": pe},
    }
